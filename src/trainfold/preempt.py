"""Preemption: turn SIGTERM into a stop at the next step boundary, then a JIT checkpoint.

``preemption_guard()`` installs a SIGTERM handler only while its block runs (the previous handler
is restored on exit, also on exceptions). The handler only sets a flag; ``guard.stop`` is a stop
predicate for ``fit``/``trajectory`` (combine with ``any_of``), checked before each batch is drawn,
so the step in flight finishes and no batch of the next step is drawn. The caller then saves with
``jit_checkpoint`` (exempt from rotation) and reports preemption, e.g. by exiting with
``EXIT_PREEMPTED`` (143 = 128 + SIGTERM, what an orchestrator expects from a terminated job).

>>> import os, signal
>>> from trainfold.fold import any_of, fit, max_steps
>>> with preemption_guard() as guard:
...     def step(n, batch):
...         if n == 2:
...             os.kill(os.getpid(), signal.SIGTERM)  # preempted during the third step
...         return n + 1
...     n = fit(step, 0, range(10), stop=guard.stop)
>>> n, guard.requested()
(3, True)

The orchestrator's grace period must cover one step, one save and a margin (Kubernetes
``terminationGracePeriodSeconds``; Slurm ``--signal=TERM@<seconds>``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from trainfold.checkpoint import checkpoint_path, save
from trainfold.state import TrainState
from trainfold.step import Collective

__all__ = ["EXIT_PREEMPTED", "Preemption", "preemption_guard", "jit_checkpoint"]

EXIT_PREEMPTED = 128 + int(signal.SIGTERM)


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

    def request(self) -> None:
        """Ask for a stop at the next step boundary (what the signal handler does)."""
        self.event.set()

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
    flag = Preemption(collective=collective)

    def handler(signum: int, frame: Any) -> None:
        flag.request()

    previous: dict[int, Any] = {}
    try:
        for s in signals:
            previous[s] = signal.signal(s, handler)
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def jit_checkpoint(state: TrainState, output_dir: str | os.PathLike, **save_options: Any) -> Path:
    """Save ``state`` as ``output_dir/checkpoint-{step}`` marked JIT (never rotated away); return its path.

    ``save_options`` are ``checkpoint.save``'s (model, config, metadata, settings).

    >>> import tempfile, torch
    >>> from trainfold.checkpoint import read_metadata
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state
    >>> path = jit_checkpoint(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp())
    >>> path.name, read_metadata(path)["jit"]
    ('checkpoint-0', True)
    """
    return save(state, checkpoint_path(output_dir, int(state.step)), jit=True, **save_options)
