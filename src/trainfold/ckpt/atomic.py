"""Atomic file-system writes: fsync a file or a directory, swap a directory into place with ``os.replace``."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from trainfold.ckpt.faults import point

__all__ = ["fsync_dir", "replace_dir"]


def fsync_dir(path: Path) -> None:
    """Flush a file, or a directory's entries, to the disk (through a new descriptor: fsync is per file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # os.fsync's error names no file
        raise OSError(e.errno, f"fsync failed ({e.strerror}); check the disk, then save again", str(path)) from e
    finally:
        os.close(fd)


def replace_dir(tmp: Path, directory: Path) -> None:
    """Put the fsynced ``tmp`` at ``directory`` by ``os.replace``, remove the one it replaced, fsync the parent.

    An existing ``directory`` is moved aside first: a crash between the two renames leaves the old
    checkpoint at its ``.old-`` name, which the next run puts back (``run_lock``).
    """
    old = directory.parent / f".{directory.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    if directory.exists():
        os.replace(directory, old)
        point("replace:moved-aside")
    os.replace(tmp, directory)
    point("replace:renamed")
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
        point("replace:removed")
    fsync_dir(directory.parent)
