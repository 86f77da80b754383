"""Off-policy pieces, pure functions of versions and log-probs: the staleness bound and TRL's IS correction.

A completion's *age* is ``current_version - version`` of its oldest token (a version is the optimizer
step whose weights were published). With ``max_staleness=k`` a completion older than ``k`` is dropped
(TRL's ``AsyncGRPOTrainer``: ``current - sample.model_version > max_staleness``) or, with
``on_stale="mask"``, kept in its group (so the group's advantages do not change) with its too-old tokens
masked out of the loss (prime-rl#2957). ``max_staleness=0`` is on-policy: only the current version.

>>> staleness_decisions([3, 2, 0], current_version=3, max_staleness=1)
['keep', 'keep', 'drop']
>>> staleness_decisions([3, 0], current_version=3, max_staleness=1, on_stale="mask")
['keep', 'mask']
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "IMPORTANCE_SAMPLING_MODES",
    "ON_STALE",
    "importance_sampling_ratio",
    "staleness_decisions",
    "stale_token_mask",
]

ON_STALE = ("drop", "mask")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _check_bound(max_staleness: int, on_stale: str) -> None:
    problems = []
    if max_staleness < 0:
        problems.append(f"max_staleness={max_staleness} must be >= 0 (0 is on-policy)")
    if on_stale not in ON_STALE:
        problems.append(f"on_stale={on_stale!r} is not one of {list(ON_STALE)}")
    if problems:
        raise ValueError("; ".join(problems))


def staleness_decisions(
    versions: Sequence[int], current_version: int, max_staleness: int, on_stale: str = "drop"
) -> list[str]:
    """Return ``"keep"``, ``"drop"`` or ``"mask"`` for each completion, given the version of its oldest token.

    A version newer than ``current_version`` is refused (the engine cannot be ahead of the trainer).
    """
    _check_bound(max_staleness, on_stale)
    future = [v for v in versions if v > current_version]
    if future:
        raise ValueError(f"completions of versions {sorted(set(future))} are newer than the current {current_version}")
    stale = "drop" if on_stale == "drop" else "mask"
    return ["keep" if current_version - v <= max_staleness else stale for v in versions]


def stale_token_mask(token_versions: Tensor, current_version: int, max_staleness: int) -> Tensor:
    """Return a bool mask, True where a token's version is within ``max_staleness`` of ``current_version``.

    ``token_versions`` is any shape (e.g. ``(rows, completion tokens)``; padding may hold any version:
    multiply by the completion mask as well).

    >>> import torch
    >>> stale_token_mask(torch.tensor([[4, 4, 5], [2, 3, 5]]), 5, 1).tolist()
    [[True, True, True], [False, False, True]]
    """
    _check_bound(max_staleness, "drop")
    return (current_version - token_versions) <= max_staleness


def importance_sampling_ratio(
    old_logps: Tensor,
    sampling_logps: Tensor,
    completion_mask: Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Tensor:
    """Return TRL's ``vllm_importance_sampling_correction`` weights, ``(B, T)`` for ``token_*`` modes, ``(B, 1)``
    for ``sequence_*`` modes.

    ``old_logps``: the training policy's log-probs of the completion tokens (``(B, T)``), recomputed by the
    trainer; ``sampling_logps``: the engine's (:class:`~trainfold.rollout.engine.Completion` ``logps``).
    The ratio is ``exp((old - sampling) * mask)`` per token or ``exp`` of its row sum per sequence (NaN
    differences count as 0); ``*_truncate`` clamps it to ``[clip_min, clip_max]``, ``*_mask`` zeroes it
    outside. TRL's ``GRPOTrainer._generate_and_score_completions`` (``vllm_importance_sampling_mode``,
    ``vllm_importance_sampling_clip_min`` / ``_clip_max``; ``vllm_importance_sampling_cap`` is TRL's
    deprecated name of ``clip_max``); the loss multiplies its per-token terms by it.

    >>> import torch
    >>> old, sampled, mask = torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2)
    >>> [round(x, 4) for x in importance_sampling_ratio(old, sampled, mask, "token_truncate")[0].tolist()]
    [2.7183, 1.0]
    >>> importance_sampling_ratio(old, sampled, mask, "sequence_mask", clip_max=2.0).tolist()
    [[0.0]]
    """
    _check_modes(mode, clip_min, clip_max)
    diff = torch.nan_to_num((old_logps - sampling_logps) * completion_mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _check_modes(mode: str, clip_min: float | None, clip_max: float | None) -> None:
    problems = []
    if mode not in IMPORTANCE_SAMPLING_MODES:
        problems.append(f"vllm_importance_sampling_mode={mode!r} is not one of {list(IMPORTANCE_SAMPLING_MODES)}")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        problems.append(f"vllm_importance_sampling_clip_min={clip_min} must be < clip_max={clip_max}")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        problems.append(f"mode {mode!r} needs vllm_importance_sampling_clip_min or _clip_max (both are None)")
    if problems:
        raise ValueError("; ".join(problems))
