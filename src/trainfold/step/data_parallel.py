"""Data parallelism of the lent step on torch's ``DistributedDataParallel``: gradients summed during backward.

A lent, donated state runs the module as it is (``trainfold.step.eager``), so across ranks it runs
the module through DDP: each bucket of gradients is all-reduced as backward produces it,
overlapping communication with compute, and only the last micro-batch of a step synchronises
(``no_sync`` on the others). DDP averages over ranks; trainfold's losses are already divided by the
global ``num_items_in_batch``, so a communication hook *sums* instead: the gradients are exactly
what one process would get for the whole batch (to the summation order across ranks).

>>> engine_for(None) is None   # one process: the module runs by itself
True
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainfold.distributed.distributed import ProcessGroupCollective

__all__ = ["DataParallel", "engine_for"]


class DataParallel:
    """The module under ``DistributedDataParallel`` over the collective's group, made at the first lent step.

    Made lazily because DDP's constructor is itself a collective (it checks the parameters' shapes
    across ranks and broadcasts rank 0's): every rank makes it at its first lent step.
    """

    def __init__(self, model: nn.Module, collective: ProcessGroupCollective) -> None:
        self.model, self.collective = model, collective
        self.ddp: DistributedDataParallel | None = None

    def module(self) -> DistributedDataParallel:
        """Return the DDP wrapper of the model (made on first use)."""
        if self.ddp is None:
            device = self.collective.device
            self.ddp = DistributedDataParallel(
                self.model,
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=self.collective.group,
                forward_sync_buffers=False,  # each rank keeps its own running statistics, as without DDP
            )
            self.ddp.register_comm_hook(self.collective.group, _summed)
        return self.ddp

    def syncing_last(self, micro: Callable[..., Any], count: int) -> Callable[..., Any]:
        """Return ``micro`` run under ``no_sync`` for all but the last of ``count`` micro-batches."""
        calls = itertools.count()

        def run(*positional: Any) -> Any:
            if next(calls) < count - 1:
                with self.module().no_sync():
                    return micro(*positional)
            return micro(*positional)

        return run


def _summed(group, bucket):  # type: ignore[no-untyped-def]  # DDP refuses the string annotations of this module
    """DDP's communication hook: all-reduce a ``dist.GradBucket`` as a sum (DDP's own hook divides by the world
    size); it returns the future of the summed ``torch.Tensor``."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def engine_for(collective: Any, model: nn.Module | None = None) -> DataParallel | None:
    """Return the ``DataParallel`` of ``model`` for ``collective`` when it spans several ranks of a process group."""
    if not isinstance(collective, ProcessGroupCollective) or collective.world_size < 2 or not dist.is_initialized():
        return None
    assert model is not None
    return DataParallel(model, collective)
