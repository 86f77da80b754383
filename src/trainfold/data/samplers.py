"""Samplers: each epoch's optimizer steps as a pure function of ``(seed, epoch)``.

A :class:`Sampler` is a frozen record. ``sampler.epoch_batches(epoch)`` returns this rank's
optimizer steps of the epoch, each a list of micro-batches of dataset indices
(``steps -> micro-batches -> indices``). Nothing here reads or changes the global RNG: the only
random draw is ``torch.randperm`` from a private generator seeded with ``seed + epoch`` (the
order Hugging Face's seedable sampler gives).

A global step takes ``per_device_train_batch_size * gradient_accumulation_steps * world_size``
samples. For ``random``, ``sequential`` and ``group_by_length`` it is cut into micro-batches of
``per_device_train_batch_size`` dealt round-robin to the ranks (micro-batch ``j`` of the step
goes to rank ``j % world_size``). ``batch_rebalance`` instead sorts the step's samples by
length and cuts them into contiguous micro-batches of variable size that balance padded tokens.

The tail of an epoch (fewer samples than a global step) becomes one short step: fewer
micro-batches, never mixed with the next epoch. With ``drop_last`` the tail keeps only
micro-batches that are full on every rank (none for ``batch_rebalance``). Without it and with
several ranks, a tail of fewer samples than ranks is topped up by repeating the epoch's first
samples, so that every rank has a micro-batch to run.

>>> s = Sampler("sequential", 10, per_device_train_batch_size=2, gradient_accumulation_steps=2)
>>> s.epoch_batches(0)
[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
>>> s.steps_per_epoch()
3
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

__all__ = [
    "LENGTH_STRATEGIES",
    "STRATEGIES",
    "Sampler",
    "dataset_lengths",
    "make_sampler",
    "padded_cost",
    "preference_length",
]

STRATEGIES = ("random", "sequential", "group_by_length", "batch_rebalance")
LENGTH_STRATEGIES = ("group_by_length", "batch_rebalance")

Step = list[list[int]]  # one rank's micro-batches of one optimizer step


def _int_tuple(values: Sequence[Any] | np.ndarray | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    if isinstance(values, np.ndarray):  # lengths read through arrow: one conversion, not one per item
        return tuple(values.astype(np.int64, copy=False).tolist())
    return tuple(int(v) for v in values)


def _config_errors(s: Sampler) -> list[str]:
    errors = []
    if s.strategy not in STRATEGIES:
        errors.append(f"strategy={s.strategy!r} is not one of {list(STRATEGIES)}")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "megabatch_mult"):
        value = getattr(s, name)
        if not isinstance(value, int) or value <= 0:
            errors.append(f"{name}={value!r} must be a positive int")
    if isinstance(s.world_size, int) and not 0 <= s.rank < max(s.world_size, 1):
        errors.append(f"rank={s.rank!r} must be in [0, world_size={s.world_size})")
    if s.num_samples is not None and s.num_samples < 0:
        errors.append(f"num_samples={s.num_samples!r} must be >= 0")
    if s.strategy in LENGTH_STRATEGIES and s.num_samples is not None:
        if s.lengths is None:
            errors.append(f"strategy={s.strategy!r} needs lengths (one per sample); use make_sampler to compute them")
        elif len(s.lengths) != s.num_samples:
            errors.append(f"lengths has {len(s.lengths)} entries but num_samples={s.num_samples}")
        elif s.lengths and min(s.lengths) < 0:
            errors.append(f"lengths must be >= 0, got {min(s.lengths)}")
    return errors


@attrs.frozen
class Sampler:
    """The order of a run's data: a pure function of ``(seed, epoch)`` for one rank.

    ``num_samples=None`` marks a dataset without a length (an ``IterableDataset``): the stream then
    reads it in its own order and ``epoch_batches`` is not available. ``lengths`` (one per
    sample) is needed by ``group_by_length`` and ``batch_rebalance``; ``megabatch_mult`` is the
    number of global steps per ``group_by_length`` megabatch (fewer for small data).

    >>> s = Sampler("random", 8, per_device_train_batch_size=2, world_size=2, rank=1, seed=3)
    >>> [len(step[0]) for step in s.epoch_batches(0)]
    [2, 2]
    """

    strategy: str
    num_samples: int | None
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    rank: int = 0
    drop_last: bool = False
    seed: int = attrs.field(default=0, converter=int)
    lengths: tuple[int, ...] | None = attrs.field(default=None, repr=False, converter=_int_tuple)
    megabatch_mult: int = 50

    def __attrs_post_init__(self) -> None:
        errors = _config_errors(self)
        if errors:
            raise ValueError("invalid Sampler: " + "; ".join(errors))

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks: ``per_device * accumulation * world``."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    def order(self, epoch: int) -> list[int]:
        """Return the epoch's permutation of the dataset before it is cut into steps.

        >>> Sampler("sequential", 4).order(7)
        [0, 1, 2, 3]
        """
        n = self._sized()
        if self.strategy == "sequential":
            return list(range(n))
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        if self.strategy == "group_by_length":
            return _group_by_length(perm, self.lengths, self.megabatch_mult, self.global_batch_size)
        return perm

    def global_steps(self, epoch: int) -> list[list[Step]]:
        """Return every rank's micro-batches for each step of the epoch: ``steps -> ranks -> micro``.

        >>> Sampler("sequential", 4, per_device_train_batch_size=1, world_size=2).global_steps(0)
        [[[[0]], [[1]]], [[[2]], [[3]]]]
        """
        order = self.order(epoch)
        if self.strategy == "batch_rebalance":
            return _rebalance_steps(order, self)
        g = self.global_batch_size
        full = len(order) // g
        steps = [
            _deal(_cut(order[i * g : (i + 1) * g], self.per_device_train_batch_size), self.world_size)
            for i in range(full)
        ]
        if len(order) > full * g:
            steps.extend(_tail_step(order[full * g :], order, self))
        return steps

    def epoch_batches(self, epoch: int) -> list[Step]:
        """Return this rank's optimizer steps of ``epoch``: ``steps -> micro-batches -> indices``.

        >>> Sampler("sequential", 5, per_device_train_batch_size=2).epoch_batches(0)
        [[[0, 1]], [[2, 3]], [[4]]]
        """
        return [step[self.rank] for step in self.global_steps(epoch)]

    def steps_per_epoch(self) -> int:
        """Return the number of optimizer steps in every epoch (the same on every rank).

        >>> Sampler("random", 10, per_device_train_batch_size=4, drop_last=True).steps_per_epoch()
        2
        """
        n, g = self._sized(), self.global_batch_size
        tail = n % g
        if self.drop_last:
            keep = (
                0
                if self.strategy == "batch_rebalance"
                else tail // (self.per_device_train_batch_size * self.world_size)
            )
            return n // g + (keep > 0)
        return n // g + (tail > 0)

    def _sized(self) -> int:
        if self.num_samples is None:
            raise TypeError(
                "this Sampler is for a dataset without __len__ (num_samples=None): it has no epoch "
                "order; the stream reads such a dataset in its own order"
            )
        return self.num_samples


def _cut(indices: Sequence[int], size: int) -> list[list[int]]:
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


def _deal(micro: list[list[int]], world: int) -> list[Step]:
    return [micro[r::world] for r in range(world)]


def _top_up(tail: list[int], order: list[int], world: int) -> list[int]:
    missing = world - len(tail)
    return tail + [order[i % len(order)] for i in range(missing)] if missing > 0 else tail


def _tail_step(tail: list[int], order: list[int], s: Sampler) -> list[list[Step]]:
    b, w = s.per_device_train_batch_size, s.world_size
    if s.drop_last:
        keep = len(tail) // (b * w) * b * w
        return [_deal(_cut(tail[:keep], b), w)] if keep else []
    tail = _top_up(tail, order, w)
    micro = _cut(tail, b)
    if len(micro) < w:  # fewer micro-batches than ranks: split evenly so every rank gets one
        micro = _split_even(tail, w)
    return [_deal(micro, w)]


def _split_even(xs: list[int], parts: int) -> list[list[int]]:
    q, r = divmod(len(xs), parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (i < r))
    return [xs[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _group_by_length(perm: list[int], lengths: Sequence[int], mult_cap: int, group: int) -> list[int]:
    n = len(perm)
    mega = max(1, min(n // (4 * group), mult_cap)) * group
    megas = [sorted(perm[i : i + mega], key=lambda j: -lengths[j]) for i in range(0, n, mega)]
    if not megas:
        return []
    donor = max(range(len(megas)), key=lambda m: (lengths[megas[m][0]], -m))
    if lengths[megas[donor][0]] > lengths[megas[0][0]]:
        megas[0][0], megas[donor][0] = megas[donor][0], megas[0][0]
        megas[donor].sort(key=lambda j: -lengths[j])
    return [i for m in megas for i in m]


# -- batch_rebalance ------------------------------------------------------------------------


def _greedy(costs: list[int], limit: int, k: int) -> list[int] | None:
    """Return the group sizes of a left-to-right fill up to ``limit``, or None past ``k`` groups."""
    sizes, i, n = [], 0, len(costs)
    while i < n:
        size = min(limit // costs[i], n - i)
        if size == 0 or len(sizes) == k:
            return None
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
        sizes = _split_to(greedy, costs, k)
        if tuple(sizes) in tried:  # the same split has the same peak: the first one stays best
            continue
        tried.add(tuple(sizes))
        group_costs = _group_costs(sizes, costs)
        peak = max(_assign(group_costs, world, capacity)[1])
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
    done = []
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
    by_cost = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    if world == 1:
        return [by_cost], [sum(costs)]
    bins: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for g in by_cost:
        best = -1
        for r in range(world):
            if len(bins[r]) < capacity and (best < 0 or loads[r] < loads[best]):
                best = r
        bins[best].append(g)
        loads[best] += costs[g]
    return bins, loads


def _rebalance_step(ordered: list[int], lens: list[int], s: Sampler, k: int, totals: list[int]) -> list[Step]:
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


def _rebalance_steps(order: list[int], s: Sampler) -> list[list[Step]]:
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
        tail = _top_up(tail, order, s.world_size)
        (row,), (ls,) = _longest_first(np.asarray([tail], dtype=np.int64), lengths)
        totals = [0] * s.world_size if k == 1 else totals
        steps.append(_rebalance_step(row, ls, s, min(k, len(tail)), totals))
    return steps


# -- lengths and construction ---------------------------------------------------------------


PREFERENCE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")  # a DPO row (trainfold.recipes.dpo)


def _size(value: Any) -> int:
    return int(value.shape[-1]) if isinstance(value, torch.Tensor) and value.dim() > 0 else len(value)


def preference_length(item: Any) -> int:
    """Return the length of a preference row as its collated rows see it: prompt + the longer completion.

    >>> preference_length({"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5, 6]})
    5
    """
    return _size(item["prompt_ids"]) + max(_size(item["chosen_ids"]), _size(item["rejected_ids"]))


def _item_length(item: Any, key: str, index: int) -> int:
    if hasattr(item, "keys") and key not in item and all(k in item for k in PREFERENCE_COLUMNS):
        return preference_length(item)
    try:
        value = item[key]
    except (KeyError, TypeError, IndexError) as exc:
        keys = sorted(item.keys()) if hasattr(item, "keys") else type(item).__name__
        raise KeyError(
            f"dataset item {index} has no {key!r} to measure its length (item keys: {keys}); pass "
            f"model_input_name= naming the input to measure, or give the dataset a length column"
        ) from exc
    return _size(value)


def dataset_lengths(
    dataset: Any, length_column_name: str = "length", model_input_name: str = "input_ids"
) -> tuple[int, ...]:
    """Return one length per sample: the dataset's length column, else ``len(item[model_input_name])``.

    The column is used when the dataset exposes ``column_names`` containing
    ``length_column_name`` (a Hugging Face ``datasets.Dataset`` or anything alike). A dataset
    with columns that lacks it gets a warning and the lengths are measured item by item, once
    (a ``datasets.Dataset`` through arrow, without reading its rows). A preference row (DPO's
    ``prompt_ids``, ``chosen_ids``, ``rejected_ids``, no ``model_input_name``) measures
    :func:`preference_length`: prompt + the longer completion.

    >>> dataset_lengths([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    (3, 1)
    >>> dataset_lengths([{"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4]}])
    (3,)
    """
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        if length_column_name in columns:
            read = _arrow_column(dataset, length_column_name)
            if read is not None and read.null_count == 0 and _pa_types().is_integer(read.type):
                return _int_tuple(read.to_numpy())
            return tuple(int(n) for n in dataset[length_column_name])
        preference = model_input_name not in columns and all(k in columns for k in PREFERENCE_COLUMNS)
        measured = "prompt + the longer completion" if preference else f"len(item[{model_input_name!r}])"
        warnings.warn(
            f"dataset has no column {length_column_name!r} (columns: {list(columns)}); measuring "
            f"{measured} of every item instead",
            stacklevel=2,
        )
        if preference:
            lengths = _arrow_lengths(dataset, PREFERENCE_COLUMNS)
            if lengths is not None:
                prompt, chosen, rejected = lengths
                return _int_tuple(prompt + np.maximum(chosen, rejected))
        lengths = _arrow_lengths(dataset, (model_input_name,)) if model_input_name in columns else None
        if lengths is not None:
            return _int_tuple(lengths[0])
    return tuple(_item_length(dataset[i], model_input_name, i) for i in range(len(dataset)))


def _arrow_lengths(dataset: Any, names: Sequence[str]) -> list[np.ndarray] | None:
    """Return the list lengths of each column in ``names`` through arrow, or None when one is not a flat list column."""
    reads = [_arrow_column(dataset, name) for name in names]
    if any(r is None or r.null_count or not _flat_list(r.type) for r in reads):
        return None
    import pyarrow.compute as pc  # noqa: PLC0415 - present wherever an arrow column is

    return [pc.list_value_length(r).to_numpy().astype(np.int64) for r in reads]


def _arrow_column(dataset: Any, name: str) -> Any:
    """Return a ``datasets.Dataset`` column as one arrow array (its row selection applied), or None."""
    with_format = getattr(dataset, "with_format", None)
    if with_format is None:
        return None
    try:
        column = with_format("arrow")[name]
    except Exception:  # not a datasets.Dataset after all: measure item by item
        return None
    return column if hasattr(column, "null_count") and hasattr(column, "type") else None


def _pa_types() -> Any:
    import pyarrow.types  # noqa: PLC0415 - only reached with an arrow column in hand

    return pyarrow.types


def _flat_list(arrow_type: Any) -> bool:
    """Say whether a column holds lists of scalars (whose lengths are the item lengths)."""
    types = _pa_types()
    is_list = types.is_list(arrow_type) or types.is_large_list(arrow_type) or types.is_fixed_size_list(arrow_type)
    return is_list and not types.is_nested(arrow_type.value_type)


def make_sampler(
    strategy: str,
    dataset: Any,
    *,
    per_device_train_batch_size: int = 8,
    gradient_accumulation_steps: int = 1,
    world_size: int = 1,
    rank: int = 0,
    drop_last: bool = False,
    seed: int = 0,
    length_column_name: str = "length",
    model_input_name: str = "input_ids",
    lengths: Sequence[int] | None = None,
) -> Sampler:
    """Return the :class:`Sampler` for ``dataset`` under ``strategy`` (HF ``train_sampling_strategy``).

    Length-based strategies measure lengths once here (see :func:`dataset_lengths`) unless
    ``lengths`` is given. A dataset without ``__len__`` (an ``IterableDataset``) ignores the
    strategy with a warning: it is read in its own order.

    >>> data = [{"input_ids": [0] * n} for n in (5, 1, 9, 3)]
    >>> s = make_sampler("group_by_length", data, per_device_train_batch_size=2, seed=1)
    >>> s.epoch_batches(0)[0][0][0]  # the longest sample comes first
    2
    """
    num_samples = len(dataset) if hasattr(dataset, "__len__") else None
    if num_samples is None and strategy in LENGTH_STRATEGIES:
        warnings.warn(
            f"train_sampling_strategy={strategy!r} is ignored: {type(dataset).__name__} has no __len__, "
            "so it is read in its own order",
            stacklevel=2,
        )
    if strategy in LENGTH_STRATEGIES and num_samples is not None and lengths is None:
        lengths = dataset_lengths(dataset, length_column_name, model_input_name)
    return Sampler(
        strategy=strategy,
        num_samples=num_samples,
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        world_size=world_size,
        rank=rank,
        drop_last=drop_last,
        seed=seed,
        lengths=lengths,
    )


def padded_cost(micro_batch: Sequence[int], lengths: Sequence[int]) -> int:
    """Return the padded tokens of a micro-batch: its size times its longest length.

    >>> padded_cost([0, 2], [3, 1, 5])
    10
    """
    return len(micro_batch) * max((lengths[i] for i in micro_batch), default=0)
