"""Padded concatenation: batches of tensors (or records of them) joined along dim 0, dim 1 right-padded.

>>> import torch
>>> pad_concat([torch.tensor([[1, 2]]), torch.tensor([[3]])]).tolist()
[[1, 2], [3, -100]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from trainfold.core.losses import IGNORE_INDEX

__all__ = ["pad_concat"]


def _identity(t: Tensor) -> Tensor:
    return t


def _check_shapes(tensors: list[Tensor], pad_index: float, where: str) -> tuple[torch.dtype, bool]:
    shapes = [tuple(t.shape) for t in tensors]
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(
            f"cannot concatenate 0-d tensors at {where} (shapes {shapes[:4]}): give per-sample values "
            "with a leading batch dimension"
        )
    if len({t.dim() for t in tensors}) > 1 or len({s[2:] for s in shapes}) > 1:
        raise ValueError(
            f"cannot pad-concatenate batches at {where} with shapes {sorted(set(shapes))[:6]}: only dim 1 "
            "(the sequence) may differ between batches; make every batch return the same trailing dims "
            "(e.g. reduce logits the same way in preprocess_logits_for_metrics)"
        )
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    ragged = len({s[1:2] for s in shapes}) > 1
    if ragged and dtype == torch.bool:
        raise ValueError(f"cannot pad bool tensors at {where} with {pad_index}; cast them to an integer dtype first")
    if ragged and not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        if not info.min <= pad_index <= info.max:
            raise ValueError(
                f"cannot pad {dtype} tensors at {where} with {pad_index}: out of range "
                f"[{info.min}, {info.max}]; cast predictions to a signed dtype (e.g. .long()) first"
            )
    return dtype, ragged


def _concat_tensors(tensors: list[Tensor], pad_index: float, where: str, move: Callable[[Tensor], Tensor]) -> Tensor:
    # One output allocation; each piece is moved (one at a time) and copied into its slot.
    dtype, ragged = _check_shapes(tensors, pad_index, where)
    first = tensors[0]
    width = max(t.shape[1] for t in tensors) if first.dim() >= 2 else None
    shape = (sum(t.shape[0] for t in tensors), *((width,) if width is not None else ()), *first.shape[2:])
    out: Tensor | None = None
    row = 0
    for t in tensors:
        piece = move(t)
        if out is None:
            out = piece.new_full(shape, pad_index, dtype=dtype) if ragged else piece.new_empty(shape, dtype=dtype)
        if width is None:
            out[row : row + piece.shape[0]] = piece
        else:
            out[row : row + piece.shape[0], : piece.shape[1]] = piece
        row += piece.shape[0]
    assert out is not None
    return out


def pad_concat(
    items: list[Any],
    pad_index: float = IGNORE_INDEX,
    where: str = "predictions",
    move: Callable[[Tensor], Tensor] | None = None,
) -> Any:
    """Concatenate batches along dim 0, right-padding dim 1 with ``pad_index``.

    ``items`` are tensors, or nested tuples/lists/dicts of tensors of one structure; other
    dimensions must agree. Padding an unsigned or bool tensor with -100 is an error, not an
    overflow. The result is one new tensor per leaf; ``move`` (e.g. to the CPU) is applied to
    each piece just before it is copied in, so only one moved piece exists at a time.

    >>> pad_concat([torch.tensor([[1, 2, 3]]), torch.tensor([[4], [5]])]).tolist()
    [[1, 2, 3], [4, -100, -100], [5, -100, -100]]
    """
    if not items:
        raise ValueError(f"nothing to concatenate at {where}: no batches")
    first = items[0]
    if isinstance(first, Tensor):
        if not all(isinstance(x, Tensor) for x in items):
            raise TypeError(f"batches at {where} mix tensors and {sorted({type(x).__name__ for x in items})}")
        return _concat_tensors(list(items), pad_index, where, move or _identity)
    if isinstance(first, Mapping):
        keys = list(first)
        bad = [sorted(x) for x in items if not isinstance(x, Mapping) or sorted(x) != sorted(keys)]
        if bad:
            raise ValueError(f"batches at {where} have different keys: {sorted(keys)} and {bad[0]}")
        return {k: pad_concat([x[k] for x in items], pad_index, f"{where}[{k!r}]", move) for k in keys}
    if isinstance(first, (tuple, list)):
        if any(not isinstance(x, (tuple, list)) or len(x) != len(first) for x in items):
            lengths = sorted({len(x) if isinstance(x, (tuple, list)) else -1 for x in items})
            raise ValueError(f"batches at {where} are sequences of different lengths {lengths}; return one structure")
        return type(first)(
            pad_concat([x[i] for x in items], pad_index, f"{where}[{i}]", move) for i in range(len(first))
        )
    raise TypeError(f"cannot concatenate {type(first).__name__} at {where}: expected tensors or tuples/dicts of them")
