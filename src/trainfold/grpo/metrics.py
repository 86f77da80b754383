"""What TRL's ``GRPOTrainer`` logs about a generation, by its formulas (``grpo_trainer.py``, TRL 1.16).

>>> import torch
>>> nanstd(torch.tensor([1.0, float("nan"), 3.0])).item()  # unbiased, NaN left out
1.4142135381698608
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["generation_metrics", "nanstd"]


def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """Return the unbiased std of ``x`` leaving NaN out (TRL's ``nanstd``): NaN with fewer than 2 values.

    >>> nanstd(torch.tensor([[1.0, 1.0], [0.0, 2.0]]), dim=1).tolist()
    [0.0, 1.4142135381698608]
    """
    valid = ~torch.isnan(x)
    count = valid.sum() if dim is None else valid.sum(dim)
    mean = x.nanmean() if dim is None else x.nanmean(dim, keepdim=True)
    var = ((x - mean) ** 2).nanmean() if dim is None else ((x - mean) ** 2).nanmean(dim)
    return (var * count / (count - 1)).sqrt()


def generation_metrics(
    each: Tensor,
    names: Sequence[str],
    num_generations: int,
    completion_lengths: Tensor,
    truncated: Tensor,
    weights: Sequence[float] | None = None,
    scale_rewards: str = "group",
) -> dict[str, Tensor]:
    """Return the metrics TRL's ``GRPOTrainer`` logs for one generation, by its formulas.

    ``each`` holds each reward function's rewards ``(rows, functions)`` (NaN: not scored);
    ``rewards/{name}/mean`` and ``/std`` are their NaN-skipping mean and unbiased std;
    ``reward`` and ``reward_std`` those of the weighted sum; ``frac_reward_zero_std`` the fraction
    of rows whose group (``scale_rewards="batch"``: the whole batch) has zero std;
    ``completions/{mean,min,max}_length`` over all completions, ``completions/clipped_ratio`` the
    fraction that did not end (no EOS), and ``completions/{mean,min,max}_terminated_length`` over
    those that did (0 when none did).

    >>> each = torch.tensor([[1.0], [3.0], [2.0], [2.0]])
    >>> m = generation_metrics(each, ["f"], 2, torch.tensor([4, 2, 3, 1]), torch.tensor([True, False, False, False]))
    >>> {k: round(v.item(), 4) for k, v in m.items() if k.startswith("reward")}
    {'rewards/f/mean': 2.0, 'rewards/f/std': 0.8165, 'reward': 2.0, 'reward_std': 0.8165}
    >>> m["frac_reward_zero_std"].item(), m["completions/clipped_ratio"].item()
    (0.5, 0.25)
    >>> m["completions/max_length"].item(), m["completions/max_terminated_length"].item()
    (4.0, 3.0)
    """
    out: dict[str, Tensor] = {}
    for k, name in enumerate(names):
        column = each[:, k]
        out[f"rewards/{name}/mean"] = column.nanmean()
        out[f"rewards/{name}/std"] = nanstd(column)
    w = torch.tensor(list(weights) if weights is not None else [1.0] * each.shape[1], dtype=each.dtype)
    total = torch.nansum(each * w, dim=1)
    total[torch.isnan(each).all(dim=1)] = math.nan
    if scale_rewards == "batch":
        std = nanstd(total).expand(total.shape[0])
    else:
        std = nanstd(total.reshape(-1, num_generations), dim=1).repeat_interleave(num_generations)
    out["reward"] = total.nanmean()
    out["reward_std"] = nanstd(total)
    out["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean()
    lengths = completion_lengths.float()
    out["completions/mean_length"] = lengths.mean()
    out["completions/min_length"] = lengths.min()
    out["completions/max_length"] = lengths.max()
    out["completions/clipped_ratio"] = truncated.float().mean()
    ended = lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1)
    out["completions/mean_terminated_length"] = ended.mean()
    out["completions/min_terminated_length"] = ended.min()
    out["completions/max_terminated_length"] = ended.max()
    return out
