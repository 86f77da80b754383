"""Preemption: turn SIGTERM into a stop at the next step boundary, then a JIT checkpoint.

``preemption_guard()`` installs a SIGTERM handler only while its block runs (the previous handler
is restored on exit, also on exceptions). The handler only sets a flag; ``guard.stop`` is a stop
predicate for ``fit``/``trajectory`` (combine with ``any_of``), checked before each batch is drawn,
so the step in flight finishes and no batch of the next step is drawn. The caller then saves with
``trainfold.ckpt.save(..., jit=True)`` (marked as the preemption checkpoint) and reports preemption, e.g. by
exiting with ``EXIT_PREEMPTED`` (143 = 128 + SIGTERM, what an orchestrator expects from a terminated job).

>>> import os, signal
>>> from trainfold.core.fold import any_of, fit, max_steps
>>> with preemption_guard() as guard:
...     def step(n, batch):
...         if n == 2:
...             os.kill(os.getpid(), signal.SIGTERM)  # preempted during the third step
...         return n + 1
...     n = fit(step, 0, range(10), stop=guard.stop)
>>> n, guard.requested()
(3, True)

Guards nest: a guard entered while another one catches the same signal shares its flag, so a
signal caught while a script builds its model (an outer ``preemption_guard()``) stops ``train``
(whose own guard is inside) before its first step. A nested guard leaves a signal that is ignored
(``SIG_IGN``) ignored: the outer code chose not to catch it (the command line keeps a SIGINT that
the process inherited as ignored, ``nohup ... &``, ignored through ``train``). ``train`` catches SIGTERM and SIGINT
(``JIT_SIGNALS``: Ctrl-C saves like a preemption) and records which one came, and
``exit_status`` turns that into 143 or 130. ``exit_on_signals()`` is for the time before any guard
(a command line's imports and setup): the signal then ends the process at once with that status,
through ``SystemExit``, so ``finally`` blocks and atomic writers clean up.

The orchestrator's grace period must cover one step, one save and a margin (Kubernetes
``terminationGracePeriodSeconds``; Slurm ``--signal=TERM@<seconds>``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from trainfold.core.collective import Collective

__all__ = [
    "EXIT_PREEMPTED",
    "JIT_SIGNALS",
    "Preemption",
    "exit_on_signals",
    "ignore_signals_until_exit",
    "exit_status",
    "guarded",
    "preemption_guard",
]

EXIT_PREEMPTED = 128 + int(signal.SIGTERM)
JIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what train catches with enable_jit_checkpoint


@attrs.frozen
class Preemption:
    """The flag a preemption signal sets, and how ranks agree on it.

    ``collective`` (the step's ``Collective``: ``sum_`` over ranks) makes ``requested`` true on
    every rank as soon as any rank was signalled; every rank must then call it at the same points
    (``fit`` calls the stop predicate once before each step on every rank).

    >>> class OtherRankSignalled:                 # a collective whose other rank saw SIGTERM
    ...     rank = 0
    ...     def sum_(self, tensors):
    ...         tensors[0] += 1
    >>> Preemption().stop(None), Preemption(collective=OtherRankSignalled()).stop(None)
    (False, True)
    """

    event: threading.Event = attrs.field(factory=threading.Event)
    collective: Collective | None = None
    received: list[int] = attrs.field(factory=list, eq=False)  # the signals caught, in order

    def request(self, signum: int | None = None) -> None:
        """Ask for a stop at the next step boundary (what the signal handler does, with its signal)."""
        if signum is not None:
            self.received.append(int(signum))
        self.event.set()

    @property
    def signal(self) -> int | None:
        """Return the first signal caught here, or None (none caught, or another rank's).

        >>> p = Preemption()
        >>> p.signal, (p.request(signal.SIGINT), p.signal == signal.SIGINT)[1]
        (None, True)
        """
        return self.received[0] if self.received else None

    def requested(self) -> bool:
        """Say whether a stop was asked for, here or (with a collective) on any rank.

        >>> p = Preemption()
        >>> p.requested(), (p.request(), p.requested())[1]
        (False, True)
        """
        local = self.event.is_set()
        if self.collective is None:
            return local
        flag = torch.tensor([int(local)], dtype=torch.int64)
        self.collective.sum_([flag])
        return int(flag.item()) > 0

    def stop(self, state: Any) -> bool:
        """The stop predicate: ``fit(step, state, batches, stop=any_of(max_steps(n), guard.stop))``."""
        return self.requested()


@contextlib.contextmanager
def preemption_guard(
    signals: Sequence[int] = (signal.SIGTERM,), *, collective: Collective | None = None
) -> Iterator[Preemption]:
    """Catch ``signals`` while the block runs, setting the yielded ``Preemption`` flag.

    Outside the block the previous handlers are back, so a SIGTERM there ends the process as
    usual. Must be entered in the main thread (Python delivers signals only there).

    >>> import signal
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> with preemption_guard() as guard:
    ...     signal.raise_signal(signal.SIGTERM)
    >>> guard.requested(), signal.getsignal(signal.SIGTERM) is before
    (True, True)
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "preemption_guard() must be entered in the main thread: Python runs signal handlers "
            "only there; run the training loop in the main thread"
        )
    outer = next((h.flag for h in map(signal.getsignal, signals) if isinstance(h, _SetFlag)), None)
    if outer is not None:  # nested: share the outer guard's flag, so what it caught stops this block too
        flag = Preemption(outer.event, collective, outer.received)
        signals = [s for s in signals if signal.getsignal(s) != signal.SIG_IGN]  # the outer code left it ignored
    else:
        flag = Preemption(collective=collective)
    handler = _SetFlag(flag)
    previous: dict[int, Any] = {}
    try:
        for s in signals:
            previous[s] = signal.signal(s, handler)
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@attrs.frozen
class _SetFlag:
    """The signal handler of ``preemption_guard``: it only sets the flag (and says which signal)."""

    flag: Preemption

    def __call__(self, signum: int, frame: Any) -> None:
        self.flag.request(signum)


def guarded(when: Callable[[Mapping[str, Any]], bool], signals: Sequence[int] = JIT_SIGNALS) -> Callable[..., Any]:
    """Decorate a function so its whole call runs inside ``preemption_guard(signals)`` when ``when(arguments)``.

    ``arguments`` maps the call's parameter names to their values. ``train`` is decorated so its
    guard is up from its first line (building the state, loading a checkpoint, evaluating at the
    start), not only around the loop; the loop's own guard nests and shares the flag.

    >>> @guarded(lambda call: call["catch"])
    ... def work(catch):
    ...     signal.raise_signal(signal.SIGTERM)   # arrives during setup
    ...     with preemption_guard() as guard:     # the loop's guard sees it
    ...         return guard.requested()
    >>> work(catch=True)
    True
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        parameters = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*positional: Any, **kwargs: Any) -> Any:
            bound = parameters.bind(*positional, **kwargs)
            bound.apply_defaults()
            if not when(bound.arguments):
                return fn(*positional, **kwargs)
            with preemption_guard(signals):
                return fn(*positional, **kwargs)

        return wrapper

    return decorate


def exit_on_signals(signals: Sequence[int] = (signal.SIGTERM,)) -> Callable[[], None]:
    """Make ``signals`` end the process with ``SystemExit(128 + signum)``; return a function that undoes it.

    For the setup before a guard (imports, reading a config, building a model): the exit unwinds
    the stack, so ``finally`` blocks run and an atomic writer removes its temporary directory —
    nothing is half-written — and the exit status is the one a terminated job reports (143). A
    ``preemption_guard`` entered later takes the signals over for its block.

    >>> restore = exit_on_signals()
    >>> try:
    ...     signal.raise_signal(signal.SIGTERM)
    ... except SystemExit as e:
    ...     print(e.code)
    143
    >>> restore()
    """

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + int(signum))

    previous = {s: signal.signal(s, leave) for s in signals}

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)

    return restore


def ignore_signals_until_exit(signals: Sequence[int] = JIT_SIGNALS) -> None:
    """Ignore ``signals`` from here to the process's exit: its run is over and its exit status is final.

    A job script calls this once its run has ended (or before it enters the ``preemption_guard`` that
    covers the run, which restores this on its way out): a SIGTERM that then arrives while the
    interpreter tears down (about a second with torch loaded) would otherwise kill a *completed* run
    with -15, which a scheduler reads as a failure. The command line does the same after ``train``.

    >>> before = {s: signal.getsignal(s) for s in JIT_SIGNALS}
    >>> ignore_signals_until_exit()
    >>> signal.raise_signal(signal.SIGTERM)   # nothing happens
    >>> for s, h in before.items():
    ...     _ = signal.signal(s, h)
    """
    for s in signals:
        signal.signal(s, signal.SIG_IGN)


def exit_status(status: str, signum: int | None = None) -> int:
    """Return the process exit status for a run's ``status``: 0, or 128 + the signal when preempted.

    >>> exit_status("completed"), exit_status("preempted"), exit_status("preempted", signal.SIGINT)
    (0, 143, 130)
    """
    if status != "preempted":
        return 0
    return 128 + int(signum if signum is not None else signal.SIGTERM)
