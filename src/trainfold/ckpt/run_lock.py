"""The output directory's lock (one writing run at a time, ``filelock``) and the removal of dead writers' leftovers.

The holder's pid and host are recorded in ``trainfold.lock.json``, so a second run is refused naming
them; the lock of a killed run is gone with it and simply taken over.
"""

from __future__ import annotations

import contextlib
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

import filelock

from trainfold.ckpt.run_identity import RUN_FILE
from trainfold.ckpt.sidecar import INCOMPLETE_MARKER, SIDECAR_FILE, read_metadata

__all__ = ["LOCK_FILE", "lock", "remove_leftovers"]

LOCK_FILE = "trainfold.lock"
_HOLDER_FILE = LOCK_FILE + ".json"

_LEFTOVER = re.compile(r"^\.(checkpoint-\d+)\.(tmp|old|deleting)-(?:(\d+)-)?[0-9a-f]+$")
_FILE_LEFTOVER = re.compile(rf"^\.(?:{re.escape(SIDECAR_FILE)}|{re.escape(RUN_FILE)})\.tmp-(\d+)(?:-[0-9a-f]+)?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


@contextlib.contextmanager
def lock(output_dir: str | os.PathLike) -> Iterator[dict[str, Any] | None]:
    """Hold an exclusive lock on ``output_dir`` while the block runs; yield the record of a holder that died.

    A second holder is refused with ``RuntimeError`` naming the holder's pid and host. The lock
    of a dead process is gone with it, and the yielded record is that process's (``None`` after a
    holder that ended normally).

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
    held, holder = filelock.FileLock(root / LOCK_FILE, mode=0o644, is_singleton=False), root / _HOLDER_FILE
    try:
        held.acquire(timeout=0)
    except filelock.Timeout:
        record = _read_holder(holder)
        raise RuntimeError(
            f"another trainfold run is writing to this output_dir (pid {record.get('pid', '?')} on host "
            f"{record.get('host', '?')}, lock {root / LOCK_FILE}); wait for it to finish, or give this run another "
            "output_dir"
        ) from None
    try:
        previous = _read_holder(holder) or None
        holder.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        yield previous
        holder.unlink(missing_ok=True)
    finally:
        held.release()


# -- leftovers ------------------------------------------------------------------------------------------


def _size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def _restorable(old: Path, target: Path) -> bool:
    """Say whether ``old`` is a complete checkpoint of the step ``target`` names, and ``target`` is free."""
    if target.exists() or (old / INCOMPLETE_MARKER).exists():
        return False
    try:
        return read_metadata(old)["step"] == int(target.name.removeprefix("checkpoint-"))
    except (OSError, ValueError):
        return False


def remove_leftovers(output_dir: str | os.PathLike, *, quiet: bool = False) -> list[Path]:
    """Remove the ``.tmp-*``, ``.old-*``, ``.deleting-*`` checkpoint directories of dead writers; return them.

    An ``.old-*`` directory whose checkpoint name is free (a replace killed between its renames,
    ``atomic.replace_dir``) is renamed back instead. Call it holding ``lock(output_dir)``. A directory
    whose name carries the pid of a live process other than this one is left alone. Prints one line
    to stderr when it removed anything.

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
        pid_text = m.group(3) if m.re is _LEFTOVER else m.group(1)
        pid = int(pid_text) if pid_text else None
        if m.re is _LEFTOVER and m.group(2) == "old" and _restorable(path, root / m.group(1)):
            os.replace(path, root / m.group(1))  # a replace cut short between its two renames: put it back
            print(f"trainfold: restored {root / m.group(1)} (a replace of it was cut short)", file=sys.stderr)
            continue
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
