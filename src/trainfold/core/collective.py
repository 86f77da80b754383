"""The ``Collective`` protocol (sums across ranks) and the step's item count, summed with it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["Collective", "item_count", "items_in_batch"]


class Collective(Protocol):
    """What the step needs from a process group: sums across ranks.

    >>> import torch
    >>> class Solo:                               # one process: each sum is the tensor itself
    ...     rank = 0
    ...     def sum_(self, tensors): pass
    >>> t = [torch.tensor(2.0)]; Solo().sum_(t); t[0].item()
    2.0
    """

    @property
    def rank(self) -> int:
        """This process's rank (read-only: a frozen record's field, or a plain attribute, is one)."""

    def sum_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its sum over all ranks, in place."""


def item_count(n: Any) -> Tensor:
    """Return one micro-batch's item count (an int or a one-element tensor) as a 0-d int64 CPU tensor.

    >>> item_count(3).dtype, item_count(torch.tensor([5])).tolist()
    (torch.int64, 5)
    """
    return torch.as_tensor(n).reshape(()).to(torch.int64).cpu()


def items_in_batch(
    count: Callable[[Mapping[str, Tensor]], Tensor],
    batch: Iterable[Mapping[str, Tensor]],
    collective: Collective | None = None,
) -> Tensor:
    """Return ``num_items_in_batch``: ``count(micro)`` summed over the micro-batches and over every rank.

    ``count`` returns an int64 CPU tensor per micro-batch (:func:`item_count`; an ensemble's counts
    one per member, shape ``(K,)``). This is the one place a step counts, before any forward pass.

    >>> batch = [{"labels": torch.tensor([1, -100])}, {"labels": torch.tensor([2, 3])}]
    >>> items_in_batch(lambda mb: item_count((mb["labels"] != -100).sum()), batch).item()
    3
    """
    num_items = torch.stack([count(micro) for micro in batch]).sum(0)
    if collective is not None:
        collective.sum_([num_items])
    return num_items
