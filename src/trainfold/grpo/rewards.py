"""GRPO's rewards: reward functions combined with weights, and group-relative advantages.

A reward function is ``reward(prompts, completions, **columns) -> list[float]`` (``None`` or NaN
for "no score"), called by keyword as TRL calls it, so TRL's ``def reward(completions, **kwargs)`` works.
:func:`group_advantages` compares each completion with the others of its prompt:
``(r − mean) / (std + 1e-4)`` per group of ``num_generations`` rows.

>>> import torch
>>> [round(a, 4) for a in group_advantages(torch.tensor([5.0, 2.0, 4.0, 4.0]), 4).tolist()]
[0.9933, -1.3906, 0.1987, 0.1987]
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SCALE_REWARDS",
    "RewardFunc",
    "combine_rewards",
    "group_advantages",
    "normalized_sum_advantages",
    "reward_advantages",
    "reward_name",
]

RewardFunc = Callable[..., Sequence[float | None]]
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
_log = logging.getLogger(__name__)


def reward_name(fn: RewardFunc) -> str:
    """Return a reward function's name in metrics: its ``__name__``, else its type's name."""
    return getattr(fn, "__name__", type(fn).__name__)


def _as_reply(prompt: Any, completion: Any) -> Any:
    """Return ``completion`` as TRL's ``GRPOTrainer`` gives it: an assistant message list for a chat prompt."""
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]
    return [{"role": "assistant", "content": completion}] if chat and isinstance(completion, str) else completion


def combine_rewards(
    reward_funcs: Sequence[RewardFunc],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Return ``(total, each)``: the weighted sum of the rewards, and each function's rewards.

    ``each`` has shape ``(rows, functions)``; ``None`` becomes NaN. ``total`` ignores NaN entries
    (a sum over the scored functions) and is NaN only where no function scored the row.

    >>> def length(prompts, completions, **_): return [float(len(c)) for c in completions]
    >>> def none_for_b(prompts, completions, **_): return [None if c == "b" else 1.0 for c in completions]
    >>> total, each = combine_rewards([length, none_for_b], ["p", "p"], ["aa", "b"], weights=[1.0, 2.0])
    >>> total.tolist()
    [4.0, 1.0]

    A text completion of a conversational prompt (a message list) reaches the functions as TRL passes it,
    ``[{"role": "assistant", "content": text}]``:

    >>> chat = [{"role": "user", "content": "hi"}]
    >>> combine_rewards([lambda completions, **_: [len(completions[0][0]["content"])]], [chat], ["abc"])[0].tolist()
    [3.0]
    """
    completions = [_as_reply(p, c) for p, c in zip(prompts, completions)]
    if not reward_funcs:
        raise ValueError("combine_rewards needs at least one reward function")
    if weights is not None and len(weights) != len(reward_funcs):
        raise ValueError(
            f"got {len(weights)} reward weights for {len(reward_funcs)} reward functions; give one weight per function"
        )
    cols = dict(columns or {})
    scores = []
    for fn in reward_funcs:
        values = list(_called(fn, list(prompts), list(completions), cols))
        if len(values) != len(completions):
            raise ValueError(
                f"reward function {reward_name(fn)} returned {len(values)} values for {len(completions)} completions; "
                "it must return one float (or None) per completion"
            )
        scores.append([math.nan if v is None else float(v) for v in values])
    each = torch.tensor(scores, dtype=torch.float32).T.reshape(len(completions), len(reward_funcs))
    w = torch.tensor(list(weights) if weights is not None else [1.0] * len(reward_funcs), dtype=torch.float32)
    total = torch.nansum(each * w, dim=1)
    unscored = torch.isnan(each).all(dim=1)
    total[unscored] = math.nan
    if bool(unscored.any()):  # TRL warns too: such rows get advantage 0 and teach nothing
        row = int(unscored.nonzero()[0, 0])
        _log.warning(
            "all reward functions returned None for %d of %d completions, e.g. prompt=%r completion=%r; "
            "make at least one reward function score every completion",
            int(unscored.sum()),
            len(completions),
            prompts[row],
            completions[row],
        )
    return total, each


def _called(fn: RewardFunc, prompts: list[Any], completions: list[Any], columns: dict[str, Any]) -> Any:
    """Call ``fn`` by keyword, as TRL does; a signature that cannot take the call is named with the fix."""
    try:
        inspect.signature(fn).bind(prompts=prompts, completions=completions, **columns)
    except TypeError as e:
        raise TypeError(
            f"reward function {reward_name(fn)} cannot be called as TRL calls it, "
            f"reward(prompts=..., completions=..., {', '.join(f'{k}=...' for k in columns) or '**columns'}) "
            f"({e}); name its parameters so, or end them with **kwargs"
        ) from None
    except ValueError:  # no signature to read (a builtin): call it and let it say
        pass
    try:
        return fn(prompts=prompts, completions=completions, **columns)
    except Exception as e:
        shown = ", ".join(r[:80] for r in dict.fromkeys(map(repr, prompts)))[:400]
        raise RuntimeError(
            f"reward function {reward_name(fn)} raised {type(e).__name__}: {e} -- scoring {len(completions)} "
            f"completions of the prompts {shown} (first completion: {repr(completions[0])[:80] if completions else ''})"
        ) from e


def _nan_mean_std(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    valid = ~torch.isnan(x)
    count = valid.sum(dim, keepdim=True)
    mean = torch.where(valid, x, 0.0).sum(dim, keepdim=True) / count.clamp(min=1)
    sq = torch.where(valid, (x - mean) ** 2, 0.0).sum(dim, keepdim=True)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.nan)
    return mean, std


def _check_groups(rewards: Tensor, num_generations: int) -> None:
    if num_generations < 2:
        raise ValueError(
            f"num_generations={num_generations}: group-relative advantages need at least 2 completions per prompt"
        )
    if rewards.dim() != 1 or rewards.shape[0] % num_generations:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {num_generations}: pass one reward "
            "per completion, each prompt's completions consecutive"
        )


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> Tensor:
    """Return each completion's advantage relative to its group of ``num_generations`` consecutive rows.

    ``A = r − mean_group``, divided by ``std + 1e-4`` where std is the group's unbiased std
    (``"group"``), the whole batch's (``"batch"``), or not divided (``"none"``). NaN rewards are
    left out of the means and stds and get advantage 0; no advantage is ever NaN. Computed in
    float64 (in float32, as TRL computes, the rounding of a group's mean can give equal rewards
    non-zero advantages: ``(r - mean) / (0 + 1e-4)``), returned as float32.

    >>> import torch
    >>> [round(a, 4) for a in group_advantages(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2).tolist()]
    [0.0, 0.0, -0.7071, 0.7071]
    >>> group_advantages(torch.tensor([1.0, 3.0]), 2, "none").tolist()
    [-1.0, 1.0]
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
    _check_groups(rewards, num_generations)
    groups = rewards.double().reshape(-1, num_generations)  # float64: a group of equal rewards has mean exactly r
    mean, group_std = _nan_mean_std(groups, dim=1)
    adv = groups - mean
    if scale_rewards == "group":
        adv = adv / (group_std + 1e-4)
    elif scale_rewards == "batch":
        adv = adv / (_nan_mean_std(groups.reshape(1, -1), dim=1)[1] + 1e-4)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0, posinf=0.0, neginf=0.0).float()


def normalized_sum_advantages(each: Tensor, num_generations: int, weights: Sequence[float] | None = None) -> Tensor:
    """Return GDPO's advantages (TRL's ``multi_objective_aggregation="normalize_then_sum"``).

    Each reward function's rewards ``each[:, k]`` are z-scored within their group
    (``(r − mean) / (unbiased std + 1e-4)``), weighted and summed; the sums are then z-scored over the
    whole batch. Rows no function scored get advantage 0. Computed in float64, returned as float32.

    >>> import torch
    >>> each = torch.tensor([[1.0, 2.0], [3.0, 2.0], [0.0, 0.0], [0.0, 4.0]])  # one function varies per group
    >>> [round(a, 3) for a in normalized_sum_advantages(each, 2).tolist()]
    [-0.866, 0.866, -0.866, 0.866]
    """
    _check_groups(each[:, 0] if each.dim() == 2 else each, num_generations)
    k = each.shape[1]
    groups = each.double().reshape(-1, num_generations, k)
    mean, std = _nan_mean_std(groups, dim=1)
    z = ((groups - mean) / (std + 1e-4)).reshape(-1, k)
    w = torch.tensor(list(weights) if weights is not None else [1.0] * k, dtype=torch.float64)
    total = torch.nansum(z * w, dim=1)
    total[torch.isnan(each).all(dim=1)] = math.nan
    mean_all, std_all = _nan_mean_std(total[None], dim=1)
    adv = (total - mean_all[0]) / (std_all[0] + 1e-4)
    return torch.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0).float()


def reward_advantages(
    each: Tensor,
    num_generations: int,
    weights: Sequence[float] | None = None,
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> Tensor:
    """Return the advantages of rewards ``each`` ``(rows, functions)`` by TRL's ``multi_objective_aggregation``.

    ``"sum_then_normalize"`` (TRL's default): :func:`group_advantages` of the weighted sum;
    ``"normalize_then_sum"`` (GDPO): :func:`normalized_sum_advantages` (``scale_rewards`` unused).

    >>> import torch
    >>> each = torch.tensor([[1.0], [3.0]])
    >>> reward_advantages(each, 2, scale_rewards="none").tolist()
    [-1.0, 1.0]
    """
    if multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation={multi_objective_aggregation!r} is not one of "
            f"{list(MULTI_OBJECTIVE_AGGREGATIONS)}"
        )
    if multi_objective_aggregation == "normalize_then_sum":
        return normalized_sum_advantages(each, num_generations, weights)
    w = torch.tensor(list(weights) if weights is not None else [1.0] * each.shape[1], dtype=each.dtype)
    total = torch.nansum(each * w, dim=1)
    total[torch.isnan(each).all(dim=1)] = math.nan
    return group_advantages(total, num_generations, scale_rewards)
