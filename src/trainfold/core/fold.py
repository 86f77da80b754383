"""Training as a fold: ``fit`` reduces a step over batches, ``trajectory`` yields every state.

A stop predicate ``stop(state) -> bool`` is checked before each batch is drawn, so a run that
stops never pulls a batch it does not train on.

Donation: a step that has a donating variant (``step.donating``, as ``make_step``'s steps do) is
given the states ``fit`` made itself by donation (it never reuses them), so the update runs in
place, on one copy of the weights; the state you pass in is left intact unless ``donate=True``.
``trajectory`` yields every state to its consumer, who may keep them, so it donates only when
asked (``donate=True``: each yielded state is donated to the next step).

>>> def step(state, batch):
...     return state + batch
>>> fit(step, 0, [1, 2, 3])
6
>>> list(trajectory(step, 0, [1, 2, 3]))
[1, 3, 6]
>>> fit(step, 0, iter(range(100)), stop=lambda s: s >= 10)
10
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["fit", "trajectory", "max_steps", "max_time", "any_of", "never", "steps_interval"]

S = TypeVar("S")
Stop = Callable[[Any], bool]


def never(state: Any) -> bool:
    """The stop predicate that never stops.

    >>> never(None)
    False
    """
    return False


def trajectory(
    step: Callable[[S, Any], S], state: S, batches: Iterable[Any], stop: Stop = never, *, donate: bool = False
) -> Iterator[S]:
    """Yield the state after each step (lazily), until ``batches`` ends or ``stop(state)`` holds.

    ``donate=True`` donates each state to the step after it, the first one included (with a step
    that has ``step.donating``): keep no yielded state past the next one.

    >>> list(trajectory(lambda s, b: s * b, 1, [2, 3, 4], stop=lambda s: s > 5))
    [2, 6]
    """
    return _trajectory(step, state, batches, stop, donate, donate)


def _trajectory(
    step: Callable[[S, Any], S], state: S, batches: Iterable[Any], stop: Stop, first: bool, rest: bool
) -> Iterator[S]:
    donating = getattr(step, "donating", None) or step
    it = iter(batches)
    donate = first
    while not stop(state):
        try:
            batch = next(it)
        except StopIteration:
            return
        state = (donating if donate else step)(state, batch)
        donate = rest
        yield state


def fit(
    step: Callable[[S, Any], S], state: S, batches: Iterable[Any], stop: Stop = never, *, donate: bool = False
) -> S:
    """Return the last state of ``trajectory(step, state, batches, stop)`` (``state`` if no step ran).

    Every state ``fit`` makes is donated to the next step (``step.donating``); ``donate=True``
    donates the given ``state`` too (then it must not be used again).

    >>> fit(lambda s, b: s + [b], [], "abc"), fit(lambda s, b: s + b, 5, [])
    (['a', 'b', 'c'], 5)
    """
    for new in _trajectory(step, state, batches, stop, donate, True):
        state = new
    return state


def max_steps(n: int) -> Stop:
    """Stop once ``state.step`` reaches ``n``.

    >>> import torch, types
    >>> max_steps(3)(types.SimpleNamespace(step=torch.tensor(3)))
    True
    """
    return lambda state: int(state.step) >= n


def max_time(seconds: float, clock: Callable[[], float] = time.monotonic) -> Stop:
    """Stop once ``seconds`` have passed since this predicate was made.

    >>> max_time(0.0)(None)
    True
    """
    deadline = clock() + seconds
    return lambda state: clock() >= deadline


def any_of(*stops: Stop) -> Stop:
    """Stop when any of ``stops`` says so.

    >>> any_of(never, lambda s: s > 1)(2)
    True
    """
    return lambda state: any(s(state) for s in stops)


def steps_interval(value: Any, max_steps: int | None, name: str) -> int:
    """Return the interval ``value`` of the setting ``name`` in steps; a value below 1 is a share of ``max_steps``.

    >>> steps_interval(4, None, "save_steps"), steps_interval(0.25, 10, "save_steps")
    (4, 3)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of steps (or a share < 1 of max_steps), got {value!r}")
    if value < 1:
        if max_steps is None or max_steps <= 0:
            raise ValueError(f"{name}={value} is a share of max_steps, so pass max_steps (got {max_steps!r})")
        return math.ceil(max_steps * value)
    if value != int(value):
        raise ValueError(f"{name} above 1 must be a whole number of steps, got {value!r}")
    return int(value)
