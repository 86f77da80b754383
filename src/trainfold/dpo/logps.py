"""What DPO's objective and its reference precompute share of a preference batch: its columns and its halves.

A collated preference batch (``trainfold.dpo.objective.preference_collate``) holds every ``prompt+chosen``
row, then every ``prompt+rejected`` row; the rows' completion log-probs come from
``trainfold.core.logps.completion_logps``, :func:`halves` splits a per-row tensor into its chosen and rejected
halves, and :func:`token_means` gives TRL's token-weighted metrics (``logits/chosen``, ``entropy``...).

>>> import torch
>>> [t.tolist() for t in halves(torch.arange(4))]
[[0, 1], [2, 3]]
"""

from __future__ import annotations

from torch import Tensor

__all__ = [
    "MODEL_KEYS",
    "REF_KEYS",
    "halves",
    "token_means",
]

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")  # what the model sees of a preference batch


def halves(x: Tensor) -> tuple[Tensor, Tensor]:
    """Return the chosen and the rejected half of a per-row tensor."""
    n = x.shape[0] // 2
    return x[:n], x[n:]


def token_means(stats: Tensor, lengths: tuple[Tensor, Tensor], weight: Tensor) -> dict[str, Tensor]:
    """Return TRL's token-weighted metrics of a micro-batch (its token means), times ``weight``."""
    (sc, sr), (nc, nr) = halves(stats), lengths
    tokens_c, tokens_r = nc.sum().clamp(min=1), nr.sum().clamp(min=1)
    return {
        "logits/chosen": sc[:, 0].sum() / tokens_c * weight,
        "logits/rejected": sr[:, 0].sum() / tokens_r * weight,
        "entropy": stats[:, 1].sum() / (nc.sum() + nr.sum()).clamp(min=1) * weight,
        "mean_token_accuracy": sc[:, 2].sum() / tokens_c * weight,
    }
