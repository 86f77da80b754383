"""Ranks simulated by threads: test a distributed path (``make_step(collective=...)``) in one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch
from torch import Tensor

__all__ = ["SimulatedRank", "on_simulated_ranks"]

T = TypeVar("T")


@attrs.define
class _Room:
    """Where the threads of one simulated world meet to exchange tensors."""

    world_size: int
    barrier: threading.Barrier
    slots: list[Any]


@attrs.frozen
class SimulatedRank:
    """One rank of a world simulated by threads: the collective ``make_step`` and ``evaluate_batches`` take.

    Sums, maxima and gathers go through a shared room and a barrier, in rank order, as
    ``ProcessGroupCollective`` does over a process group. Make them with :func:`on_simulated_ranks`.
    """

    room: _Room
    rank: int

    @property
    def world_size(self) -> int:
        """Return the number of simulated ranks."""
        return self.room.world_size

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Return every rank's ``tensor``, in rank order."""
        self.room.slots[self.rank] = tensor.detach().clone()
        self.room.barrier.wait()
        out = list(self.room.slots)
        self.room.barrier.wait()  # nobody writes the next round's slots before all have read
        return out

    def sum_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its sum over the ranks, in place."""
        for t in tensors:
            t.copy_(torch.stack(self.all_gather(t)).sum(0))

    def max_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its maximum over the ranks, in place."""
        for t in tensors:
            t.copy_(torch.stack(self.all_gather(t)).amax(0))


def on_simulated_ranks(world_size: int, fn: Callable[[SimulatedRank], T], *, timeout: float = 60.0) -> list[T]:
    """Run ``fn(rank)`` once per simulated rank, each on its own thread; return the results in rank order.

    Give each rank its own module (a step borrows its module's slots while it runs), and keep
    dropout off: threads share the process's default generator, so masks would depend on timing.
    An exception on any rank breaks the others' barrier and is raised here.

    >>> import torch
    >>> def total(collective):
    ...     t = torch.tensor([float(collective.rank + 1)])
    ...     collective.sum_([t])
    ...     return t.item()
    >>> on_simulated_ranks(3, total)
    [6.0, 6.0, 6.0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    room = _Room(world_size, threading.Barrier(world_size, timeout=timeout), [None] * world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(SimulatedRank(room, rank))
        except BaseException as exc:
            errors.append(exc)
            room.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"simulated-rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    return results
