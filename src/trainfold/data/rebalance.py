"""``batch_rebalance``: each step's samples sorted by length and cut into micro-batches that balance padded tokens.

>>> from trainfold.data.samplers import Sampler
>>> lengths = [1, 9, 2, 8, 3, 3, 7, 1]
>>> s = Sampler("batch_rebalance", 8, per_device_train_batch_size=2, gradient_accumulation_steps=2, lengths=lengths)
>>> [[lengths[i] for i in mb] for mb in s.epoch_batches(0)[0]]  # the longest sample alone, three short ones together
[[3, 1, 1], [8]]
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainfold.data.dealing import Step, top_up

__all__ = ["rebalance_steps"]


def _greedy(costs: list[int], limit: int, k: int) -> list[int] | None:
    """Return the group sizes of a left-to-right fill up to ``limit``, or None past ``k`` groups."""
    sizes: list[int] = []
    i, n = 0, len(costs)
    while i < n:
        size = limit // costs[i]
        if size == 0 or len(sizes) == k:
            return None
        if size > n - i:
            size = n - i
        sizes.append(size)
        i += size
    return sizes


def _partition(lens: Sequence[int], k: int, world: int, capacity: int) -> list[int]:
    """Return ``k`` contiguous group sizes of ``lens`` (sorted descending) that balance the ranks.

    A group's cost is its size times its first (longest) length: its padded tokens. The
    smallest feasible peak cost ``T`` is found by bisection (the left-to-right fill is optimal
    for a monotone cost); then peaks up to ``1.5 T`` are tried and the split whose heaviest rank
    (after :func:`_assign`) is lightest wins, so a micro-batch never costs more than ``1.5 T``.
    """
    if k == 1:  # one micro-batch on one rank: nothing to balance
        return [len(lens)]
    costs = [max(n, 1) for n in lens]
    # T is at least the longest item and the mean group's share; equal groups of ceil(n / k) always fit.
    lo = max(costs[0], -(-sum(costs) // k))
    hi = max(lo, costs[0] * -(-len(costs) // k))
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(costs, mid, k) is None:
            lo = mid + 1
        else:
            hi = mid
    # Every split has a group of cost >= T (the bisection's answer) and rank loads summing to >= sum(costs).
    floor = max(lo, -(-sum(costs) // world))
    best: tuple[int, list[int]] | None = None
    tried: set[tuple[int, ...]] = set()
    for limit in sorted({lo * (20 + i) // 20 for i in range(11)}):
        greedy = _greedy(costs, limit, k)
        if greedy is None:
            continue
        sizes = greedy if len(greedy) == k else _split_to(greedy, costs, k)
        if tuple(sizes) in tried:  # the same split has the same peak: the first one stays best
            continue
        tried.add(tuple(sizes))
        group_costs = _group_costs(sizes, costs)
        peak = _peak(group_costs, world, capacity)
        if best is None or peak < best[0]:
            best = (peak, sizes)
        if peak <= floor:  # no split has a lighter heaviest rank: later tries cannot win
            break
    assert best is not None
    return best[1]


def _group_costs(sizes: list[int], costs: list[int]) -> list[int]:
    out, start = [], 0
    for size in sizes:
        out.append(size * costs[start])
        start += size
    return out


def _split_to(sizes: list[int], costs: list[int], k: int) -> list[int]:
    """Split the most expensive splittable groups in two until there are ``k`` groups."""
    if len(sizes) == k:
        return sizes
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    heap = [(-size * costs[start], start, size) for start, size in zip(starts, sizes)]
    heapq.heapify(heap)
    done: list[tuple[int, int]] = []
    while len(heap) + len(done) < k:
        _, start, size = heapq.heappop(heap)
        if size == 1:
            done.append((start, size))
            continue
        half = (size + 1) // 2
        for st, sz in ((start, half), (start + half, size - half)):
            heapq.heappush(heap, (-sz * costs[st], st, sz))
    return [size for _, size in sorted(done + [(st, sz) for _, st, sz in heap])]


def _assign(costs: list[int], world: int, capacity: int) -> tuple[list[list[int]], list[int]]:
    """Assign groups to ``world`` bins of at most ``capacity`` groups, most expensive first (LPT).

    Return the bins and their loads; a group goes to the least loaded bin with room (lowest index on ties).
    """
    by_cost = _by_cost(costs)
    if world == 1:
        return [by_cost], [sum(costs)]
    bins: list[list[int]] = [[] for _ in range(world)]
    loads = _lpt(costs, by_cost, world, capacity, bins)
    return bins, loads


def _lpt(costs: list[int], by_cost: list[int], world: int, capacity: int, bins: list[list[int]] | None) -> list[int]:
    """Return the bin loads of ``_assign``'s placement (appending each group to ``bins`` when given)."""
    loads, counts = [0] * world, [0] * world
    for g in by_cost:
        best, least = -1, 0
        for r in range(world):
            if counts[r] < capacity and (best < 0 or loads[r] < least):
                best, least = r, loads[r]
        loads[best] = least + costs[g]
        counts[best] += 1
        if bins is not None:
            bins[best].append(g)
    return loads


def _peak(costs: list[int], world: int, capacity: int) -> int:
    """Return the heaviest bin's load of ``_assign(costs, world, capacity)``."""
    if world == 1:
        return sum(costs)
    return max(_lpt(costs, _by_cost(costs), world, capacity, None))


def _by_cost(costs: list[int]) -> list[int]:
    """Return the group numbers, most expensive first (a stable sort: ties by number)."""
    return sorted(range(len(costs)), key=costs.__getitem__, reverse=True)


def _rebalance_step(ordered: list[int], lens: list[int], s: Any, k: int, totals: list[int]) -> list[Step]:
    """Cut one step's samples, ``ordered`` longest first with their ``lens``, into balanced micro-batches."""
    sizes = _partition(lens, k, s.world_size, s.gradient_accumulation_steps)
    groups, costs, start = [], [], 0
    for size in sizes:
        groups.append(ordered[start : start + size])
        costs.append(size * max(lens[start], 1))
        start += size
    bins, loads = _assign(costs, s.world_size, s.gradient_accumulation_steps)
    if s.world_size == 1:
        totals[0] += loads[0]
        return [[groups[g] for g in bins[0]]]
    # Heaviest bin of this step to the rank with the least cost so far this epoch.
    by_load = sorted(range(len(bins)), key=lambda b: (-loads[b], b))
    by_total = sorted(range(s.world_size), key=lambda r: (totals[r], r))
    step: list[Step] = [[] for _ in range(s.world_size)]
    for b, r in zip(by_load, by_total):
        step[r] = [groups[g] for g in bins[b]]
        totals[r] += loads[b]
    return step


def _longest_first(indices: np.ndarray, lengths: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """Sort each row of ``indices`` by length, longest first (stable); return the rows and their lengths."""
    lens = lengths[indices]
    order = np.argsort(-lens, axis=1, kind="stable")
    return np.take_along_axis(indices, order, 1).tolist(), np.take_along_axis(lens, order, 1).tolist()


def rebalance_steps(order: list[int], s: Any) -> list[list[Step]]:
    """Return every rank's micro-batches for each step of an epoch ``order`` (the ``batch_rebalance`` sampler ``s``).

    Each step's samples are sorted longest first and cut into ``world_size * gradient_accumulation_steps``
    contiguous micro-batches balanced by padded tokens; the epoch's tail is one more step (topped up
    to one sample per rank) unless ``s.drop_last``.
    """
    assert s.lengths is not None
    lengths = np.asarray(s.lengths, dtype=np.int64)
    g, k = s.global_batch_size, s.world_size * s.gradient_accumulation_steps
    full = len(order) // g
    perm = np.asarray(order, dtype=np.int64)
    rows, lens = _longest_first(perm[: full * g].reshape(full, g), lengths)
    if k == 1:  # one micro-batch on one rank: the sorted step itself
        steps: list[list[Step]] = [[[row]] for row in rows]
    else:
        totals = [0] * s.world_size
        steps = [_rebalance_step(row, ls, s, k, totals) for row, ls in zip(rows, lens)]
    tail = order[full * g :]
    if tail and not s.drop_last:
        tail = top_up(tail, order, s.world_size)
        (row,), (ls,) = _longest_first(np.asarray([tail], dtype=np.int64), lengths)
        totals = [0] * s.world_size if k == 1 else totals
        steps.append(_rebalance_step(row, ls, s, min(k, len(tail)), totals))
    return steps
