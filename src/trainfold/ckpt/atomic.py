"""Durable, atomic file-system writes: fsync a file or a directory, swap a directory into place with ``os.replace``.

``Syncs`` makes a directory already renamed into place durable in a background thread: a killed
process loses nothing (the page cache outlives it), only a machine crash before the fsyncs end can.
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainfold.ckpt.faults import point
from trainfold.ckpt.sidecar import DURABLE_MARKER

__all__ = [
    "FSYNC_MODES",
    "fsync_dir",
    "write_bytes",
    "replace_dir",
    "Syncs",
    "NotDurableError",
    "is_durable",
    "mark_durable",
]

# When a run's checkpoint reaches the disk (``save_fsync``): after the rename, in a thread, or before it.
FSYNC_MODES = ("background", "blocking")
_DURABLE_TEXT = b'{"durable": "every other file of this checkpoint was fsynced before this one was written"}\n'


def fsync_dir(path: Path) -> None:
    """Flush a file, or a directory's entries, to the disk (through a new descriptor: fsync is per file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` and (``fsync``) fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def replace_dir(tmp: Path, directory: Path, *, remove_old: bool = True) -> Path | None:
    """Put ``tmp`` at ``directory`` by ``os.replace``; an existing ``directory`` is moved aside first.

    The replaced directory is removed, or with ``remove_old=False`` left at the hidden path returned
    (for the caller to remove once the new one is durable). A crash between the two renames leaves
    the old checkpoint at its ``.old-`` name, which the next run puts back (``run_lock``).
    """
    old = None
    if directory.exists():
        old = directory.parent / f".{directory.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(directory, old)
        point("replace:moved-aside")
    os.replace(tmp, directory)
    point("replace:renamed")
    if old is None or not remove_old:
        return old
    shutil.rmtree(old, ignore_errors=True)
    point("replace:removed")
    return None


def is_durable(directory: str | os.PathLike) -> bool:
    """Say whether every file of ``directory`` was fsynced (its marker, written after them, is there).

    >>> is_durable("no/such/checkpoint-1")
    False
    """
    return (Path(directory) / DURABLE_MARKER).is_file()


def mark_durable(directory: Path) -> None:
    """Record that every file of ``directory`` is on the disk (unsynced: nothing relies on it, hashes are checked)."""
    write_bytes(directory / DURABLE_MARKER, _DURABLE_TEXT, fsync=False)


class NotDurableError(OSError):
    """A checkpoint renamed into place whose background fsync failed: visible, but maybe lost by a machine crash."""


def make_durable(directory: Path, replaced: Path | None = None, then: Callable[[Path], Any] | None = None) -> None:
    """Fsync every file of ``directory``, it and its parent, mark it durable; then drop ``replaced``, call ``then``."""
    point(f"durable:started:{directory.name}")
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink())
    dirs = sorted(p for p in directory.rglob("*") if p.is_dir())
    for path in [*files, *dirs, directory, directory.parent]:
        try:
            fsync_dir(path)
        except OSError as e:
            raise NotDurableError(
                e.errno,
                f"checkpoint {directory} is written but not durable: the fsync of "
                f"{path.name if path.parent == directory else path} failed "
                f"({e.strerror or e}); a machine crash may lose or corrupt it, so the older checkpoints "
                "were kept (no rotation); check the disk, then save again or resume from an older checkpoint",
                str(path),
            ) from e
    point(f"durable:synced:{directory.name}")
    mark_durable(directory)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    if then is not None:
        then(directory)


class Syncs:
    """Checkpoints renamed into place before their fsyncs, made durable one at a time in a background thread.

    ``add(directory, replaced=, then=)`` starts a thread running ``make_durable``: rotation (``then``)
    removes an older checkpoint only once the newer one is durable. ``wait()`` returns the checkpoints
    made durable since the last wait, or raises the failure (``NotDurableError`` naming the
    checkpoint; its ``then`` never ran). ``add`` waits for the previous checkpoint first.

    >>> import tempfile
    >>> done = []
    >>> syncs = Syncs()
    >>> syncs.add(Path(tempfile.mkdtemp()), then=done.append)
    >>> len(syncs.wait()), len(done), syncs.pending()
    (1, 1, False)
    """

    def __init__(self) -> None:
        self._jobs: list[tuple[Path, threading.Thread, dict[str, BaseException]]] = []

    def add(self, directory: Path, *, replaced: Path | None = None, then: Callable[[Path], Any] | None = None) -> None:
        """Start making ``directory`` durable (see the class); wait for the previous one first."""
        self.wait()
        outcome: dict[str, BaseException] = {}

        def run() -> None:
            try:
                make_durable(directory, replaced, then)
            except BaseException as e:  # raised by wait, in the caller's thread
                outcome["error"] = e

        thread = threading.Thread(target=run, name=f"trainfold-fsync-{directory.name}", daemon=True)
        self._jobs.append((directory, thread, outcome))
        thread.start()

    def pending(self) -> bool:
        """Say whether a checkpoint is still being made durable."""
        return any(thread.is_alive() for _, thread, _ in self._jobs)

    def wait(self) -> list[Path]:
        """Return the checkpoints made durable since the last wait, once they are; raise the first failure."""
        jobs, self._jobs = self._jobs, []
        for _, thread, _ in jobs:
            thread.join()
        for _, _, outcome in jobs:
            if "error" in outcome:
                raise outcome["error"]
        return [directory for directory, _, _ in jobs]
