"""An eval run across ranks: each rank's accumulators merged with the reducers' ``merge``, its rows gathered in order.

Each rank folds its own shard with the one-process pipeline (``trainfold.evaluation.pipeline``);
:func:`merged_parts` then makes every rank's result the whole set's: the loss, counts and
metric accumulators of all ranks are merged left to right with each part's ``merge`` (sums and
counts, never an average of averages), and the gathered tensors are concatenated in rank
order (:func:`gather_rows`), which is dataset order for contiguous shards.

>>> from trainfold.distributed.distributed import SingleProcess
>>> all_ranks({"n": 3}, SingleProcess())
[{'n': 3}]
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from trainfold.core.losses import IGNORE_INDEX
from trainfold.core.tree import map_tensors
from trainfold.distributed.distributed import GatherCollective
from trainfold.evaluation.reducers import Reducer, merge_all, unreduced

__all__ = ["all_ranks", "gather_rows", "merged_parts"]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8


def _meta(t: Tensor | None) -> Tensor:
    """Encode presence, dtype and shape of ``t`` in a fixed-size int64 vector."""
    meta = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64)
    if t is None:
        return meta
    if t.dim() == 0 or t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(
            f"cannot gather a {t.dtype} tensor of shape {tuple(t.shape)}: it needs 1 to {_MAX_DIMS} "
            f"dims (rows first) and one of the dtypes {[str(d) for d in _DTYPES]}"
        )
    meta[0], meta[1], meta[2] = 1, _DTYPES.index(t.dtype), t.dim()
    meta[3 : 3 + t.dim()] = torch.tensor(t.shape)
    return meta


def gather_rows(tensor: Tensor | None, collective: GatherCollective, pad_index: float = IGNORE_INDEX) -> Tensor | None:
    """Concatenate every rank's rows in rank order, right-padding dim 1 with ``pad_index``; the same on every rank.

    Like ``pad_concat`` of the ranks' tensors. A rank with nothing passes ``None``; the result is
    ``None`` when every rank does. Dtypes and dims after the first two must agree.

    >>> from trainfold.distributed.distributed import SingleProcess
    >>> gather_rows(torch.tensor([[1, 2], [3, 4]]), SingleProcess()).tolist()
    [[1, 2], [3, 4]]
    """
    metas = collective.all_gather(_meta(tensor))
    present = [m for m in metas if int(m[0])]
    if not present:
        return None
    kinds = {(int(m[1]), int(m[2]), tuple(m[5 : 3 + int(m[2])].tolist())) for m in present}
    if len(kinds) > 1:
        shown = sorted((str(_DTYPES[d]), n, rest) for d, n, rest in kinds)
        raise ValueError(
            f"ranks hold tensors that cannot be concatenated (dtype, dims, trailing shape): {shown}; "
            "make every rank return the same dtype and trailing dims"
        )
    dtype_index, ndim, _ = kinds.pop()
    dims = torch.stack([m[3 : 3 + ndim] for m in present]).amax(0)
    rows = [int(m[3]) if int(m[0]) else 0 for m in metas]
    full = (max(rows), *dims[1:].tolist())
    local = tensor if tensor is not None else torch.empty((0, *full[1:]), dtype=_DTYPES[dtype_index])
    padded = local.new_full(full, pad_index) if ndim >= 2 else local.new_zeros(full)
    padded[tuple(slice(0, s) for s in local.shape)] = local
    pieces = collective.all_gather(padded)
    return torch.cat([p[:n] for p, n in zip(pieces, rows)])


def all_ranks(value: Any, collective: GatherCollective) -> list[Any]:
    """Return every rank's ``value`` in rank order: a small picklable record (its tensors travel via the CPU).

    For accumulators and other small records whose structure may differ between ranks (an
    objective's metric names, seen only on a rank that has batches); rows go by :func:`gather_rows`.
    """
    payload = pickle.dumps(map_tensors(lambda t: t.detach().cpu(), value))
    sizes = [int(n) for n in collective.all_gather(torch.tensor([len(payload)], dtype=torch.int64))]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    pieces = collective.all_gather(padded)
    return [pickle.loads(p[:n].numpy().tobytes()) for p, n in zip(pieces, sizes)]  # the ranks of this one job


def merged_parts(
    parts: Mapping[str, Reducer], acc: Mapping[str, Any], collective: GatherCollective, runtime: float
) -> dict[str, Any]:
    """Complete this rank's eval accumulators (``eval_fold``'s) as the whole run's, the same on every rank.

    A part with a ``merge`` is merged over the ranks' accumulators in rank order, then completed;
    the others (the gathered tensors) are completed on each rank and their rows gathered in rank
    order. ``runtime`` becomes the slowest rank's.

    >>> from trainfold.distributed.distributed import SingleProcess
    >>> from trainfold.evaluation.reducers import counting
    >>> merged_parts({"batches": counting()}, {"batches": 2}, SingleProcess(), 0.5)
    {'batches': 2, 'runtime': 0.5}
    """
    local = {k: unreduced(a) for k, a in acc.items()}
    merged = {k: a for k, a in local.items() if parts[k].merge is not None}
    rows = {k: parts[k].complete(a) for k, a in local.items() if parts[k].merge is None}
    shapes = map_tensors(lambda t: torch.empty(0), rows)  # the structure, so ranks gather the same leaves
    ranks = all_ranks((merged, shapes, runtime), collective)
    out = {k: parts[k].complete(merge_all(parts[k], [r[0][k] for r in ranks])) for k in merged}
    for k, mine in rows.items():
        out[k] = _gather_record(mine, [r[1][k] for r in ranks], collective)
    out["runtime"] = max(r[2] for r in ranks)
    return out


def _gather_record(mine: Any, shapes: list[Any], collective: GatherCollective) -> Any:
    # ``mine`` is a dict of tensor records (or None); every rank walks the union of the ranks' keys, in one order.
    keys = list(dict.fromkeys(k for s in shapes if s for k in s))
    if not keys:
        return None
    out = {}
    for key in keys:
        like = next(s[key] for s in shapes if s and key in s)
        own = (mine or {}).get(key)
        own = map_tensors(lambda t: None, like) if own is None else own
        out[key] = map_tensors(lambda _, t: gather_rows(t, collective), like, own)
    return out
