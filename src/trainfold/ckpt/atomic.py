"""Durable, atomic file-system writes: write and fsync a file or a directory, swap a directory into place.

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
    "fsync_file",
    "write_bytes",
    "replace_dir",
    "Syncs",
    "NotDurableError",
    "mark_durable",
    "is_durable",
]

# When a run's checkpoint reaches the disk (``save_fsync``): after the rename, in a thread, or before it.
FSYNC_MODES = ("background", "blocking")


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (the names created, renamed or removed in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file's data and size to the disk (through a new descriptor: fsync is per file, not per descriptor)."""
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
    (for the caller to remove once the new one is durable); ``None`` when there was none. A crash
    between the two renames leaves the old checkpoint at its hidden ``.old-`` name and the new one
    complete at its ``.tmp-`` name; the older checkpoints stay visible.
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


def mark_durable(directory: Path) -> None:
    """Record that every file of ``directory`` is on the disk (call it once their fsyncs returned).

    The marker itself is not fsynced: it tells a reader the fsyncs ended, nothing relies on it (a
    resume checks every file's hash whatever it says, and sets a torn checkpoint aside).
    """
    write_bytes(
        directory / DURABLE_MARKER,
        b'{"durable": "every other file of this checkpoint was fsynced before this one was written"}\n',
        fsync=False,
    )


def is_durable(directory: str | os.PathLike) -> bool:
    """Say whether ``directory``'s files were all fsynced (``mark_durable``): no machine crash can have torn them.

    >>> is_durable("no/such/checkpoint-1")
    False
    """
    return (Path(directory) / DURABLE_MARKER).is_file()


class NotDurableError(OSError):
    """A checkpoint renamed into place whose background fsync failed: visible, but maybe lost by a machine crash."""


def _make_durable(directory: Path, replaced: Path | None, then: Callable[[Path], Any] | None) -> None:
    """Fsync every file of ``directory``, the directory and its parent; then drop ``replaced`` and call ``then``."""
    point(f"durable:started:{directory.name}")
    for path in sorted(directory.iterdir()):
        if path.is_file() and not path.is_symlink():
            try:
                fsync_file(path)
            except OSError as e:
                raise NotDurableError(
                    e.errno,
                    f"checkpoint {directory} is written but not durable: the fsync of {path.name} failed "
                    f"({e.strerror or e}); a machine crash may lose or corrupt it, so the older checkpoints "
                    "were kept (no rotation); check the disk, then save again or resume from an older checkpoint",
                    str(path),
                ) from e
    for path in (directory, directory.parent):
        try:
            fsync_dir(path)
        except OSError as e:
            raise NotDurableError(
                e.errno,
                f"checkpoint {directory} is written but not durable: the fsync of directory {path} failed "
                f"({e.strerror or e}); the older checkpoints were kept (no rotation); check the disk",
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

    ``add(directory, then=fn)`` (after the rename) starts a thread that fsyncs every file of
    ``directory``, the directory and its parent, removes ``replaced`` (the checkpoint it took the
    place of), then calls ``then(directory)`` (rotation: an older checkpoint goes only once the newer
    one is durable). ``wait()`` returns the checkpoints made durable since the last wait, or raises
    the failure: ``NotDurableError`` naming the checkpoint (its ``then`` never ran, so it is not
    counted as durable). ``add`` waits for the previous checkpoint first.

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
                _make_durable(directory, replaced, then)
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
