"""GRPO's token rows: prompt + completion right-padded with its completion mask, and per-token values moved.

A row is ``prompt + completion``; next-token values (log-probs) of shape ``(rows, seq - 1)`` sit at
position ``len(prompt) - 1 + j`` for completion token ``j``. ``spread`` and ``gather`` move them
between those positions and a fixed-width ``(rows, width)`` completion layout.

>>> rows = completion_rows([[5, 6], [7]], [[1], [2, 3]])
>>> rows["input_ids"].tolist(), rows["completion_mask"].tolist()
([[5, 6, 1], [7, 2, 3]], [[0, 0, 1], [0, 1, 1]])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from trainfold.core.generate import pad_right

__all__ = ["before_eos", "completion_rows", "gather_completions", "spread_completions"]


def before_eos(tokens: list[int], eos: int | None) -> list[int]:
    """Return ``tokens`` up to (not including) the first ``eos``.

    >>> before_eos([4, 5, 2, 6], 2), before_eos([4, 5], None)
    ([4, 5], [4, 5])
    """
    return tokens[: tokens.index(eos)] if eos is not None and eos in tokens else tokens


def completion_rows(
    prompt_ids: Sequence[list[int]], completions: Sequence[list[int]], pad: int = 0
) -> dict[str, Tensor]:
    """Return ``input_ids``, ``attention_mask`` and ``completion_mask`` of the rows ``prompt + completion``."""
    ids, attention = pad_right([p + c for p, c in zip(prompt_ids, completions)], pad)
    completion_mask = attention.clone()
    for row, p in enumerate(prompt_ids):
        completion_mask[row, : len(p)] = 0
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion_mask}


def spread_completions(values: Tensor, prompt_lengths: Sequence[int], lengths: Sequence[int], width: int) -> Tensor:
    """Place completion-position values ``(rows, C)`` at their next-token positions ``(rows, width)``.

    >>> spread_completions(torch.tensor([[1.0, 2.0]]), [2], [2], 4).tolist()
    [[0.0, 1.0, 2.0, 0.0]]
    """
    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    for row, (p, n) in enumerate(zip(prompt_lengths, lengths)):
        out[row, p - 1 : p - 1 + n] = values[row, :n]
    return out


def gather_completions(values: Tensor, prompt_lengths: Sequence[int], lengths: Sequence[int], width: int) -> Tensor:
    """Return the completion-position values ``(rows, width)`` of next-token values (inverse of ``spread``).

    >>> gather_completions(torch.tensor([[0.0, 1.0, 2.0, 0.0]]), [2], [2], 3).tolist()
    [[1.0, 2.0, 0.0]]
    """
    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    for row, (p, n) in enumerate(zip(prompt_lengths, lengths)):
        out[row, :n] = values[row, p - 1 : p - 1 + n]
    return out
