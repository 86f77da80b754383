"""The global batch: the samples of one optimizer step, and its split over ranks and micro-batches.

A checkpoint of N ranks resumes on M (elastic resume) by keeping it.

Which samples form optimizer step ``s`` depends only on the seed, the epoch and the global batch
``per_device_train_batch_size × gradient_accumulation_steps × world_size`` (``samplers``): the
epoch's permutation is cut into global batches before they are dealt to ranks and micro-batches.
So a resume on another number of ranks trains on the same samples in the same order when it keeps
the global batch, and its trajectory equals the uninterrupted run's up to float rounding (the
per-rank sums add up in another order); on the same split it is bitwise equal.

The rule (``split_global_batch``): on ``M`` ranks each rank takes ``G / M`` samples per step, as
``per_device_train_batch_size`` = the largest divisor of ``G / M`` not above the saved per-device
batch (so memory per device never grows), and ``gradient_accumulation_steps`` = the rest. A global
batch that ``M`` does not divide is refused by name. Two things still depend on the split:
dropout masks (drawn per micro-batch and rank), and an epoch's last, short step (``drop_last``
keeps whole micro-batches of every rank; a tail with fewer samples than ranks is topped up).
``trainfold.trainer.planning.elastic_args`` applies the rule to a resumed run's arguments.

>>> split_global_batch(8, world_size=4, per_device=2)
(2, 1)
>>> split_global_batch(8, world_size=1, per_device=2)
(2, 4)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trainfold.data.samplers import Sampler

__all__ = ["BATCH_KEYS", "global_batch", "split_global_batch"]

# the sampler's fields whose product is the global batch (samplers.Sampler), as a run's saved settings name them
_SPLIT = attrs.fields(Sampler)
BATCH_KEYS = (_SPLIT.per_device_train_batch_size.name, _SPLIT.gradient_accumulation_steps.name, _SPLIT.world_size.name)


def global_batch(settings: Mapping[str, Any]) -> int | None:
    """Return the samples per optimizer step the settings make, or ``None`` when one of ``BATCH_KEYS`` is absent.

    >>> global_batch({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "world_size": 2})
    12
    >>> global_batch({"world_size": 2}) is None
    True
    """
    values = [settings.get(k) for k in BATCH_KEYS]
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) != len(values):
        return None
    return ints[0] * ints[1] * ints[2]


def split_global_batch(batch: int, *, world_size: int, per_device: int) -> tuple[int, int]:
    """Return ``(per_device_train_batch_size, gradient_accumulation_steps)`` giving ``batch`` on ``world_size`` ranks.

    The per-device batch is the largest divisor of ``batch / world_size`` not above ``per_device``.

    >>> split_global_batch(12, world_size=3, per_device=3)
    (2, 2)
    >>> split_global_batch(4, world_size=3, per_device=2)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: the checkpoint's global batch of 4 samples per step cannot be split evenly over 3 ranks; resume on a
    number of ranks that divides 4 (e.g. 1, 2 or 4), or start a new run with another batch
    """
    if batch % world_size:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        shown = ", ".join(map(str, divisors[:-1])) + f" or {divisors[-1]}" if len(divisors) > 1 else "1"
        raise ValueError(
            f"the checkpoint's global batch of {batch} samples per step cannot be split evenly over {world_size} "
            f"ranks; resume on a number of ranks that divides {batch} (e.g. {shown}), or start a new run with "
            "another batch"
        )
    per_rank = batch // world_size
    size = max(d for d in range(1, min(per_device, per_rank) + 1) if per_rank % d == 0)
    return size, per_rank // size
