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

# a dead writer's checkpoint directory (a save, a replace, a rotation) or file rewrite (mark_jit, the run file)
_LEFTOVER = re.compile(
    rf"^\.(checkpoint-\d+|{re.escape(SIDECAR_FILE)}|{re.escape(RUN_FILE)})\.(tmp|old|deleting)"
    r"-(?:(\d+)(?:-[0-9a-f]+)?|[0-9a-f]+)$"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
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


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return sum(p.stat().st_size for p in [path, *path.rglob("*")] if p.is_file() and not p.is_symlink())
    return 0


def _restorable(old: Path, target: Path) -> bool:
    """Say whether ``old`` is a complete checkpoint of the step ``target`` names, and ``target`` is free."""
    if target.exists() or (old / INCOMPLETE_MARKER).exists():
        return False
    try:
        return read_metadata(old)["step"] == int(target.name.removeprefix("checkpoint-"))
    except (OSError, ValueError):
        return False


def remove_leftovers(output_dir: str | os.PathLike, *, quiet: bool = False) -> list[Path]:
    """Remove the ``.tmp-*``, ``.old-*``, ``.deleting-*`` checkpoint directories and files of dead writers.

    An ``.old-*`` directory whose checkpoint name is free (a replace killed between its renames,
    ``atomic.replace_dir``) is renamed back instead. Call it holding ``lock(output_dir)``. A leftover
    whose name carries the pid of a live process (or this one's) is left alone. Returns what it removed,
    and says so in one line on stderr.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    places = [root, *(d for d in sorted(root.glob("checkpoint-*")) if d.is_dir() and not d.is_symlink())]
    gone, freed = [], 0
    for path in (p for d in places for p in sorted(d.iterdir())):
        m = _LEFTOVER.match(path.name)
        if m is None or path.is_symlink():
            continue
        target, pid = root / m.group(1), int(m.group(3) or 0)
        if m.group(2) == "old" and _restorable(path, target):
            os.replace(path, target)  # a replace cut short between its two renames: put it back
            print(f"trainfold: restored {target} (a replace of it was cut short)", file=sys.stderr)
        elif not pid or (pid != os.getpid() and not _alive(pid)):
            freed += _size(path)
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
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
