"""The output directory's lock (one writing run at a time) and the removal of dead writers' leftovers.

``lock`` takes an exclusive ``flock`` on ``output_dir/trainfold.lock`` for as long as the run
writes; a second run is refused with the holder's pid and host. The kernel drops the lock of a dead
process, so a killed run's lock is simply taken over. The run holding the lock removes the
``.tmp-*``, ``.old-*`` and ``.deleting-*`` directories of dead writers (``remove_leftovers``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainfold.ckpt.run_identity import RUN_FILE
from trainfold.ckpt.sidecar import SIDECAR_FILE

__all__ = ["LOCK_FILE", "lock", "remove_leftovers"]

LOCK_FILE = "trainfold.lock"

_LEFTOVER = re.compile(r"^\.checkpoint-\d+\.(tmp|old|deleting)-(?:(\d+)-)?[0-9a-f]+$")
_FILE_LEFTOVER = re.compile(rf"^\.(?:{re.escape(SIDECAR_FILE)}|{re.escape(RUN_FILE)})\.tmp-(\d+)(?:-[0-9a-f]+)?$")


def _holder_text() -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def lock(output_dir: str | os.PathLike) -> Iterator[dict[str, Any] | None]:
    """Hold an exclusive lock on ``output_dir`` while the block runs; yield the previous holder's record.

    A second holder is refused with ``RuntimeError`` naming the holder's pid and host. The lock
    of a dead process is gone with it (``flock``), and the yielded record is that process's.

    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> with lock(out):
    ...     try:
    ...         with lock(out):
    ...             pass
    ...     except RuntimeError as e:
    ...         print(str(e).split(" (")[0])
    ...
    another trainfold run is writing to this output_dir
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            raise RuntimeError(
                f"another trainfold run is writing to this output_dir (pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')}, lock {path}); wait for it to finish, or give this run another "
                "output_dir"
            ) from None
        previous = _read_holder(fd) or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_text().encode(), 0)
        os.fsync(fd)
        yield previous
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


# -- leftovers ------------------------------------------------------------------------------------------


def _size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def remove_leftovers(output_dir: str | os.PathLike, *, quiet: bool = False) -> list[Path]:
    """Remove the ``.tmp-*``, ``.old-*``, ``.deleting-*`` checkpoint directories of dead writers; return them.

    Call it holding ``lock(output_dir)``. A directory whose name carries the pid of a live process
    other than this one is left alone. Prints one line to stderr when it removed anything.

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> (out / ".checkpoint-4.tmp-999999999-ab12").mkdir()
    >>> [p.name for p in remove_leftovers(out, quiet=True)], list(out.iterdir())
    (['.checkpoint-4.tmp-999999999-ab12'], [])
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    gone, freed = [], 0
    candidates = [(p, _LEFTOVER.match(p.name)) for p in sorted(root.iterdir())]
    for sub in sorted(root.glob("checkpoint-*")) + [root]:  # a sidecar or run file rewrite cut short
        if sub.is_dir() and not sub.is_symlink():
            candidates += [(p, _FILE_LEFTOVER.match(p.name)) for p in sorted(sub.iterdir())]
    for path, m in candidates:
        if m is None or path.is_symlink():
            continue
        pid_text = m.group(2) if m.re is _LEFTOVER else m.group(1)
        pid = int(pid_text) if pid_text else None
        if pid is not None and (pid == os.getpid() or _alive(pid)):
            continue
        freed += _size(path) if path.is_dir() else path.stat().st_size
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        gone.append(path)
    if gone and not quiet:
        names = ", ".join(p.name for p in gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        print(
            f"trainfold: removed {len(gone)} leftover(s) of interrupted checkpoint writes in {root} "
            f"({freed / 1e6:.1f} MB): {names}",
            file=sys.stderr,
            flush=True,
        )
    return gone
