"""Durable, atomic file-system writes: write and fsync a file or a directory, swap a directory into place."""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trainfold.ckpt.faults import point

__all__ = ["fsync_dir", "fsync_file", "write_bytes", "replace_dir", "BackgroundSync"]


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


class BackgroundSync:
    """Files fsynced in background threads while the caller writes the next; ``wait`` returns once all are durable.

    Used as a context manager: leaving it (normally or by an exception) waits for every fsync, so
    no thread outlives the save; ``wait`` re-raises the first fsync's error.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "f"
    >>> _ = path.write_bytes(b"x")
    >>> with BackgroundSync() as sync:
    ...     sync.add(path)
    ...     sync.wait()
    1
    """

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="trainfold-fsync")
        self._pending: list[Future[None]] = []

    def add(self, path: Path) -> None:
        """Start fsyncing ``path``."""
        self._pending.append(self._pool.submit(fsync_file, path))

    def wait(self) -> int:
        """Return the number of files fsynced once every one added is on the disk."""
        for future in self._pending:
            future.result()
        return len(self._pending)

    def __enter__(self) -> BackgroundSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where it is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(tmp: Path, directory: Path) -> None:
    """Put ``tmp`` at ``directory``; an existing ``directory`` stays visible until the new one is there."""
    if not directory.exists():
        os.rename(tmp, directory)
        point("replace:renamed")
        return
    if _exchange(tmp, directory):  # the old checkpoint is now at tmp's hidden name
        point("replace:exchanged")
        shutil.rmtree(tmp, ignore_errors=True)
        point("replace:removed")
        return
    old = directory.parent / f".{directory.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(directory, old)  # no atomic swap here: a crash before the next rename leaves only .old-
    point("replace:moved-aside")
    os.rename(tmp, directory)
    point("replace:renamed")
    shutil.rmtree(old, ignore_errors=True)
    point("replace:removed")
