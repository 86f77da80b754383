"""Weights over ``torch.distributed`` in buckets: a private 2-rank group (trainer = rank 0, server = rank 1).

The group is made from its own ``TCPStore`` on a free port, apart from any default process group the
trainer has, so no trainer collective can interleave with the transfer. A bucket is a flat ``uint8``
buffer holding the bytes of several tensors in order (any dtypes); a tensor larger than a bucket is sent
alone, from its own memory, without a copy.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["TensorMeta", "WeightChannel", "plan_buckets"]

TensorMeta = tuple[str, tuple[int, ...], str]  # name, shape, dtype name (JSON-able, picklable)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int, direct_bytes: int = 2**20) -> list[list[int]]:
    """Return the tensor indices of each bucket, in order.

    A tensor of at least ``direct_bytes`` is a bucket of its own (sent from its own memory, no copy); the
    smaller ones between two such are packed, consecutive, up to ``bucket_bytes`` a bucket.

    >>> plan_buckets([("a", (2,), "float32"), ("b", (2,), "float32"), ("c", (8,), "float32")], 16)
    [[0, 1], [2]]
    >>> plan_buckets([("a", (2,), "float32"), ("big", (4,), "float32"), ("b", (2,), "float32")], 64, 16)
    [[0], [1], [2]]
    """
    buckets: list[list[int]] = []
    size = bucket_bytes + 1  # no open bucket
    for i, (_, shape, dtype) in enumerate(metas):
        n = _nbytes(shape, dtype)
        if n >= direct_bytes:
            buckets.append([i])
            size = bucket_bytes + 1
            continue
        if size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * _dtype(dtype).itemsize


def _as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class WeightChannel:
    """One end of the private 2-rank group; ``send`` on the trainer, ``receive`` on the server."""

    def __init__(self, host: str, port: int, rank: int, backend: str = "gloo", timeout_s: float = 600.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, 2, rank == 0, timeout, wait_for_workers=False)
        self.rank = rank
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        group_class = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
        self.group = group_class(self.store, rank, 2, timeout)

    def _broadcast(self, t: Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def send(self, tensors: Sequence[Tensor], buckets: Sequence[Sequence[int]]) -> None:
        """Broadcast ``tensors`` to the server, bucket by bucket (a one-tensor bucket from its own memory)."""
        for bucket in buckets:
            parts = [_as_bytes(tensors[i].to(self.device)) for i in bucket]
            self._broadcast(parts[0] if len(parts) == 1 else torch.cat(parts))

    def receive(
        self, metas: Sequence[TensorMeta], buckets: Sequence[Sequence[int]], into: dict[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """Return the tensors the trainer sends for ``metas``, as ``send`` bucketed them.

        ``into`` offers buffers to reuse (name -> tensor of the same shape and dtype, no longer read by
        anyone): one-tensor buckets are received straight into them, packed ones copied out of the bucket.
        """
        spare = into or {}
        out: dict[str, Tensor] = {}
        used: set[int] = set()  # storages taken: tied weights share one, and must not here
        for bucket in buckets:
            sizes = [_nbytes(metas[i][1], metas[i][2]) for i in bucket]
            targets = [self._buffer(metas[i], spare, used) for i in bucket]
            if len(bucket) == 1:
                self._broadcast(_as_bytes(targets[0]))
            else:
                flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
                self._broadcast(flat)
                for target, piece in zip(targets, torch.split(flat, sizes)):
                    _as_bytes(target).copy_(piece)
            out.update((metas[i][0], t) for i, t in zip(bucket, targets))
        return out

    def _buffer(self, meta: TensorMeta, spare: dict[str, Tensor], used: set[int]) -> Tensor:
        name, shape, dtype = meta
        old = spare.pop(name, None)
        fits = old is not None and tuple(old.shape) == tuple(shape) and old.dtype == _dtype(dtype)
        if old is not None and fits and old.is_contiguous() and old.untyped_storage().data_ptr() not in used:
            used.add(old.untyped_storage().data_ptr())
            return old
        return torch.empty(shape, dtype=_dtype(dtype), device=self.device)

    def close(self) -> None:
        try:
            self.group.shutdown()
        except Exception:  # the peer may be gone already
            pass
