"""Learning-rate schedules: pure functions ``step -> learning rate``.

``step`` is the number of optimizer updates done before the one the rate is for, so
``schedule(0)`` is the rate of the first update (as in the HF Trainer).

>>> s = linear(1.0, warmup_steps=2, total_steps=8)
>>> [round(s(k), 4) for k in range(8)]
[0.0, 0.5, 1.0, 0.8333, 0.6667, 0.5, 0.3333, 0.1667]
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "SCHEDULE_NAMES",
    "Schedule",
    "as_schedule",
    "constant",
    "cosine",
    "cosine_warmup_with_min_lr",
    "cosine_with_restarts",
    "inverse_sqrt",
    "linear",
    "named",
    "polynomial",
    "schedule_kwargs_problems",
    "warmup_stable_decay",
    "warmup_steps_for",
]

Schedule = Callable[[int], float]


def as_schedule(value: float | torch.Tensor | Schedule) -> Schedule:
    """Return ``value`` as a schedule: a callable stays, a number becomes ``constant(value)``.

    >>> as_schedule(0.1)(7)
    0.1
    >>> as_schedule(torch.tensor(0.5))(3).item()
    0.5
    """
    if isinstance(value, torch.Tensor):  # a tensor rate stays one (a differentiable step differentiates through it)
        return constant(value)  # type: ignore[arg-type]
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


def _warmup(value: float, step: int, warmup_steps: int) -> float:
    return value * step / max(1, warmup_steps)


def cosine(
    value: float,
    warmup_steps: int,
    total_steps: int,
    num_cycles: float = 0.5,
    min_lr_rate: float = 0.0,
    min_lr: float | None = None,
) -> Schedule:
    """Return linear warmup, then cosine decay over ``num_cycles`` down to ``min_lr_rate * value``.

    HF's ``cosine`` (``min_lr_rate=0``) and ``cosine_with_min_lr`` (``min_lr`` or ``min_lr_rate``).

    >>> s = cosine(1.0, 0, 10)
    >>> s(0), round(s(5), 4), round(cosine(1.0, 0, 10, min_lr_rate=0.1)(10), 4)
    (1.0, 0.5, 0.1)
    """
    _check(total_steps, warmup_steps)
    if min_lr is not None:
        if min_lr_rate:
            raise ValueError("give min_lr or min_lr_rate, not both")
        min_lr_rate = min_lr / value

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return _warmup(value, step, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
        return value * max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)

    return schedule


def cosine_warmup_with_min_lr(
    value: float,
    warmup_steps: int,
    total_steps: int,
    num_cycles: float = 0.5,
    min_lr_rate: float = 0.0,
    warmup_lr_rate: float | None = None,
) -> Schedule:
    """Return HF's ``cosine_warmup_with_min_lr``: :func:`cosine` shifted one step earlier, from a warmup floor.

    Warmup gives ``(step + 1) / warmup_steps`` of ``value`` (the first update is not at 0), or rises
    linearly from ``warmup_lr_rate`` to 1 over the warmup when that is given; then the cosine decay
    to ``min_lr_rate * value`` is measured from ``step + 1``.

    >>> s = cosine_warmup_with_min_lr(1.0, 2, 6, min_lr_rate=0.1)
    >>> [round(s(k), 4) for k in range(7)]
    [0.5, 1.0, 0.8682, 0.55, 0.2318, 0.1, 0.2318]
    """
    _check(total_steps, warmup_steps)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            if warmup_lr_rate is None:
                return value * (step + 1) / max(1, warmup_steps)
            return value * (warmup_lr_rate + (1 - warmup_lr_rate) * step / max(1, warmup_steps - 1))
        progress = (step - warmup_steps + 1) / max(1, total_steps - warmup_steps)
        factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
        return value * max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)

    return schedule


def cosine_with_restarts(value: float, warmup_steps: int, total_steps: int, num_cycles: int = 1) -> Schedule:
    """Return linear warmup, then ``num_cycles`` cosine decays each restarting from ``value`` (hard restarts).

    >>> s = cosine_with_restarts(1.0, 0, 8, num_cycles=2)
    >>> [round(s(k), 4) for k in (0, 2, 4, 6, 8)]
    [1.0, 0.5, 1.0, 0.5, 0.0]
    """
    _check(total_steps, warmup_steps)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return _warmup(value, step, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if progress >= 1.0:
            return 0.0
        return value * max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))

    return schedule


def polynomial(value: float, warmup_steps: int, total_steps: int, lr_end: float = 1e-7, power: float = 1.0) -> Schedule:
    """Return linear warmup, then polynomial decay of degree ``power`` from ``value`` to ``lr_end``.

    >>> s = polynomial(1.0, 0, 4, lr_end=0.0, power=2.0)
    >>> [s(k) for k in range(6)]
    [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    """
    _check(total_steps, warmup_steps)
    if not value > lr_end:
        raise ValueError(f"polynomial decay needs lr_end ({lr_end}) below the learning rate ({value})")

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return _warmup(value, step, warmup_steps)
        if step >= total_steps:  # (HF divides by zero here when warmup_steps == total_steps)
            return lr_end
        remaining = 1 - (step - warmup_steps) / (total_steps - warmup_steps)
        return (value - lr_end) * remaining**power + lr_end

    return schedule


def inverse_sqrt(value: float, warmup_steps: int, timescale: int | None = None) -> Schedule:
    """Return linear warmup, then decay as ``1 / sqrt((step + timescale - warmup) / timescale)``.

    ``timescale`` defaults to ``warmup_steps`` (10000 without warmup), as in HF.

    >>> s = inverse_sqrt(1.0, 4)
    >>> [round(s(k), 4) for k in (2, 4, 16)]
    [0.5, 1.0, 0.5]
    """
    timescale = timescale if timescale is not None else (warmup_steps or 10_000)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return _warmup(value, step, warmup_steps)
        return value / math.sqrt((step + timescale - warmup_steps) / timescale)

    return schedule


_SHAPES: dict[str, Callable[[float], float]] = {  # progress in [0, 1] -> factor rising from 0 to 1
    "linear": lambda x: x,
    "cosine": lambda x: 0.5 * (1.0 - math.cos(math.pi * x)),
    "1-sqrt": lambda x: 1.0 - math.sqrt(1.0 - x),
}


def warmup_stable_decay(
    value: float,
    warmup_steps: int,
    num_decay_steps: int,
    total_steps: int | None = None,
    num_stable_steps: int | None = None,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> Schedule:
    """Return warmup from ``min_lr_ratio * value``, a constant stretch, then decay back (HF's ``warmup_stable_decay``).

    The stable stretch is ``num_stable_steps``, or what ``total_steps`` leaves after warmup and
    decay; after the decay the rate stays at ``min_lr_ratio * value``.

    >>> s = warmup_stable_decay(1.0, 2, num_decay_steps=2, total_steps=6, decay_type="linear")
    >>> [s(k) for k in range(7)]
    [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    problems = [
        f"{name}={kind!r} is not one of {list(_SHAPES)}"
        for name, kind in (("warmup_type", warmup_type), ("decay_type", decay_type))
        if kind not in _SHAPES
    ]
    if total_steps is None and num_stable_steps is None:
        problems.append("give total_steps or num_stable_steps")
    if problems:
        raise ValueError("invalid warmup_stable_decay schedule: " + "; ".join(problems))
    stable = num_stable_steps
    if stable is None:
        assert total_steps is not None  # checked above
        stable = total_steps - warmup_steps - num_decay_steps
    rise = _SHAPES[warmup_type]

    def fall(x: float) -> float:
        if decay_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * x))
        return 1.0 - x if decay_type == "linear" else 1.0 - math.sqrt(x)

    def floor(factor: float) -> float:
        return value * max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return floor(rise(step / max(1, warmup_steps)))
        if step < warmup_steps + stable:
            return value
        if step < warmup_steps + stable + num_decay_steps:
            return floor(fall((step - warmup_steps - stable) / max(1, num_decay_steps)))
        return value * min_lr_ratio

    return schedule


# -- by name, as TrainingArguments.lr_scheduler_type -----------------------------------------------


def _named_warmup_stable_decay(
    value,
    warmup,
    total,
    num_decay_steps,
    num_stable_steps=None,
    warmup_type="linear",
    decay_type="cosine",
    min_lr_ratio=0.0,
    num_cycles=0.5,
):
    """``warmup_stable_decay`` taking ``(value, warmup, total)`` first, as every entry of ``_NAMED`` does."""
    return warmup_stable_decay(
        value, warmup, num_decay_steps, total, num_stable_steps, warmup_type, decay_type, min_lr_ratio, num_cycles
    )


def _named_cosine_warmup_with_min_lr(
    value: float,
    warmup: int,
    total: int,
    num_cycles: float = 0.5,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
    warmup_lr_rate: float | None = None,
) -> Schedule:
    rate = _min_rate(value, min_lr, min_lr_rate)
    return cosine_warmup_with_min_lr(value, warmup, total, num_cycles, rate, warmup_lr_rate)


_NAMED: dict[str, Callable[..., Schedule]] = {
    "linear": lambda value, warmup, total: linear(value, warmup, total),
    "cosine": lambda value, warmup, total, num_cycles=0.5: cosine(value, warmup, total, num_cycles),
    "cosine_with_min_lr": lambda value, warmup, total, num_cycles=0.5, min_lr=None, min_lr_rate=None: cosine(
        value, warmup, total, num_cycles, _min_rate(value, min_lr, min_lr_rate)
    ),
    "cosine_warmup_with_min_lr": _named_cosine_warmup_with_min_lr,
    "cosine_with_restarts": lambda value, warmup, total, num_cycles=1: cosine_with_restarts(
        value, warmup, total, num_cycles
    ),
    "polynomial": lambda value, warmup, total, lr_end=1e-7, power=1.0: polynomial(value, warmup, total, lr_end, power),
    "constant": lambda value, warmup, total: constant(value),
    "constant_with_warmup": lambda value, warmup, total: constant(value, warmup),
    "inverse_sqrt": lambda value, warmup, total, timescale=None: inverse_sqrt(value, warmup, timescale),
    "warmup_stable_decay": _named_warmup_stable_decay,
}
SCHEDULE_NAMES = tuple(_NAMED)
_NOT_PURE = {"reduce_lr_on_plateau": "it follows evaluation metrics, not the step"}


def _min_rate(value: float, min_lr: float | None, min_lr_rate: float | None) -> float:
    if (min_lr is None) == (min_lr_rate is None):
        raise ValueError(
            "cosine_with_min_lr and cosine_warmup_with_min_lr need exactly one of min_lr or min_lr_rate in "
            "lr_scheduler_kwargs"
        )
    if min_lr_rate is not None:
        return min_lr_rate
    assert min_lr is not None  # exactly one is given (checked above)
    return min_lr / value


def schedule_kwargs_problems(name: str, kwargs: Mapping[str, Any]) -> list[str]:
    """Return what is wrong with ``name`` and its ``kwargs`` (empty when they build a schedule).

    >>> schedule_kwargs_problems("cosine", {"num_cycle": 2})
    ["lr_scheduler_kwargs {'num_cycle'} are not taken by 'cosine' (it takes ['num_cycles'])"]
    """
    if name in _NOT_PURE:
        return [
            (
                f"lr_scheduler_type={name!r} is not supported: {_NOT_PURE[name]}, and trainfold's schedules are "
                "pure functions of the step; use 'cosine_with_min_lr' or 'warmup_stable_decay' instead"
            )
        ]
    if name not in _NAMED:
        return [f"lr_scheduler_type={name!r} is not one of {list(SCHEDULE_NAMES)}"]
    params = list(inspect.signature(_NAMED[name]).parameters)[3:]
    unknown = set(kwargs) - set(params)
    required = {p for p in params if inspect.signature(_NAMED[name]).parameters[p].default is inspect.Parameter.empty}
    out = []
    if unknown:
        out.append(f"lr_scheduler_kwargs {unknown} are not taken by {name!r} (it takes {params})")
    if required - set(kwargs):
        out.append(f"lr_scheduler_type={name!r} needs {sorted(required - set(kwargs))} in lr_scheduler_kwargs")
    return out


def named(name: str, value: float, warmup_steps: int, total_steps: int, **kwargs: Any) -> Schedule:
    """Return the schedule HF's ``get_scheduler(name, ...)`` gives, with its ``lr_scheduler_kwargs``.

    >>> s = named("cosine_with_min_lr", 1.0, 0, 10, min_lr=0.1)
    >>> round(s(10), 4), named("constant_with_warmup", 1.0, 2, 10)(1)
    (0.1, 0.5)
    """
    problems = schedule_kwargs_problems(name, kwargs)
    if problems:
        raise ValueError("; ".join(problems))
    return _NAMED[name](value, warmup_steps, total_steps, **kwargs)
