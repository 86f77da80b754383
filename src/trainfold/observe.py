"""Observers of the training trajectory: logging windows and early stopping.

Side effects watch the states a fold produces; they never change what a step computes. What
they must remember across a resume (the last logging mark, the early-stopping counter) lives
in ``state.extras`` as small records of 0-d tensors, so a checkpoint carries it.

Logging uses the Hugging Face names. A log entry's ``loss`` is the exact mean of the per-step
losses since the last log, computed from the state's running ``loss_total``:

>>> import torch
>>> from trainfold.state import TrainState, scalar
>>> state = TrainState(params={}, buffers={}, opt_state=None, step=scalar(4),
...                    loss_total=scalar(10.0, torch.float64))
>>> log_entry(state)["loss"]                     # 4 steps, losses summing to 10
2.5
>>> state = mark_logged(state)
>>> state = attrs.evolve(state, step=scalar(6), loss_total=scalar(13.0, torch.float64))
>>> log_entry(state)["loss"]                     # the 2 steps since the mark
1.5
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.checkpoint_policy import greater_is_better_for
from trainfold.state import TrainState, scalar

__all__ = [
    "LOG_MARK",
    "EARLY_STOPPING",
    "LoggingPlan",
    "LogMark",
    "logging_plan",
    "should_log",
    "log_mark",
    "log_entry",
    "mark_logged",
    "eval_entry",
    "train_summary",
    "initial_extras",
    "Observer",
    "notify",
    "log_if_due",
    "observing",
    "tap",
    "EarlyStopping",
    "EarlyStoppingRecord",
    "early_stopping",
    "improves",
    "update_early_stopping",
    "record_evaluation",
    "patience_exhausted",
]

LOG_MARK = "log_mark"
EARLY_STOPPING = "early_stopping"
LOGGING_STRATEGIES = ("no", "steps", "epoch")

# An observer sees the state and the entry just logged: the functional form of a callback.
Observer = Callable[[TrainState, Mapping[str, float]], None]


# -- when to log -----------------------------------------------------------------------------------


@attrs.frozen
class LoggingPlan:
    """When to log: ``strategy`` (``no``/``steps``/``epoch``), every ``steps`` steps, and at step 1.

    >>> plan = LoggingPlan("steps", 2, first_step=True)
    >>> [s for s in range(1, 7) if should_log(plan, s, s - 1)]
    [1, 2, 4, 6]
    """

    strategy: str = attrs.field(default="steps", validator=attrs.validators.in_(LOGGING_STRATEGIES))
    steps: int = attrs.field(default=500, validator=attrs.validators.ge(1))
    first_step: bool = False


def logging_plan(
    logging_strategy: str = "steps",
    logging_steps: int | float = 500,
    logging_first_step: bool = False,
    total_steps: int | None = None,
) -> LoggingPlan:
    """Resolve the Hugging Face logging settings into a ``LoggingPlan``.

    A ``logging_steps`` below 1 is a ratio of ``total_steps``, rounded up (as in HF).

    >>> logging_plan("steps", 0.1, total_steps=95).steps
    10
    >>> logging_plan("epoch").strategy
    'epoch'
    """
    errors = []
    if logging_strategy not in LOGGING_STRATEGIES:
        errors.append(f"logging_strategy={logging_strategy!r} is not one of {list(LOGGING_STRATEGIES)}")
    steps = 0
    if isinstance(logging_steps, bool) or not isinstance(logging_steps, (int, float)) or not logging_steps > 0:
        errors.append(f"logging_steps={logging_steps!r} must be a positive int, or a float in (0, 1) as a ratio")
    elif logging_steps < 1:
        if total_steps is None or total_steps < 1:
            errors.append(
                f"logging_steps={logging_steps!r} is a ratio of the total steps, but total_steps={total_steps!r}; "
                "pass total_steps (max_steps), or an int logging_steps"
            )
        else:
            steps = math.ceil(total_steps * logging_steps)
    elif logging_steps != int(logging_steps):
        errors.append(
            f"logging_steps={logging_steps!r} above 1 must be a whole number of steps, e.g. {round(logging_steps)}"
        )
    else:
        steps = int(logging_steps)
    if errors:
        raise ValueError("invalid logging settings:\n  " + "\n  ".join(errors))
    return LoggingPlan(strategy=logging_strategy, steps=steps, first_step=bool(logging_first_step))


def should_log(plan: LoggingPlan, step: int, last_logged: int, *, epoch_end: bool = False, last: bool = False) -> bool:
    """Say whether to log after ``step`` optimizer updates, the last log having been at ``last_logged``.

    Logs on multiples of ``plan.steps`` (strategy ``steps``), at epoch ends (``epoch``), at step 1
    with ``first_step``, and at the ``last`` step of a run so its final partial window is not lost
    (HF drops it). Never twice for the same step.

    >>> plan = LoggingPlan("steps", 3)
    >>> [s for s in range(1, 10) if should_log(plan, s, 0)]
    [3, 6, 9]
    >>> should_log(plan, 7, 6, last=True), should_log(plan, 6, 6, last=True)
    (True, False)
    """
    if plan.strategy == "no" or step <= last_logged:
        return False
    if last or (plan.first_step and step == 1):
        return True
    if plan.strategy == "epoch":
        return epoch_end
    return step % plan.steps == 0


# -- what to log -----------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class LogMark:
    """Where the last log was taken: the step and the running loss sum at that moment.

    >>> import torch
    >>> mark = LogMark(step=scalar(3), loss_total=scalar(4.5, torch.float64))
    >>> mark.step.item(), mark.loss_total.item(), LogMark().step.item()
    (3, 4.5, 0)
    """

    step: Tensor = attrs.field(factory=lambda: scalar(0))
    loss_total: Tensor = attrs.field(factory=lambda: scalar(0.0, torch.float64))


def log_mark(state: TrainState, key: str = LOG_MARK) -> LogMark:
    """Return the state's last logging mark (the start of training when there is none).

    >>> from trainfold.state import TrainState
    >>> log_mark(TrainState(params={}, buffers={}, opt_state=None)).step.item()
    0
    """
    mark = state.extras.get(key)
    return LogMark() if mark is None else mark


def mark_logged(state: TrainState, key: str = LOG_MARK) -> TrainState:
    """Return ``state`` with its logging mark moved to the current step (a new state).

    >>> from trainfold.state import TrainState, scalar
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(7))
    >>> log_mark(mark_logged(s)).step.item()
    7
    """
    mark = LogMark(step=state.step.detach().clone(), loss_total=state.loss_total.detach().clone())
    return attrs.evolve(state, extras={**state.extras, key: mark})


def _epoch(state: TrainState, steps_per_epoch: int | None) -> float:
    epoch, position = state.cursor.as_tuple()
    if not steps_per_epoch:
        return float(epoch)
    return epoch + position / steps_per_epoch


def log_entry(
    state: TrainState, mark: LogMark | None = None, *, steps_per_epoch: int | None = None
) -> dict[str, float]:
    """Return the log entry for the window since ``mark`` (default: the state's own mark).

    ``loss`` is the mean of the per-step losses in the window (exact: a difference of running
    float64 sums); ``grad_norm`` (before clipping) and ``learning_rate`` are those of the last
    step; ``epoch`` is fractional from the data cursor when ``steps_per_epoch`` is given.

    >>> import torch
    >>> from trainfold.state import Cursor, TrainState
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(3), cursor=Cursor(scalar(0), scalar(3)),
    ...                loss_total=scalar(4.0, torch.float64))
    >>> entry = log_entry(s, LogMark(step=scalar(1), loss_total=scalar(1.0, torch.float64)), steps_per_epoch=4)
    >>> entry["loss"], entry["epoch"], entry["step"], sorted(entry)
    (1.5, 0.75, 3, ['epoch', 'grad_norm', 'learning_rate', 'loss', 'step'])
    """
    mark = log_mark(state) if mark is None else mark
    steps = int(state.step) - int(mark.step)
    if steps <= 0:
        raise ValueError(
            f"nothing to log: the state is at step {int(state.step)} and the last log was at step "
            f"{int(mark.step)}; call log_entry only after a step (should_log decides when)"
        )
    metrics = state.metrics
    return {
        "loss": ((state.loss_total.double() - mark.loss_total.double()) / steps).item(),
        "grad_norm": float(metrics["grad_norm"]),
        "learning_rate": float(metrics["learning_rate"]),
        "epoch": _epoch(state, steps_per_epoch),
        "step": int(state.step),
    }


def _value(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


def eval_entry(
    metrics: Mapping[str, Any],
    state: TrainState | None = None,
    *,
    prefix: str = "eval",
    steps_per_epoch: int | None = None,
) -> dict[str, Any]:
    """Return an evaluation's log entry: every metric under ``{prefix}_``, then ``epoch`` and ``step``.

    >>> eval_entry({"loss": 1.5, "eval_accuracy": 0.5})
    {'eval_loss': 1.5, 'eval_accuracy': 0.5}
    """
    head = f"{prefix}_"
    entry = {(k if k.startswith(head) else head + k): _value(v) for k, v in metrics.items()}
    if state is not None:
        entry["epoch"] = _epoch(state, steps_per_epoch)
        entry["step"] = int(state.step)
    return entry


def train_summary(
    state: TrainState,
    start: TrainState,
    runtime: float,
    num_samples: int | None = None,
    *,
    steps_per_epoch: int | None = None,
) -> dict[str, float]:
    """Return the end-of-training entry for the steps from ``start`` to ``state`` (this run only).

    ``train_loss`` is the mean per-step loss over those steps (NaN if none ran).

    >>> import torch
    >>> from trainfold.state import TrainState, scalar
    >>> s0 = TrainState(params={}, buffers={}, opt_state=None)
    >>> s1 = attrs.evolve(s0, step=scalar(4), loss_total=scalar(6.0, torch.float64))
    >>> out = train_summary(s1, s0, runtime=2.0, num_samples=32)
    >>> out["train_loss"], out["train_steps_per_second"], out["train_samples_per_second"]
    (1.5, 2.0, 16.0)
    """
    steps = int(state.step) - int(start.step)
    loss = ((state.loss_total.double() - start.loss_total.double()) / steps).item() if steps > 0 else math.nan
    per_second = (lambda n: n / runtime) if runtime > 0 else (lambda n: math.nan)
    return {
        "train_runtime": float(runtime),
        "train_samples_per_second": per_second(num_samples) if num_samples is not None else math.nan,
        "train_steps_per_second": per_second(steps),
        "train_loss": loss,
        "epoch": _epoch(state, steps_per_epoch),
        "step": int(state.step),
    }


# -- observers and composition ----------------------------------------------------------------------


def notify(observers: Iterable[Observer], state: TrainState, logs: Mapping[str, Any]) -> None:
    """Call each observer ``(state, logs) -> None`` with a fresh copy of ``logs``.

    >>> seen = []
    >>> notify([lambda s, logs: seen.append(logs["loss"])], None, {"loss": 1.0})
    >>> seen
    [1.0]
    """
    for observe in observers:
        observe(state, dict(logs))


def log_if_due(
    state: TrainState,
    plan: LoggingPlan,
    reporters: Sequence[Any] = (),
    observers: Iterable[Observer] = (),
    *,
    steps_per_epoch: int | None = None,
    epoch_end: bool = False,
    last: bool = False,
) -> TrainState:
    """Log the window ending at ``state`` if ``plan`` says so; return the state with its mark moved.

    The entry goes to each reporter (``reporter.log(entry, step)``) and each observer
    ``(state, entry)``. When no log is due, ``state`` comes back unchanged.

    >>> import torch
    >>> from trainfold.state import TrainState
    >>> class Printer:
    ...     def log(self, entry, step):
    ...         print(step, entry["loss"])
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(2), loss_total=scalar(3.0, torch.float64))
    >>> logged = log_if_due(s, LoggingPlan("steps", 2), [Printer()])
    2 1.5
    >>> log_mark(logged).step.item(), log_if_due(logged, LoggingPlan("steps", 2)) is logged
    (2, True)
    """
    if not should_log(plan, int(state.step), int(log_mark(state).step), epoch_end=epoch_end, last=last):
        return state
    entry = log_entry(state, steps_per_epoch=steps_per_epoch)
    for reporter in reporters:
        reporter.log(entry, entry["step"])
    notify(observers, state, entry)
    return mark_logged(state)


def observing(
    step: Callable[[TrainState, Any], TrainState], *afters: Callable[[TrainState], TrainState]
) -> Callable[[TrainState, Any], TrainState]:
    """Return a step that runs ``step`` and then passes the new state through each of ``afters``.

    This is how observers that update ``state.extras`` (logging marks, early stopping) join a fold.

    >>> double_then_inc = observing(lambda s, b: s * b, lambda s: s + 1)
    >>> double_then_inc(3, 2)
    7
    """

    def observed(state: TrainState, batch: Any) -> TrainState:
        state = step(state, batch)
        for after in afters:
            state = after(state)
        return state

    return observed


def tap(effect: Callable[[TrainState], Any]) -> Callable[[TrainState], TrainState]:
    """Turn a side effect ``effect(state)`` into ``state -> state`` for ``observing``.

    >>> seen = []
    >>> tap(seen.append)(5), seen
    (5, [5])
    """

    def tapped(state: TrainState) -> TrainState:
        effect(state)
        return state

    return tapped


# -- early stopping --------------------------------------------------------------------------------


@attrs.frozen
class EarlyStopping:
    """Early-stopping settings (configuration; the counters live in ``EarlyStoppingRecord``).

    Make one with :func:`early_stopping`, which checks the values and infers ``greater_is_better``.

    >>> es = EarlyStopping("eval_accuracy", patience=3, threshold=0.01, greater_is_better=True)
    >>> improves(es, 0.80, 0.805), improves(es, 0.80, 0.82), es.key
    (False, True, 'early_stopping')
    """

    metric: str
    patience: int
    threshold: float
    greater_is_better: bool
    key: str = EARLY_STOPPING


@attrs.frozen(eq=False)
class EarlyStoppingRecord:
    """The best counted value of the metric (NaN before the first) and evaluations since it.

    >>> r = EarlyStoppingRecord()
    >>> r.best.item(), r.bad_evals.item()
    (nan, 0)
    """

    best: Tensor = attrs.field(factory=lambda: scalar(math.nan, torch.float64))
    bad_evals: Tensor = attrs.field(factory=lambda: scalar(0))


def early_stopping(
    metric: str,
    patience: int = 1,
    threshold: float = 0.0,
    greater_is_better: bool | None = None,
    *,
    key: str = EARLY_STOPPING,
) -> EarlyStopping:
    """Return early-stopping settings: stop after ``patience`` evaluations without a counted improvement.

    An evaluation *counts* as an improvement when it beats the best counted value by more than
    ``threshold``; only then does the best value move and the counter reset. So progress is
    always measured from the last counted improvement, and a metric that keeps improving by
    ``r`` per evaluation is stopped exactly when ``patience * r <= threshold``, i.e. when it
    gains no more than ``threshold`` over ``patience`` evaluations. (HF moves its best value on
    every improvement, however small, so steady progress of 0.4 per evaluation with
    ``threshold=0.5`` stops it; here it does not with ``patience >= 2``.) A NaN value never counts.

    ``greater_is_better`` must be given unless the name settles it (``checkpoint_policy.greater_is_better_for``).

    >>> es = early_stopping("eval_loss", patience=2, threshold=0.5)
    >>> es.greater_is_better
    False
    """
    errors = []
    if greater_is_better is None:
        try:  # one rule for the whole library: the one best-model tracking uses
            greater_is_better = greater_is_better_for(metric)
        except ValueError as err:
            errors.append(str(err))
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        errors.append(f"patience={patience!r} must be an int >= 1 (evaluations without improvement before stopping)")
    if not isinstance(threshold, (int, float)) or not threshold >= 0 or math.isinf(threshold):
        errors.append(f"threshold={threshold!r} must be a finite number >= 0")
    if errors:
        raise ValueError("invalid early stopping settings:\n  " + "\n  ".join(errors))
    return EarlyStopping(
        metric=metric, patience=patience, threshold=float(threshold), greater_is_better=bool(greater_is_better), key=key
    )


def improves(config: EarlyStopping, best: float, value: float) -> bool:
    """Say whether ``value`` counts as an improvement over ``best`` (NaN ``best``: none yet).

    >>> es = early_stopping("loss", patience=1, threshold=0.5)
    >>> improves(es, 10.0, 9.6), improves(es, 10.0, 9.2), improves(es, float("nan"), 3.0)
    (False, True, True)
    """
    if math.isnan(value):
        return False
    if math.isnan(best):
        return True
    gain = value - best if config.greater_is_better else best - value
    return gain > config.threshold


def update_early_stopping(config: EarlyStopping, record: EarlyStoppingRecord, value: float) -> EarlyStoppingRecord:
    """Return the record after one evaluation of the metric gave ``value``.

    >>> es = early_stopping("loss", patience=2, threshold=0.5)
    >>> r = EarlyStoppingRecord()
    >>> for v in [10.0, 9.6, 9.2, 8.8]:
    ...     r = update_early_stopping(es, r, v)
    ...     print(r.best.item(), r.bad_evals.item())
    10.0 0
    10.0 1
    9.2 0
    9.2 1
    """
    value = float(value)
    if improves(config, float(record.best), value):
        return EarlyStoppingRecord(best=scalar(value, torch.float64), bad_evals=scalar(0))
    return EarlyStoppingRecord(best=record.best.clone(), bad_evals=record.bad_evals + 1)


def _metric_value(config: EarlyStopping, metrics: Mapping[str, Any]) -> float:
    for name in (config.metric, f"eval_{config.metric}", config.metric.removeprefix("eval_")):
        if name in metrics:
            return float(_value(metrics[name]))
    raise KeyError(
        f"early stopping watches {config.metric!r}, but the evaluation returned only {sorted(metrics)}; "
        "set the metric to one of these names, or make compute_metrics return it"
    )


def record_evaluation(config: EarlyStopping, state: TrainState, metrics: Mapping[str, Any]) -> TrainState:
    """Return ``state`` with its early-stopping record updated by an evaluation's ``metrics``.

    The metric is looked up as named, then with an ``eval_`` prefix.

    >>> from trainfold.state import TrainState
    >>> es = early_stopping("loss", patience=2)
    >>> s = record_evaluation(es, TrainState(params={}, buffers={}, opt_state=None), {"eval_loss": 0.7})
    >>> s = record_evaluation(es, s, {"eval_loss": 0.9})
    >>> s.extras["early_stopping"].best.item(), s.extras["early_stopping"].bad_evals.item()
    (0.7, 1)
    """
    record = state.extras.get(config.key) or EarlyStoppingRecord()
    record = update_early_stopping(config, record, _metric_value(config, metrics))
    return attrs.evolve(state, extras={**state.extras, config.key: record})


def patience_exhausted(config: EarlyStopping) -> Callable[[TrainState], bool]:
    """Return the fold's stop predicate: true once ``patience`` evaluations in a row did not count.

    >>> from trainfold.state import TrainState
    >>> es = early_stopping("loss", patience=1)
    >>> s = TrainState(params={}, buffers={}, opt_state=None)
    >>> stop = patience_exhausted(es)
    >>> stop(s), stop(record_evaluation(es, record_evaluation(es, s, {"eval_loss": 1.0}), {"eval_loss": 1.0}))
    (False, True)
    """

    def stop(state: TrainState) -> bool:
        record = state.extras.get(config.key)
        return record is not None and int(record.bad_evals) >= config.patience

    return stop


def initial_extras(*stoppers: EarlyStopping, log_key: str = LOG_MARK) -> dict[str, Any]:
    """Return the ``extras`` a run's first state needs: a logging mark and one record per early stopper.

    Pass it to ``init_state(..., extras=...)`` so that the template a checkpoint loads into has the
    same structure as the states that were saved.

    >>> sorted(initial_extras(early_stopping("eval_loss")))
    ['early_stopping', 'log_mark']
    """
    return {log_key: LogMark(), **{es.key: EarlyStoppingRecord() for es in stoppers}}
