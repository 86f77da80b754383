"""Randomness that is a pure function of integers: seed derivation and private generator states."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["derive_seed", "private_rng"]

_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (splitmix64), so nearby inputs give unrelated seeds.

    >>> derive_seed(0, 1) == derive_seed(0, 1), derive_seed(0, 1) == derive_seed(1, 0)
    (True, False)
    """
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 29
    return x & ((1 << 63) - 1)


@contextlib.contextmanager
def private_rng(device: torch.device) -> Iterator[list[torch.Generator]]:
    """Yield the default generators that ops on ``device`` draw from; restore their states afterwards.

    Cheaper than ``torch.random.fork_rng`` + ``torch.manual_seed`` (which touches every backend).
    """
    generators = [torch.default_generator]
    if device.type == "cuda":
        generators.append(
            torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
        )
    saved = [g.get_state() for g in generators]
    try:
        yield generators
    finally:
        for g, s in zip(generators, saved):
            g.set_state(s)
