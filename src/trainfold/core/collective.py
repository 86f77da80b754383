"""The ``Collective`` protocol: what a step needs from a process group (sums across ranks)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

__all__ = ["Collective"]


class Collective(Protocol):
    """What the step needs from a process group: sums across ranks.

    >>> import torch
    >>> class Solo:                               # one process: each sum is the tensor itself
    ...     rank = 0
    ...     def sum_(self, tensors): pass
    >>> t = [torch.tensor(2.0)]; Solo().sum_(t); t[0].item()
    2.0
    """

    rank: int

    def sum_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its sum over all ranks, in place."""
