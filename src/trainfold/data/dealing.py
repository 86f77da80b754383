"""Cutting an epoch's order into micro-batches and dealing them round-robin to the ranks.

Micro-batch ``j`` of a step goes to rank ``j % world_size``; the tail of an epoch becomes one
short step (see :mod:`trainfold.data.samplers` for the rules).

>>> deal(cut([0, 1, 2, 3, 4, 5], 2), 2)
[[[0, 1], [4, 5]], [[2, 3]]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Step", "cut", "deal", "tail_step", "top_up"]

Step = list[list[int]]  # one rank's micro-batches of one optimizer step


def cut(indices: Sequence[int], size: int) -> list[list[int]]:
    """Cut ``indices`` into micro-batches of ``size`` (the last may be shorter).

    >>> cut([0, 1, 2], 2)
    [[0, 1], [2]]
    """
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


def deal(micro: list[list[int]], world: int) -> list[Step]:
    """Deal micro-batches round-robin to ``world`` ranks: rank ``r`` gets ``micro[r::world]``.

    >>> deal([[0], [1], [2]], 2)
    [[[0], [2]], [[1]]]
    """
    return [micro[r::world] for r in range(world)]


def top_up(tail: list[int], order: list[int], world: int) -> list[int]:
    """Repeat the epoch's first samples until the tail has at least one sample per rank.

    >>> top_up([7], [3, 5, 7], 3)
    [7, 3, 5]
    """
    missing = world - len(tail)
    return tail + [order[i % len(order)] for i in range(missing)] if missing > 0 else tail


def tail_step(tail: list[int], order: list[int], s: Any) -> list[list[Step]]:
    """Return the epoch's last, short step (none, or one) for the sampler ``s``.

    With ``s.drop_last`` it keeps only micro-batches full on every rank; without, every rank gets one.

    >>> from trainfold.data.samplers import Sampler
    >>> tail_step([4, 5, 6], list(range(7)), Sampler("sequential", 7, per_device_train_batch_size=2))
    [[[[4, 5], [6]]]]
    """
    b, w = s.per_device_train_batch_size, s.world_size
    if s.drop_last:
        keep = len(tail) // (b * w) * b * w
        return [deal(cut(tail[:keep], b), w)] if keep else []
    tail = top_up(tail, order, w)
    micro = cut(tail, b)
    if len(micro) < w:  # fewer micro-batches than ranks: split evenly so every rank gets one
        micro = _split_even(tail, w)
    return [deal(micro, w)]


def _split_even(xs: list[int], parts: int) -> list[list[int]]:
    q, r = divmod(len(xs), parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (i < r))
    return [xs[bounds[i] : bounds[i + 1]] for i in range(parts)]
