"""Observers of the training trajectory: logging windows (early stopping is in ``stopping``).

Side effects watch the states a fold produces; they never change what a step computes. What
they must remember across a resume (the last logging mark, the early-stopping counter) lives
in ``state.extras`` as small records of 0-d tensors, so a checkpoint carries it.

Logging uses the Hugging Face names. A log entry's ``loss`` is the exact mean of the per-step
losses since the last log, computed from the state's running ``loss_total``:

>>> import torch
>>> from trainfold.core.state import TrainState, scalar
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

from trainfold.core.state import TrainState, scalar
from trainfold.observe.stopping import EarlyStopping, EarlyStoppingRecord

__all__ = [
    "LOG_MARK",
    "TOKENS_SEEN",
    "LoggingPlan",
    "LogMark",
    "MetricWindow",
    "logging_plan",
    "should_log",
    "log_mark",
    "log_entry",
    "filtered_mean_loss",
    "mark_logged",
    "eval_entry",
    "train_summary",
    "initial_extras",
    "Observer",
    "notify",
    "log_if_due",
    "observing",
    "tap",
    "counting_input_tokens",
]

LOG_MARK = "log_mark"
TOKENS_SEEN = "num_input_tokens_seen"  # the key of the running input-token count in state.extras
TOKEN_MODES = ("all", "non_padding")  # what counting_input_tokens counts (include_num_input_tokens_seen)
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
    with ``first_step`` (whatever the strategy, even ``no``, as HF does), and at the ``last`` step of
    a run so its final partial window is not lost (HF drops it). Never twice for the same step.

    >>> plan = LoggingPlan("steps", 3)
    >>> [s for s in range(1, 10) if should_log(plan, s, 0)]
    [3, 6, 9]
    >>> should_log(plan, 7, 6, last=True), should_log(plan, 6, 6, last=True)
    (True, False)
    >>> [s for s in range(1, 4) if should_log(LoggingPlan("no", 1, first_step=True), s, 0, last=s == 3)]
    [1]
    """
    if step <= last_logged:
        return False
    if plan.first_step and step == 1:
        return True
    if plan.strategy == "no":
        return False
    if last:
        return True
    if plan.strategy == "epoch":
        return epoch_end
    return step % plan.steps == 0


# -- what to log -----------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class LogMark:
    """Where the last log was taken: the step, the running loss sum and the non-finite count then.

    >>> import torch
    >>> mark = LogMark(step=scalar(3), loss_total=scalar(4.5, torch.float64))
    >>> mark.step.item(), mark.loss_total.item(), LogMark().step.item()
    (3, 4.5, 0)
    """

    step: Tensor = attrs.field(factory=lambda: scalar(0))
    loss_total: Tensor = attrs.field(factory=lambda: scalar(0.0, torch.float64))
    nonfinite_losses: Tensor = attrs.field(factory=lambda: scalar(0))


def log_mark(state: TrainState, key: str = LOG_MARK) -> LogMark:
    """Return the state's last logging mark (the start of training when there is none).

    >>> from trainfold.core.state import TrainState
    >>> log_mark(TrainState(params={}, buffers={}, opt_state=None)).step.item()
    0
    """
    mark = state.extras.get(key)
    return LogMark() if mark is None else mark


def mark_logged(state: TrainState, key: str = LOG_MARK) -> TrainState:
    """Return ``state`` with its logging mark moved to the current step (a new state).

    >>> from trainfold.core.state import TrainState, scalar
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(7))
    >>> log_mark(mark_logged(s)).step.item()
    7
    """
    mark = LogMark(
        step=state.step.detach().clone(),
        loss_total=state.loss_total.detach().clone(),
        nonfinite_losses=state.nonfinite_losses.detach().clone(),
    )
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
    float64 sums), over the steps whose loss was finite: ``logging_nan_inf_filter``, always on, which
    stands in for an inf/NaN step with the loss of the others (see ``filtered_mean_loss``); a window
    of only non-finite steps logs the mean of every finite step loss so far, never NaN. ``grad_norm``
    (before clipping) and ``learning_rate`` are those of the last step; ``epoch`` is fractional from
    the data cursor when ``steps_per_epoch`` is given.

    >>> import torch
    >>> from trainfold.core.state import Cursor, TrainState
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
    tokens = {TOKENS_SEEN: int(state.extras[TOKENS_SEEN])} if TOKENS_SEEN in state.extras else {}
    return {
        "loss": filtered_mean_loss(state, mark),
        "grad_norm": float(metrics["grad_norm"]),
        "learning_rate": float(metrics["learning_rate"]),
        **tokens,
        "epoch": _epoch(state, steps_per_epoch),
        "step": int(state.step),
    }


def _mean_loss(state: TrainState, total_before: Tensor, nonfinite_before: Tensor, steps: int) -> float:
    counted = steps - (int(state.nonfinite_losses) - int(nonfinite_before))
    return ((state.loss_total.double() - total_before.double()) / counted).item() if counted > 0 else math.nan


def filtered_mean_loss(state: TrainState, mark: LogMark | None = None) -> float:
    """Return the logged loss of the window since ``mark``: HF's ``logging_nan_inf_filter``, done exactly.

    HF replaces an inf/NaN step's loss by an average of the window's others; each non-finite step
    counting as the mean of the finite ones leaves exactly the mean over the finite steps, which is
    what this returns. (HF's own formula, ``tr_loss / (1 + steps in the window)``, divides by one step
    too many, so it logs 0.75x the loss for a window [finite, nan], and 0.0 for a window of only
    non-finite steps.) A window with no finite step gets the mean of all finite step losses so far,
    the average HF's code comment promises; NaN only when no step has had a finite loss yet.

    >>> import torch
    >>> from trainfold.core.state import TrainState
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(4), loss_total=scalar(6.0, torch.float64),
    ...                nonfinite_losses=scalar(1))
    >>> filtered_mean_loss(s, LogMark(step=scalar(2), loss_total=scalar(4.0, torch.float64)))   # [2.0, nan]
    2.0
    >>> filtered_mean_loss(s, LogMark(step=scalar(3), loss_total=scalar(6.0, torch.float64)))   # [nan]: 6 / 3
    2.0
    """
    mark = log_mark(state) if mark is None else mark
    steps = int(state.step) - int(mark.step)
    window = _mean_loss(state, mark.loss_total, mark.nonfinite_losses, steps)
    if not math.isnan(window) or steps <= 0:
        return window
    return _mean_loss(state, torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64), int(state.step))


_STEP_METRICS = frozenset({"loss", "grad_norm", "learning_rate", "num_items"})


@attrs.define
class MetricWindow:
    """Window means of a step's other metrics (an objective's ``aux``: DPO rewards, GRPO rewards).

    ``add(state)`` after each step sums every scalar metric the step reported besides the loss,
    grad norm, learning rate and item count; ``take()`` returns their means over the steps since
    the last ``take`` (a metric that first appears mid-window, over the steps since it appeared)
    and starts a new window. A step that did not advance the state (an
    all-ignored batch) is not counted twice. The sums live in this process, as TRL keeps its
    stored metrics: after a resume the first window covers the steps since the resume (the loss's
    window mean stays exact, from ``state.loss_total``).

    >>> from trainfold.core.state import TrainState
    >>> window = MetricWindow()
    >>> for step, margin in [(1, 0.5), (2, 1.5)]:
    ...     window.add(TrainState(params={}, buffers={}, opt_state=None, step=scalar(step),
    ...                           metrics={"loss": torch.tensor(0.7), "rewards/margins": torch.tensor(margin)}))
    >>> window.take(), window.take()
    ({'rewards/margins': 1.0}, {})
    """

    sums: dict[str, tuple[float, int]] = attrs.field(factory=dict)  # name -> (sum, steps that reported it)
    last_step: int = -1

    def add(self, state: TrainState) -> None:
        """Count ``state``'s metrics into the window (once per step)."""
        step = int(state.step)
        if step == self.last_step:
            return
        self.last_step = step
        for name, value in state.metrics.items():
            if name not in _STEP_METRICS and isinstance(value, Tensor) and value.numel() == 1:
                total, n = self.sums.get(name, (0.0, 0))
                self.sums[name] = (total + float(value), n + 1)

    def take(self) -> dict[str, float]:
        """Return the window's means and start a new window."""
        means = {name: total / n for name, (total, n) in self.sums.items()}
        self.sums = {}
        return means


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
    >>> from trainfold.core.state import TrainState, scalar
    >>> s0 = TrainState(params={}, buffers={}, opt_state=None)
    >>> s1 = attrs.evolve(s0, step=scalar(4), loss_total=scalar(6.0, torch.float64))
    >>> out = train_summary(s1, s0, runtime=2.0, num_samples=32)
    >>> out["train_loss"], out["train_steps_per_second"], out["train_samples_per_second"]
    (1.5, 2.0, 16.0)
    """
    steps = int(state.step) - int(start.step)
    loss = _mean_loss(state, start.loss_total, start.nonfinite_losses, steps)
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
    window: MetricWindow | None = None,
) -> TrainState:
    """Log the window ending at ``state`` if ``plan`` says so; return the state with its mark moved.

    The entry goes to each reporter (``reporter.log(entry, step)``) and each observer
    ``(state, entry)``; with a ``window`` it also holds the window means of the other metrics.
    When no log is due, ``state`` comes back unchanged.

    >>> import torch
    >>> from trainfold.core.state import TrainState
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
    if window is not None:
        entry.update(window.take())
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


def counting_input_tokens(
    step: Callable[[TrainState, Any], TrainState],
    mode: str = "all",
    input_name: str = "input_ids",
    collective: Any = None,
) -> Callable[[TrainState, Any], TrainState]:
    """Return ``step`` that also adds the batch's input tokens to ``state.extras[TOKENS_SEEN]`` (HF's
    ``include_num_input_tokens_seen``): every token (``"all"``) or the attention mask's ones
    (``"non_padding"``), summed over ranks. The count lives in the state, so it resumes exactly;
    put ``TOKENS_SEEN: scalar(0)`` in the first state's extras (``initial_extras(tokens_seen=True)``).

    >>> from trainfold.core.state import TrainState
    >>> s = TrainState(params={}, buffers={}, opt_state=None, extras={TOKENS_SEEN: scalar(0)})
    >>> counted = counting_input_tokens(lambda state, batch: state, "non_padding")
    >>> batch = [{"input_ids": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}]
    >>> int(counted(s, batch).extras[TOKENS_SEEN])
    3
    """
    if mode not in TOKEN_MODES:
        raise ValueError(f"mode={mode!r} must be 'all' or 'non_padding'")

    def tokens(micro: Mapping[str, Any]) -> int:
        if mode == "non_padding" and "attention_mask" in micro:
            return int(micro["attention_mask"].sum())
        if input_name not in micro:
            raise KeyError(
                f"cannot count input tokens: the micro-batch has no {input_name!r} (keys: {sorted(micro)}); "
                "set model_input_name, or include_num_input_tokens_seen='no'"
            )
        return micro[input_name].numel()

    def counted(state: TrainState, batch: Any) -> TrainState:
        new = step(state, batch)
        seen = torch.tensor(sum(tokens(mb) for mb in batch), dtype=torch.int64)
        if collective is not None:
            collective.sum_([seen])
        return attrs.evolve(new, extras={**new.extras, TOKENS_SEEN: state.extras[TOKENS_SEEN] + seen})

    return counted


def initial_extras(*stoppers: EarlyStopping, log_key: str = LOG_MARK, tokens_seen: bool = False) -> dict[str, Any]:
    """Return the ``extras`` a run's first state needs: a logging mark and one record per early stopper.

    Pass it to ``init_state(..., extras=...)`` so that the template a checkpoint loads into has the
    same structure as the states that were saved.

    >>> from trainfold.observe.stopping import early_stopping
    >>> sorted(initial_extras(early_stopping("eval_loss")))
    ['early_stopping', 'log_mark']
    """
    tokens = {TOKENS_SEEN: scalar(0)} if tokens_seen else {}
    return {log_key: LogMark(), **tokens, **{es.key: EarlyStoppingRecord() for es in stoppers}}
