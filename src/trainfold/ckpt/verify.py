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

import os
import threading
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from trainfold.ckpt.listing import damage
from trainfold.ckpt.reader import frozen_problem
from trainfold.ckpt.sidecar import DURABLE_MARKER, CheckpointError, read_metadata

__all__ = ["Verification", "verify_later"]


class Verification:
    """The CRC-32 check of every file of a checkpoint, running in a daemon thread (``verify_later``)."""

    def __init__(self, directory: str | os.PathLike, frozen: Mapping[str, Tensor] | None = None) -> None:
        self.directory = Path(directory)
        self._frozen = None if frozen is None else dict(frozen)  # None: the load checked them
        self._problem: list[tuple[str, str | BaseException] | None] = []
        self._thread = threading.Thread(target=self._run, name=f"trainfold-verify-{self.directory.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            problem = damage(self.directory)
            if problem is not None:
                self._problem.append(("damage", problem))
                return
            meta = read_metadata(self.directory)
            wrong = None
            if self._frozen is not None and meta.get("frozen"):
                wrong = frozen_problem(self.directory, meta, self._frozen)
            self._problem.append(None if wrong is None else ("frozen", wrong))
        except BaseException as e:  # raised by wait, in the caller's thread
            self._problem.append(("error", e))

    def done(self) -> bool:
        """Say whether the check has ended (``wait`` then returns at once)."""
        return not self._thread.is_alive()

    def wait(self, *, steps: int | None = None, forget_durable: bool = False) -> None:
        """Return once every file matched its CRC-32; raise ``CheckpointError`` naming the damage otherwise.

        ``steps``: how many steps ran from the checkpoint (named in the error). ``forget_durable``: a
        damaged checkpoint loses its durable mark, so ``resume_from_checkpoint=True`` checks it
        before it loads it next time, and takes the previous one.
        """
        self._thread.join()
        found = self._problem[0]
        if found is None:
            return
        kind, problem = found
        if isinstance(problem, BaseException):
            raise CheckpointError(f"{self.directory} could not be checked after it was loaded: {problem}") from problem
        ran = f"this run resumed from {self.directory}" + (
            "" if steps is None else f" and stopped after {steps} step(s)"
        )
        ran += " from it, before it saved anything (a resume checks the checkpoint while its first steps run)"
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


def verify_later(directory: str | os.PathLike, frozen: Mapping[str, Tensor] | None = None) -> Verification:
    """Start checking every file of checkpoint ``directory`` against its CRC-32 in a thread (``Verification``).

    ``frozen``: the frozen base weights the checkpoint was loaded with (``{flattened state key:
    tensor}``, e.g. a LoRA model's base), checked against its recorded fingerprints in the same
    thread (``load(..., frozen_checked=True)`` left them out). They must not change meanwhile (a
    step never writes frozen weights).
    """
    return Verification(directory, frozen)
