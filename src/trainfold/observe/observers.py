"""Observers of the training trajectory: side effects that watch the states a fold produces.

They never change what a step computes. What they must remember across a resume (the last logging
mark, the early-stopping counter) lives in ``state.extras`` as small records of 0-d tensors, so a
checkpoint carries it; ``initial_extras`` makes the first state's. When to log is ``log_plan``, what
a log holds ``entries``, the token count ``tokens``, early stopping ``stopping``.

>>> import torch
>>> from trainfold.core.state import TrainState, scalar
>>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(2), loss_total=scalar(3.0, torch.float64))
>>> seen = []
>>> logged = log_if_due(s, LoggingPlan("steps", 2), observers=[lambda state, entry: seen.append(entry["loss"])])
>>> seen, log_mark(logged).step.item()
([1.5], 2)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from trainfold.core.state import TrainState, scalar
from trainfold.observe.entries import LOG_MARK, LogMark, MetricWindow, log_entry, log_mark, mark_logged
from trainfold.observe.log_plan import LoggingPlan, should_log
from trainfold.observe.stopping import EarlyStopping, EarlyStoppingRecord
from trainfold.observe.tokens import TOKENS_SEEN

__all__ = ["Observer", "initial_extras", "log_if_due", "notify", "observing", "tap"]

# An observer sees the state and the entry just logged: the functional form of a callback.
Observer = Callable[[TrainState, Mapping[str, float]], None]


def notify(observers: Iterable[Observer], state: TrainState, logs: Mapping[str, Any]) -> None:
    """Call each observer ``(state, logs) -> None`` with a fresh copy of ``logs``.

    >>> seen = []
    >>> notify([lambda s, logs: seen.append(logs["loss"])], None, {"loss": 1.0})
    >>> seen
    [1.0]
    """
    for observe in observers:
        observe(state, dict(logs))


def log_if_due(
    state: TrainState,
    plan: LoggingPlan,
    reporters: Sequence[Any] = (),
    observers: Iterable[Observer] = (),
    *,
    steps_per_epoch: float | None = None,
    epoch_end: bool = False,
    last: bool = False,
    window: MetricWindow | None = None,
) -> TrainState:
    """Log the window ending at ``state`` if ``plan`` says so; return the state with its mark moved.

    The entry goes to each reporter (``reporter.log(entry, step)``) and each observer
    ``(state, entry)``; with a ``window`` it also holds the window means of the other metrics.
    When no log is due, ``state`` comes back unchanged.

    >>> import torch
    >>> from trainfold.core.state import TrainState
    >>> class Printer:
    ...     def log(self, entry, step):
    ...         print(step, entry["loss"])
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(2), loss_total=scalar(3.0, torch.float64))
    >>> logged = log_if_due(s, LoggingPlan("steps", 2), [Printer()])
    2 1.5
    >>> log_mark(logged).step.item(), log_if_due(logged, LoggingPlan("steps", 2)) is logged
    (2, True)
    """
    if not should_log(plan, int(state.step), int(log_mark(state).step), epoch_end=epoch_end, last=last):
        return state
    entry = log_entry(state, steps_per_epoch=steps_per_epoch)
    if window is not None:
        means = window.take()
        entry.update(means)
        # a log only the run's end asks for: TRL leaves this window to its end-of-training entry, so it goes there too
        only_at_end = not should_log(plan, int(state.step), int(log_mark(state).step), epoch_end=epoch_end)
        window.pending = means if last and only_at_end else {}
    for reporter in reporters:
        reporter.log(entry, entry["step"])
    notify(observers, state, entry)
    return mark_logged(state)


def observing(
    step: Callable[[TrainState, Any], TrainState], *afters: Callable[[TrainState], TrainState]
) -> Callable[[TrainState, Any], TrainState]:
    """Return a step that runs ``step`` and then passes the new state through each of ``afters``.

    This is how observers that update ``state.extras`` (logging marks, early stopping) join a fold.

    >>> double_then_inc = observing(lambda s, b: s * b, lambda s: s + 1)
    >>> double_then_inc(3, 2)
    7
    """

    def observed(state: TrainState, batch: Any) -> TrainState:
        state = step(state, batch)
        for after in afters:
            state = after(state)
        return state

    return observed


def tap(effect: Callable[[TrainState], Any]) -> Callable[[TrainState], TrainState]:
    """Turn a side effect ``effect(state)`` into ``state -> state`` for ``observing``.

    >>> seen = []
    >>> tap(seen.append)(5), seen
    (5, [5])
    """

    def tapped(state: TrainState) -> TrainState:
        effect(state)
        return state

    return tapped


def initial_extras(*stoppers: EarlyStopping, log_key: str = LOG_MARK, tokens_seen: bool = False) -> dict[str, Any]:
    """Return the ``extras`` a run's first state needs: a logging mark and one record per early stopper.

    Pass it to ``init_state(..., extras=...)`` so that the template a checkpoint loads into has the
    same structure as the states that were saved.

    >>> from trainfold.observe.stopping import early_stopping
    >>> sorted(initial_extras(early_stopping("eval_loss")))
    ['early_stopping', 'log_mark']
    """
    tokens = {TOKENS_SEEN: scalar(0)} if tokens_seen else {}
    return {log_key: LogMark(), **tokens, **{es.key: EarlyStoppingRecord() for es in stoppers}}
