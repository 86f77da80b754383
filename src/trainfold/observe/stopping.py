"""Early stopping as a pure record and a stop predicate for the fold.

The settings (``EarlyStopping``) are configuration; the counters (``EarlyStoppingRecord``) live in
``state.extras`` so a checkpoint carries them and a resumed run stops where the whole run would.
An evaluation counts as an improvement only when it beats the best *counted* value by more than
``threshold``, so steady slow progress is not mistaken for a plateau.

>>> config = early_stopping("eval_loss", patience=2, threshold=0.5)
>>> record = EarlyStoppingRecord()
>>> for value in (10.0, 9.6, 9.2, 8.8):      # 0.4 per evaluation: each pair gains 0.8 > 0.5
...     record = update_early_stopping(config, record, value)
>>> float(record.best), int(record.bad_evals)
(9.2, 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.ckpt.best import greater_is_better_for
from trainfold.core.state import TrainState, scalar

__all__ = [
    "EARLY_STOPPING",
    "EarlyStopping",
    "EarlyStoppingRecord",
    "early_stopping",
    "improves",
    "update_early_stopping",
    "record_evaluation",
    "patience_exhausted",
]

EARLY_STOPPING = "early_stopping"


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

    ``greater_is_better`` must be given unless the name settles it (``ckpt.best.greater_is_better_for``).

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
            value = metrics[name]
            return float(value.item() if isinstance(value, Tensor) else value)
    raise KeyError(
        f"early stopping watches {config.metric!r}, but the evaluation returned only {sorted(metrics)}; "
        "set the metric to one of these names, or make compute_metrics return it"
    )


def record_evaluation(config: EarlyStopping, state: TrainState, metrics: Mapping[str, Any]) -> TrainState:
    """Return ``state`` with its early-stopping record updated by an evaluation's ``metrics``.

    The metric is looked up as named, then with an ``eval_`` prefix.

    >>> from trainfold.core.state import TrainState
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

    >>> from trainfold.core.state import TrainState
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
