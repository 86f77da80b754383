"""A run's first ``state.extras``: each key's record from the module that owns the key.

The keys and their owners: ``log_mark`` and ``num_input_tokens_seen`` (``observe.observers``), each early
stopper's ``key`` (``observe.stopping``), ``grad_scaler`` (``step.amp``), ``best_metric`` (here: the
tracker of ``metric_for_best_model``, a ``ckpt.best.BestMetric``), and what a ``StateStream`` keeps.

>>> from trainfold.trainer.args import TrainingArguments
>>> sorted(run_extras(TrainingArguments(fp16=True), metric_key="eval_loss"))
['best_metric', 'grad_scaler', 'log_mark']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainfold.ckpt import best
from trainfold.ckpt.best import BEST_METRIC_KEY
from trainfold.observe.observers import initial_extras
from trainfold.observe.stopping import EarlyStopping
from trainfold.step.amp import SCALER, LossScaling, initial_scaler
from trainfold.trainer.args import TrainingArguments

__all__ = ["BEST", "best_extras", "scaler_extras", "run_extras"]

BEST = BEST_METRIC_KEY  # the key of the best-metric tracker in state.extras (owned by ckpt.best)


def scaler_extras(fp16: bool) -> dict[str, Any]:
    """Return the loss scaler's record under its key when the run trains in float16, else nothing.

    >>> list(scaler_extras(True)), scaler_extras(False)
    (['grad_scaler'], {})
    """
    return {SCALER: initial_scaler(LossScaling())} if fp16 else {}


def best_extras(metric_key: str | None, greater_is_better: bool | None) -> dict[str, Any]:
    """Return the best-metric tracker under ``BEST`` when the run tracks a metric, else nothing.

    >>> best_extras("eval_loss", None)[BEST].greater_is_better.item(), best_extras(None, None)
    (False, {})
    """
    if metric_key is None:
        return {}
    return {BEST: best.best_metric(best.greater_is_better_for(metric_key, greater_is_better))}


def run_extras(
    args: TrainingArguments,
    *,
    metric_key: str | None = None,
    early: EarlyStopping | None = None,
    stream_extras: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the extras of a run's first state (so a checkpoint's template has the saved structure)."""
    return {
        **initial_extras(*([early] if early is not None else []), tokens_seen=args.tokens_seen != "no"),
        **scaler_extras(args.fp16),
        **best_extras(metric_key, args.greater_is_better),
        **(stream_extras or {}),
    }
