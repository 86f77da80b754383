"""A loaded checkpoint's CRC-32s (and frozen weights) checked in a background thread, off a resume's critical path.

A resume reads the files without checksumming them (``load(..., crc_checked=True)``), starts
``verify_later(directory)`` and trains; before anything is written (a save, the end of the run)
it calls ``wait()``, which raises ``CheckpointError`` naming the damaged file. So a corrupt
checkpoint never leads to a saved artifact: the run stops, by name, after its first steps.

Only a checkpoint that cannot be torn by a machine crash is worth resuming this way
(``atomic.is_durable``): among several, ``resume_from_checkpoint=True`` must know *before* it loads
one whether it is whole, to fall back to the previous one (``run_dir.resumable``).

>>> import tempfile, torch
>>> from trainfold.optim import sgd
>>> from trainfold.core.state import init_state
>>> from trainfold.ckpt import save
>>> path = save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp() + "/checkpoint-0")
>>> check = verify_later(path)
>>> check.wait() is None, check.done()
(True, True)
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainfold.ckpt import tensor_file
from trainfold.ckpt.crc import combine_all
from trainfold.ckpt.listing import corruption, incompleteness
from trainfold.ckpt.reader import frozen_problem, frozen_tensors
from trainfold.ckpt.sidecar import DURABLE_MARKER, CheckpointError, read_metadata
from trainfold.core.state import TrainState

__all__ = ["Verification", "verify_later"]


class Verification:
    """The CRC-32 check of every file of a checkpoint (and of a frozen base), in a background thread.

    The work is a list of tasks: each 4 MB piece of each file, and the frozen fingerprints. The
    thread runs at the lowest CPU priority (``_yield_to_training``) and takes them one by one;
    ``wait`` takes the ones not yet started in the caller's thread, and redoes any a starved
    background thread still holds, so a wait never depends on idle cores.
    """

    def __init__(self, directory: str | os.PathLike, loaded: TrainState | None = None) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._results: dict[int, Any] = {}
        self._claimed = 0
        self._tasks: list[Callable[[], Any]] = []
        self._files: list[tuple[Path, list[int], int]] = []  # a file, its pieces' task numbers, its CRC-32
        self._frozen_task: int | None = None
        self._incomplete = incompleteness(self.directory)  # the sidecar and the sizes: a few stat calls
        if self._incomplete is None:
            self._plan(read_metadata(self.directory), loaded)
        self._thread = threading.Thread(target=self._background, name=f"trainfold-verify-{self.directory.name}")
        self._thread.daemon = True
        self._thread.start()

    def _plan(self, meta: Mapping[str, Any], loaded: TrainState | None) -> None:
        for name, entry in meta["files"].items():
            path, size = self.directory / name, entry["bytes"]
            first = len(self._tasks)
            for at in range(0, max(size, 1), _PIECE):
                self._tasks.append(functools.partial(_piece, path, at, min(_PIECE, size - at)))
            self._files.append((path, list(range(first, len(self._tasks))), entry["crc32"]))
        if loaded is not None and meta.get("frozen"):  # None: the load checked them
            frozen = frozen_tensors(self.directory, meta, loaded, check=False)  # names any it lacks
            self._frozen_task = len(self._tasks)
            self._tasks.append(functools.partial(frozen_problem, self.directory, meta, frozen))

    def _run(self, task: int) -> None:
        try:
            result = self._tasks[task]()
        except Exception as e:  # a file that vanished or shrank: raised by wait, in the caller's thread
            result = e
        with self._lock:
            self._results.setdefault(task, result)

    def _drain(self) -> None:
        """Run the tasks nobody has started, one at a time, until there are none."""
        while True:
            with self._lock:
                task, self._claimed = self._claimed, self._claimed + 1
            if task >= len(self._tasks):
                return
            self._run(task)

    def _background(self) -> None:
        _yield_to_training()
        self._drain()

    def done(self) -> bool:
        """Say whether every task has a result (``wait`` then returns, or raises, at once)."""
        with self._lock:
            return len(self._results) == len(self._tasks)

    def wait(self, *, steps: int | None = None, forget_durable: bool = False) -> None:
        """Return once every file matched its CRC-32; raise ``CheckpointError`` naming the damage otherwise.

        ``steps``: how many steps ran from the checkpoint (named in the error). ``forget_durable``: a
        damaged checkpoint loses its durable mark, so ``resume_from_checkpoint=True`` checks it
        before it loads it next time, and takes the previous one.
        """
        self._drain()
        for task in range(len(self._tasks)):
            if task not in self._results:  # the background thread holds it, maybe starved: run it here too
                self._run(task)
        kind, problem = self._verdict()
        if kind is None:
            return
        if isinstance(problem, BaseException):
            raise CheckpointError(f"{self.directory} could not be checked after it was loaded: {problem}") from problem
        ran = f"this run resumed from {self.directory}" + (
            "" if steps is None else f" and stopped after {steps} step(s) from it"
        )
        ran += ", before it saved anything (a resume checks the checkpoint while its first steps run)"
        if kind == "frozen":  # the checkpoint is whole: the model given is not the one it was trained on
            raise CheckpointError(f"{problem}; {ran}")
        if forget_durable:
            (self.directory / DURABLE_MARKER).unlink(missing_ok=True)
        raise CheckpointError(
            f"{problem}: {ran}; resume from an earlier checkpoint"
            + (
                " (resume_from_checkpoint=True now checks this one before it loads it, and passes over it)"
                if forget_durable
                else ""
            )
        )

    def _verdict(self) -> tuple[str | None, Any]:
        """Return ``(kind, problem)`` of every task's result: ``(None, None)`` when all is well."""
        if self._incomplete is not None:
            return "damage", self._incomplete
        failed = next((r for r in self._results.values() if isinstance(r, Exception)), None)
        if failed is not None:
            return "error", failed
        for path, pieces, recorded in self._files:
            crc = combine_all(self._results[i] for i in pieces)
            if crc != recorded:
                return "damage", corruption(path, crc, recorded)
        if self._frozen_task is not None and self._results[self._frozen_task] is not None:
            return "frozen", self._results[self._frozen_task]
        return None, None


_PIECE = 1 << 22  # bytes CRC'd as one task
_buffers = threading.local()  # each thread's piece buffer


def _piece(path: Path, at: int, size: int) -> tuple[int, int]:
    """Return the ``(CRC-32, length)`` of ``size`` bytes of ``path`` from offset ``at``."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = memoryview(bytearray(_PIECE))
    fd = os.open(path, os.O_RDONLY)
    try:
        return tensor_file._read_piece(path, fd, at, buf[:size])
    finally:
        os.close(fd)


def _yield_to_training() -> None:
    """Run this thread (and the CRC threads it starts, which inherit it) at the lowest CPU priority.

    On a CPU-bound run the check then takes a core only when the steps leave it idle: at the same
    priority its threads preempted the step's intra-op threads, which wait for each other, and three
    40M-param steps beside a 487 MB check took 10% longer (``benchmarks/resume_start.py``
    ``--same-priority``); idle, 0.4%. Linux only (``SCHED_IDLE``); elsewhere it runs at the caller's
    priority. ``Verification.wait`` never depends on it: the caller runs what is left.
    """
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def verify_later(directory: str | os.PathLike, loaded: TrainState | None = None) -> Verification:
    """Start checking every file of checkpoint ``directory`` against its CRC-32 in a thread (``Verification``).

    ``loaded``: the state ``load(directory, ..., frozen_checked=True)`` returned; its frozen base
    weights (a LoRA model's base) are checked against the recorded fingerprints in the same thread.
    They must not change meanwhile (a step never writes frozen weights).
    """
    return Verification(directory, loaded)
