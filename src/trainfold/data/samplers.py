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

import warnings
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from trainfold.data.dealing import Step, cut, deal, tail_step
from trainfold.data.lengths import dataset_lengths, int_tuple, padded_cost, preference_length
from trainfold.data.rebalance import rebalance_steps

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


def _config_errors(s: Sampler) -> list[str]:
    errors = []
    if s.strategy not in STRATEGIES:
        errors.append(f"strategy={s.strategy!r} is not one of {list(STRATEGIES)}")
    counts = attrs.fields(Sampler)
    for field in (counts.per_device_train_batch_size, counts.gradient_accumulation_steps, counts.world_size):
        value = getattr(s, field.name)
        if not isinstance(value, int) or value <= 0:
            errors.append(f"{field.name}={value!r} must be a positive int")
    if not isinstance(s.megabatch_mult, int) or s.megabatch_mult <= 0:
        errors.append(f"megabatch_mult={s.megabatch_mult!r} must be a positive int")
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
    lengths: tuple[int, ...] | None = attrs.field(default=None, repr=False, converter=int_tuple)
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
            assert self.lengths is not None  # the validator requires lengths for length strategies
            return _group_by_length(perm, self.lengths, self.megabatch_mult, self.global_batch_size)
        return perm

    def global_steps(self, epoch: int) -> list[list[Step]]:
        """Return every rank's micro-batches for each step of the epoch: ``steps -> ranks -> micro``.

        >>> Sampler("sequential", 4, per_device_train_batch_size=1, world_size=2).global_steps(0)
        [[[[0]], [[1]]], [[[2]], [[3]]]]
        """
        order = self.order(epoch)
        if self.strategy == "batch_rebalance":
            return rebalance_steps(order, self)
        g = self.global_batch_size
        full = len(order) // g
        steps = [
            deal(cut(order[i * g : (i + 1) * g], self.per_device_train_batch_size), self.world_size)
            for i in range(full)
        ]
        if len(order) > full * g:
            steps.extend(tail_step(order[full * g :], order, self))
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
