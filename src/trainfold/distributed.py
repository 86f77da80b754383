"""Data parallelism on ``torch.distributed``: the ``Collective`` the step sums counts and gradients with.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set), ``collective_from_env()`` joins
the process group (NCCL on GPUs, gloo on CPUs) and yields a ``ProcessGroupCollective``; alone it
yields ``None`` and everything runs in one process. Gradients are summed in buckets: tensors of
one dtype are flattened into a few large buffers, one ``all_reduce`` each, then copied back.

>>> with collective_from_env() as c:
...     print(c)
None
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ProcessGroupCollective", "collective_from_env", "BUCKET_BYTES"]

BUCKET_BYTES = 25 * 2**20


@attrs.frozen
class ProcessGroupCollective:
    """Sums over the ranks of a ``torch.distributed`` process group, bucketed."""

    rank: int
    world_size: int
    group: Any = None
    device: torch.device = torch.device("cpu")
    bucket_bytes: int = BUCKET_BYTES

    def sum_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its sum over all ranks, in place (tensors owned by the caller's step)."""
        for bucket in _buckets(tensors, self.bucket_bytes):
            flat = torch.cat([t.reshape(-1).to(self.device) for t in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            offset = 0
            for t in bucket:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n

    def max_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its maximum over all ranks, in place."""
        for t in tensors:
            buf = t.to(self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
            t.copy_(buf)


def _buckets(tensors: list[Tensor], limit: int) -> Iterator[list[Tensor]]:
    """Group tensors by dtype into lists of at most ``limit`` bytes (a larger tensor goes alone)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        bucket: list[Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


@contextlib.contextmanager
def collective_from_env(backend: str | None = None) -> Iterator[ProcessGroupCollective | None]:
    """Join the torchrun process group for the block (and leave it after); ``None`` when alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield None
        return
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend=backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        yield ProcessGroupCollective(dist.get_rank(), dist.get_world_size(), device=device)
    finally:
        if owned:
            dist.barrier()
            dist.destroy_process_group()
