"""Shards of a dataset: each rank's contiguous slice, so that gathering in rank order is dataset order.

>>> [shard_bounds(7, r, 2) for r in range(2)]
[(0, 3), (3, 7)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["shard", "shard_bounds"]


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return ``(start, stop)`` of ``rank``'s contiguous slice of ``n`` items (sizes differ by at most 1).

    Slices in rank order cover ``range(n)`` exactly once, so gathering in rank order is dataset order.

    >>> [shard_bounds(5, r, 3) for r in range(3)]
    [(0, 1), (1, 3), (3, 5)]
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size}) with world_size >= 1")
    if n < 0:
        raise ValueError(f"n={n} items must be >= 0")
    return n * rank // world_size, n * (rank + 1) // world_size


@attrs.frozen
class _Shard(Sequence[Any]):
    """A contiguous slice of a dataset, indexable like a dataset."""

    dataset: Any
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]  # int indices only, as a Dataset
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of this shard of {len(self)} items")
        return self.dataset[self.start + index]


def shard(dataset: Any, rank: int, world_size: int, multiple_of: int = 1) -> Sequence[Any]:
    """Return ``rank``'s contiguous slice of ``dataset`` (a sized, indexable dataset) as a dataset.

    Every rank must get at least one item, so ``len(dataset) >= world_size``. With ``multiple_of``
    only the first ``len(dataset)`` rounded down to a multiple of it are split (HF's eval
    ``dataloader_drop_last`` under several ranks drops the last global batch that is not whole:
    pass the eval batch times the world size).

    >>> [list(shard(list("abcde"), r, 2)) for r in range(2)]
    [['a', 'b'], ['c', 'd', 'e']]
    >>> [list(shard(list("abcde"), r, 2, multiple_of=2)) for r in range(2)]
    [['a', 'b'], ['c', 'd']]
    """
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"cannot shard a {type(dataset).__name__} without __len__ and __getitem__; evaluate it whole on "
            "every rank, or give a map-style dataset"
        )
    if len(dataset) < world_size:
        raise ValueError(
            f"an eval set of {len(dataset)} items cannot give each of {world_size} ranks one; "
            "evaluate it on every rank unsharded, or use more eval data"
        )
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of={multiple_of!r} must be a positive int")
    n = len(dataset) // multiple_of * multiple_of
    if n < world_size:
        raise ValueError(
            f"an eval set of {len(dataset)} items, cut to a multiple of {multiple_of} (drop_last), leaves {n}: it "
            f"cannot give each of {world_size} ranks one; use more eval data, a smaller eval batch or drop_last=False"
        )
    return _Shard(dataset, *shard_bounds(n, rank, world_size))
