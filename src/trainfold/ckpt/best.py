"""The best value of a metric so far: which direction is better, and a tracker that lives in the state.

``greater_is_better_for`` settles a metric's direction from its name where it is certain;
``BestMetric`` is a record of 0-d tensors kept in ``state.extras[BEST_METRIC_KEY]``, so it survives
a resume (``trainfold.ckpt.policy.best_checkpoint`` finds its checkpoint).
"""

from __future__ import annotations

import math
import re

import attrs
import torch
from torch import Tensor

__all__ = ["BEST_METRIC_KEY", "greater_is_better_for", "BestMetric", "best_metric", "update_best"]

# The ``state.extras`` key of the best-metric tracker (``BestMetric``), which ``best_checkpoint`` reads.
BEST_METRIC_KEY = "best_metric"

_LOWER_PARTS = ("loss", "perplexity", "error")
_LOWER_WORDS = {"ppl", "wer", "cer", "ter", "mse", "mae", "rmse", "nll", "eer"}
_HIGHER_PREFIXES = (
    "accuracy",
    "f1",
    "precision",
    "recall",
    "bleu",
    "rouge",
    "meteor",
    "chrf",
    "auc",
    "auroc",
    "exact",
    "matthews",
    "pearson",
    "spearman",
    "ndcg",
    "bertscore",
)
_HIGHER_WORDS = {"acc", "em", "mcc", "r2", "map", "mrr", "sacrebleu"}


def greater_is_better_for(metric_name: str, greater_is_better: bool | None = None) -> bool:
    """Return whether a larger ``metric_name`` is better: ``greater_is_better`` if given, else from the name.

    The name decides only where the direction is certain: ``loss``, ``perplexity``, ``error``
    anywhere, or the words ``ppl``, ``wer``, ``cer``, ``mse``, ``mae``, ``rmse``, ``nll`` mean lower
    is better; ``accuracy``, ``f1``, ``precision``, ``recall``, ``bleu``, ``rouge``, ``meteor``,
    ``auc``, ``exact_match``, ``matthews``, ``pearson``, ``spearman``, ``ndcg``, ``mrr``, ... mean
    higher. Unknown or contradictory names raise ``ValueError`` asking for ``greater_is_better``.

    >>> greater_is_better_for("eval_loss"), greater_is_better_for("eval_perplexity")
    (False, False)
    >>> greater_is_better_for("eval_rougeL"), greater_is_better_for("bleu", greater_is_better=False)
    (True, False)
    """
    if greater_is_better is not None:
        return bool(greater_is_better)
    name = metric_name.lower()
    words = [w for w in re.split(r"[^a-z0-9]+", name) if w]
    lower = any(p in name for p in _LOWER_PARTS) or any(w in _LOWER_WORDS for w in words)
    higher = any(w.startswith(_HIGHER_PREFIXES) or w in _HIGHER_WORDS for w in words)
    if lower != higher:
        return higher
    why = "names both a lower- and a higher-is-better metric" if lower else "is not a metric whose direction is known"
    raise ValueError(f"metric_for_best_model {metric_name!r} {why}; pass greater_is_better=True or False")


@attrs.frozen(eq=False)
class BestMetric:
    """The best value of a metric so far and the step it was reached at (``step`` −1: none yet).

    A record of 0-d tensors, so it lives in ``state.extras`` and survives a resume.

    >>> import torch
    >>> b = BestMetric(torch.tensor(0.25, dtype=torch.float64), torch.tensor(40), greater_is_better=torch.tensor(False))
    >>> b.value.item(), b.step.item(), update_best(b, 0.2, 50)[0].step.item()
    (0.25, 40, 50)
    """

    value: Tensor
    step: Tensor
    greater_is_better: Tensor


def best_metric(greater_is_better: bool) -> BestMetric:
    """Return the tracker before any evaluation: value ∓inf, step −1.

    >>> b = best_metric(greater_is_better=False)
    >>> b.value.item(), b.step.item()
    (inf, -1)
    """
    start = -math.inf if greater_is_better else math.inf
    return BestMetric(
        value=torch.tensor(start, dtype=torch.float64),
        step=torch.tensor(-1, dtype=torch.int64),
        greater_is_better=torch.tensor(bool(greater_is_better)),
    )


def update_best(best: BestMetric, value: float | Tensor, step: int | Tensor) -> tuple[BestMetric, bool]:
    """Return ``(tracker, improved)`` after seeing ``value`` at ``step``; ties and NaN do not improve.

    >>> b, up = update_best(best_metric(greater_is_better=True), 0.5, 10)
    >>> b.value.item(), b.step.item(), up, update_best(b, 0.5, 20)[1]
    (0.5, 10, True, False)
    """
    v = float(value)
    old = float(best.value)
    improved = not math.isnan(v) and (v > old if bool(best.greater_is_better) else v < old)
    if not improved:
        return best, False
    return attrs.evolve(
        best, value=torch.tensor(v, dtype=torch.float64), step=torch.tensor(int(step), dtype=torch.int64)
    ), True
