"""Hooks as values: ``Hook(fn, every)``, when each fires (``Every``), and the one table of their order.

A hook is a function ``fn(state, log) -> state | None`` (``log`` the run's ``RunLog``; ``None``: the
state is unchanged) with a schedule ``every`` and a ``kind``, the slot of ``EVENTS`` it fires in.
After each step the run walks ``EVENTS`` in order: each hook of the slot's kind fires when its
schedule is due in the slot's phase: ``step`` (every n steps, or every so many seconds), ``epoch`` (the
step closed an epoch: every n epochs), ``after`` (after the epoch's hooks: a progress bar, what settles
the step), ``end`` (after the run's last step: ``at_end``). A hook fires at most once per step, in the
first phase it is due in. The ``judge`` slot runs each hook's ``judge`` (early stopping, the best metric)
once after every new evaluation. A step closes an epoch when the data's cursor enters the next one, when
``loop.run``'s ``epoch_closed(state)`` holds, or when a hook says so (``log.close_epoch()``). After a step
whose params diverged only the hooks declared ``after_divergence`` fire (by default the log and after slots).

>>> seen = []
>>> hook = every(2, lambda state, log: seen.append(state))
>>> hook.every.due_at_step(4), hook.every.due_at_step(3), hook.kind
(True, False, 'hook')
>>> [slot for phase, slot in EVENTS if phase == "step"]
['hook', 'log', 'evaluate', 'judge', 'save']
>>> [phase for phase, slot in EVENTS if slot == "after"]
['after']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

__all__ = ["AFTER_DIVERGENCE", "EVENTS", "KINDS", "PHASES", "Every", "Hook", "every", "flat_hooks", "hook_extras"]

# The order of what happens after a step: the one place it is written. Step-driven before epoch-driven
# (HF: an evaluation by steps comes before the epoch's log), and in each phase HF's order: callbacks,
# log, evaluate, what reads the evaluation (early stopping, the best metric), save; then, after the epoch's,
# what settles the step (HF: the callbacks' requests and on_epoch_end, the progress bar).
EVENTS: tuple[tuple[str, str], ...] = (
    ("step", "hook"),
    ("step", "log"),
    ("step", "evaluate"),
    ("step", "judge"),
    ("step", "save"),
    ("epoch", "hook"),
    ("epoch", "log"),
    ("epoch", "evaluate"),
    ("epoch", "judge"),
    ("epoch", "save"),
    ("after", "after"),
    ("end", "hook"),
    ("end", "log"),
    ("end", "evaluate"),
    ("end", "judge"),
    ("end", "save"),
)
PHASES = ("step", "epoch", "after", "end")
KINDS = ("hook", "log", "evaluate", "judge", "save", "after")
AFTER_DIVERGENCE = ("log", "after")  # the slots whose hooks fire after a diverged step unless a hook says otherwise


def _positive(name: str, kind: type) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value is None:
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (kind is int and not isinstance(value, int)) or not value > 0:
            raise ValueError(f"every: {name}={value!r} must be a positive {kind.__name__} or None")

    return check


@attrs.frozen
class Every:
    """When a hook fires: every ``steps`` steps, every ``epochs`` epochs, every ``seconds`` (checked after each
    step), and/or ``at_end`` (after the run's last step); any that holds.

    >>> Every(steps=3).due_at_step(6), Every(epochs=2).due_at_epoch(4), Every(at_end=True).at_end
    (True, True, True)
    >>> Every(steps=0)
    Traceback (most recent call last):
    ...
    ValueError: every: steps=0 must be a positive int or None
    """

    steps: int | None = attrs.field(default=None, validator=_positive("steps", int))
    epochs: int | None = attrs.field(default=None, validator=_positive("epochs", int))
    seconds: float | None = attrs.field(default=None, validator=_positive("seconds", float))
    at_end: bool = False

    def due_at_step(self, step: int) -> bool:
        """Say whether the steps schedule holds after optimizer step ``step``."""
        return self.steps is not None and step > 0 and step % self.steps == 0

    def due_at_epoch(self, epoch: int) -> bool:
        """Say whether the epochs schedule holds when epoch ``epoch`` (counted from 1) has just ended."""
        return self.epochs is not None and epoch > 0 and epoch % self.epochs == 0


def _every(value: Every | int | None) -> Every:
    if value is None:
        return Every()
    if isinstance(value, Every):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Hook: every={value!r} must be an Every(...) or a number of steps (int)")
    return Every(steps=value)


def _extras(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


def _kind(instance: Any, attribute: Any, value: str) -> None:
    if value not in KINDS:
        raise ValueError(f"Hook: kind={value!r} is not one of {list(KINDS)} (the slots of loop.EVENTS)")


@attrs.frozen
class Hook:
    """A function the run calls between steps: ``fn(state, log) -> state | None`` when ``every`` is due.

        ``kind`` is its slot in ``EVENTS``; ``extras`` the records it keeps in ``state.extras`` (added to the first
        state, so a checkpoint carries them and a resume continues them); ``judge(state, log)`` runs once after each
        new evaluation, in the ``judge`` slot; ``halts(state)`` is a stop rule the hook adds to the run's (checked
        before each step, a resumed run's first included): when it holds the run ends with status ``stopped``.
    ``after_divergence``: whether it fires after a step whose params turned inf/NaN (default: its slot is in
    ``AFTER_DIVERGENCE``; a save or an evaluation of non-finite params never is).

        >>> Hook(lambda state, log: None, 10).every
        Every(steps=10, epochs=None, seconds=None, at_end=False)
    """

    fn: Callable[[Any, Any], Any] | None
    every: Every = attrs.field(default=None, converter=_every)
    kind: str = attrs.field(default="hook", validator=_kind)
    extras: Mapping[str, Any] = attrs.field(factory=dict, converter=_extras)
    judge: Callable[[Any, Any], Any] | None = None
    name: str = ""
    halts: Callable[[Any], bool] | None = None
    after_divergence: bool = attrs.field(
        default=attrs.Factory(lambda self: self.kind in AFTER_DIVERGENCE, takes_self=True)
    )


def every(
    n: int | None = None,
    fn: Callable[[Any, Any], Any] | None = None,
    *,
    epochs: int | None = None,
    seconds: float | None = None,
    at_end: bool = False,
) -> Hook:
    """Return a hook calling ``fn(state, log)`` every ``n`` steps (and/or ``epochs``, ``seconds``, ``at_end``).

    >>> every(100, print).every.steps, every(fn=print, epochs=1).every.epochs
    (100, 1)
    >>> every(10)
    Traceback (most recent call last):
    ...
    TypeError: loop.every(...) needs fn, the function (state, log) -> state | None it calls
    """
    if fn is None:
        raise TypeError("loop.every(...) needs fn, the function (state, log) -> state | None it calls")
    if n is None and epochs is None and seconds is None and not at_end:
        raise ValueError("loop.every(fn=...) fires never: give n (steps), epochs=, seconds= or at_end=True")
    return Hook(fn, Every(n, epochs, seconds, at_end), name=getattr(fn, "__name__", ""))


def flat_hooks(hooks: Iterable[Any]) -> tuple[Hook, ...]:
    """Return ``hooks`` as one tuple of ``Hook`` (nested sequences flattened); anything else is refused by name.

    >>> len(flat_hooks([every(1, print), (every(2, print),)]))
    2
    """
    found: list[Hook] = []
    for hook in hooks:
        if isinstance(hook, Hook):
            found.append(hook)
        elif isinstance(hook, (list, tuple)):
            found.extend(flat_hooks(hook))
        else:
            raise TypeError(
                f"hooks: {hook!r} is not a loop.Hook; make one with loop.every(n, fn), Hook(fn, every) or a built-in "
                "(loop.log, loop.evaluate, loop.save, loop.early_stop)"
            )
    return tuple(found)


def hook_extras(hooks: Iterable[Hook]) -> dict[str, Any]:
    """Return the ``state.extras`` the hooks keep, refusing two hooks that claim the same key.

    >>> hook_extras([Hook(None, extras={"a": 1}), Hook(None, extras={"b": 2})])
    {'a': 1, 'b': 2}
    """
    found: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for hook in hooks:
        for key, value in hook.extras.items():
            if key in found:
                raise ValueError(
                    f"two hooks keep state.extras[{key!r}] ({owner[key] or 'a hook'} and {hook.name or 'a hook'}); "
                    "give one of them another key= so each keeps its own record"
                )
            found[key], owner[key] = value, hook.name
    return found
