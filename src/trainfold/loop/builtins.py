"""The built-in hooks: ``log``, ``evaluate``, ``save``, ``early_stop``, each a ``Hook`` carrying its settings.

They are made from the ground floors: log entries from ``observe`` (the window's mean loss, grad norm,
learning rate), evaluation from ``evaluation.evaluate_batches``, checkpoints from ``ckpt`` (atomic, verified,
rotated), early stopping and the best metric from ``observe.stopping`` and ``ckpt.best``; what they
must carry across a resume lives in ``state.extras``.

>>> log(every=10).kind, save(every=500, keep=2).every.at_end, early_stop("eval_loss", patience=3).kind
('log', True, 'judge')
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from trainfold.ckpt import best as best_metric
from trainfold.ckpt import policy
from trainfold.core.state import TrainState
from trainfold.evaluation.evaluation import evaluate_batches
from trainfold.loop.hooks import Every, Hook
from trainfold.loop.record import RunLog
from trainfold.observe.divergence import diverged
from trainfold.observe.entries import LOG_MARK, LogMark, eval_entry, log_entry, log_mark, mark_logged
from trainfold.observe.stopping import EarlyStoppingRecord, early_stopping, patience_exhausted, record_evaluation

__all__ = ["log", "evaluate", "save", "early_stop", "BEST"]

BEST = best_metric.BEST_METRIC_KEY  # where ``save(best=...)`` keeps the best metric in ``state.extras``


def _schedule(every: int | Every | None, at_end: bool) -> Every:
    if isinstance(every, Every):
        return every
    if every is not None and (isinstance(every, bool) or not isinstance(every, int)):
        raise TypeError(f"every={every!r} must be a number of steps (int) or a loop.Every(...)")
    return Every(steps=every, at_end=at_end)


def _send(entry: Mapping[str, Any], state: TrainState, to: Sequence[Any]) -> None:
    for reporter in to:
        if hasattr(reporter, "log"):
            reporter.log(dict(entry), int(state.step))
        else:
            reporter(dict(entry))


def log(every: int | Every | None = 500, to: Sequence[Any] = (), *, key: str = LOG_MARK) -> Hook:
    """Log the window since the last log (mean loss, grad norm, learning rate, epoch) every ``every`` steps and at
    the end; entries go to the run's history and to ``to`` (reporters with ``.log(entry, step)``, or functions).

    >>> log(every=10, to=[print]).every
    Every(steps=10, epochs=None, seconds=None, at_end=True)
    """
    to = tuple(to)

    def logged(state: TrainState, run: RunLog) -> TrainState:
        if int(state.step) <= int(log_mark(state, key).step):
            return state  # nothing since the last log (a resume at a logged step)
        entry = log_entry(state, log_mark(state, key))
        run.record(entry)
        _send(entry, state, to)
        return mark_logged(state, key)

    return Hook(logged, _schedule(every, True), kind="log", extras={key: LogMark()}, name="log")


def evaluate(
    eval_data: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]],
    every: int | Every | None = 500,
    metrics: Callable[..., Mapping[str, Any]] | None = None,
    *,
    model: nn.Module | Callable[..., Any],
    loss: Callable[..., Any] | None = None,
    prefix: str = "eval",
    to: Sequence[Any] = (),
    at_end: bool = True,
) -> Hook:
    """Evaluate the state on ``eval_data`` (a list of batches, or a function returning them) every ``every`` steps
    and at the end, with ``model`` and ``loss`` (default: the causal LM loss); ``metrics`` is ``compute_metrics``
    (``EvalPrediction -> dict``). Metrics are named ``{prefix}_*``, recorded and kept in ``log.metrics``.

    >>> evaluate([], every=100, model=nn.Linear(1, 1)).every.steps
    100
    >>> evaluate(iter([]), model=nn.Linear(1, 1))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: loop.evaluate: eval_data is an iterator, used up by the first evaluation; ...
    """
    if not callable(eval_data) and iter(eval_data) is eval_data:
        raise TypeError(
            "loop.evaluate: eval_data is an iterator, used up by the first evaluation; pass a list of batches or a "
            "function returning them"
        )
    options: dict[str, Any] = dict(compute_metrics=metrics, metric_key_prefix=prefix, speed_metrics=False)
    if loss is not None:
        options["loss"] = loss
    to = tuple(to)

    def evaluated(state: TrainState, run: RunLog) -> None:
        batches = eval_data() if callable(eval_data) else eval_data
        results = evaluate_batches(model, state, batches, **options)
        entry = eval_entry(results, state, prefix=prefix)
        run.record(entry)
        _send(entry, state, to)
        run.metrics.update(results)
        run.evaluations += 1

    return Hook(evaluated, _schedule(every, at_end), kind="evaluate", name="evaluate")


def _metric(metrics: Mapping[str, Any], name: str) -> float:
    for key in (name, f"eval_{name}", name.removeprefix("eval_")):
        if key in metrics:
            return float(metrics[key])
    raise KeyError(
        f"the best metric {name!r} is not among the evaluation's metrics {sorted(metrics)}; name one of them"
    )


def save(
    every: int | Every | None = 500,
    keep: int | None = None,
    best: str | None = None,
    *,
    greater_is_better: bool | None = None,
    model: nn.Module | None = None,
    at_end: bool = True,
) -> Hook:
    """Save a checkpoint every ``every`` steps and at the end, keeping ``keep`` in all (``None``: all), as HF's
    ``save_total_limit``: the oldest go, never the newest nor, with ``best`` (a metric name), the best one.
    Needs ``loop.run(..., output_dir=...)``; ``model`` writes ``model.safetensors`` loadable by
    ``from_pretrained``. Params that are not finite are never saved.

    >>> hook = save(every=500, keep=2, best="eval_loss")
    >>> hook.every.steps, sorted(hook.extras)
    (500, ['best_metric'])
    """
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"loop.save: keep={keep!r} must be a positive int (checkpoints kept) or None (all)")
    extras = {}
    if best is not None:
        extras[BEST] = best_metric.best_metric(best_metric.greater_is_better_for(best, greater_is_better))

    def track(state: TrainState, run: RunLog) -> TrainState:
        value = _metric(run.metrics, best or "")
        updated, _ = best_metric.update_best(state.extras[BEST], value, int(state.step))
        return attrs.evolve(state, extras={**state.extras, BEST: updated})

    def saved(state: TrainState, run: RunLog) -> None:
        if run.directory is None:
            raise ValueError("loop.save needs a directory to save into: pass output_dir= to loop.run")
        if diverged(state, confirm=True):  # never write inf/NaN params over the finite checkpoints
            run.diverged_at = int(state.step) if run.diverged_at is None else run.diverged_at
            run.stop("diverged")
            return
        kept = []
        if best is not None and (path := policy.best_checkpoint(run.directory.root, state.extras[BEST])) is not None:
            kept.append(path)
        run.saved.append(run.directory.save(state, keep_total=keep, keep=kept, model=model))

    judge = track if best is not None else None
    return Hook(saved, _schedule(every, at_end), kind="save", extras=extras, judge=judge, name="save")


def early_stop(
    metric: str,
    patience: int = 1,
    threshold: float = 0.0,
    *,
    greater_is_better: bool | None = None,
    key: str = "early_stopping",
) -> Hook:
    """Stop the run (status ``stopped``) after ``patience`` evaluations in a row that did not beat the best counted
    value of ``metric`` by more than ``threshold`` (``observe.stopping``); its counters live in ``state.extras``.

    >>> early_stop("eval_loss", patience=2, threshold=0.01).extras["early_stopping"].bad_evals.item()
    0
    """
    config = early_stopping(metric, patience, threshold, greater_is_better, key=key)

    def judged(state: TrainState, run: RunLog) -> TrainState:
        return record_evaluation(config, state, run.metrics)

    extras = {key: EarlyStoppingRecord()}
    halts = patience_exhausted(config)  # a run resumed after it stopped early stops at once
    return Hook(None, Every(), kind="judge", extras=extras, judge=judged, name="early_stop", halts=halts)
