"""Training as a fold: ``fit`` reduces a step over batches, ``trajectory`` yields every state.

A stop predicate ``stop(state) -> bool`` is checked before each batch is drawn, so a run that
stops never pulls a batch it does not train on.

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

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["fit", "trajectory", "max_steps", "max_time", "any_of", "never"]

S = TypeVar("S")
Stop = Callable[[Any], bool]


def never(state: Any) -> bool:
    """The stop predicate that never stops.

    >>> never(None)
    False
    """
    return False


def trajectory(step: Callable[[S, Any], S], state: S, batches: Iterable[Any], stop: Stop = never) -> Iterator[S]:
    """Yield the state after each step (lazily), until ``batches`` ends or ``stop(state)`` holds.

    >>> list(trajectory(lambda s, b: s * b, 1, [2, 3, 4], stop=lambda s: s > 5))
    [2, 6]
    """
    it = iter(batches)
    while not stop(state):
        try:
            batch = next(it)
        except StopIteration:
            return
        state = step(state, batch)
        yield state


def fit(step: Callable[[S, Any], S], state: S, batches: Iterable[Any], stop: Stop = never) -> S:
    """Return the last state of ``trajectory(step, state, batches, stop)`` (``state`` if no step ran).

    >>> fit(lambda s, b: s + [b], [], "abc"), fit(lambda s, b: s + b, 5, [])
    (['a', 'b', 'c'], 5)
    """
    for state in trajectory(step, state, batches, stop):  # noqa: B007 - the last one is the result
        pass
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
