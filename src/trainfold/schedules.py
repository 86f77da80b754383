"""Learning-rate schedules: pure functions ``step -> learning rate``.

``step`` is the number of optimizer updates done before the one the rate is for, so
``schedule(0)`` is the rate of the first update (as in the HF Trainer).

>>> s = linear(1.0, warmup_steps=2, total_steps=8)
>>> [round(s(k), 4) for k in range(8)]
[0.0, 0.5, 1.0, 0.8333, 0.6667, 0.5, 0.3333, 0.1667]
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["Schedule", "constant", "linear", "cosine", "warmup_steps_for", "as_schedule"]

Schedule = Callable[[int], float]


def as_schedule(value: float | Schedule) -> Schedule:
    """Return ``value`` as a schedule: a callable stays, a number becomes ``constant(value)``.

    >>> as_schedule(0.1)(7)
    0.1
    """
    return value if callable(value) else constant(float(value))


def warmup_steps_for(warmup: float, total_steps: int) -> int:
    """Return warmup steps the HF way: an int ``>= 1`` is a count, a float ``< 1`` a ratio (rounded up).

    >>> warmup_steps_for(0.1, 25), warmup_steps_for(3, 25)
    (3, 3)
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    return int(warmup) if warmup >= 1 else math.ceil(total_steps * warmup)


def _check(total_steps: int, warmup_steps: int) -> None:
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}; pass max_steps or the epoch length")
    if not 0 <= warmup_steps:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")


def constant(value: float, warmup_steps: int = 0) -> Schedule:
    """Return a constant rate, after an optional linear warmup from 0.

    >>> [constant(2.0, warmup_steps=2)(k) for k in range(4)]
    [0.0, 1.0, 2.0, 2.0]
    """

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return value * step / max(1, warmup_steps)
        return value

    return schedule


def linear(value: float, warmup_steps: int, total_steps: int) -> Schedule:
    """Return linear warmup from 0 to ``value``, then linear decay to 0 at ``total_steps``.

    >>> linear(1.0, 0, 4)(3)
    0.25
    """
    _check(total_steps, warmup_steps)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return value * step / max(1, warmup_steps)
        return value * max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return schedule


def cosine(value: float, warmup_steps: int, total_steps: int, num_cycles: float = 0.5) -> Schedule:
    """Return linear warmup, then cosine decay to 0 over ``num_cycles`` (HF's ``cosine``).

    >>> s = cosine(1.0, 0, 10)
    >>> s(0), round(s(5), 4)
    (1.0, 0.5)
    """
    _check(total_steps, warmup_steps)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return value * step / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return value * max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))

    return schedule
