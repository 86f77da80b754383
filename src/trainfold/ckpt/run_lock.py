"""The output directory's lock (one writing run at a time, ``filelock``) and the removal of dead writers' leftovers."""

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

from trainfold.ckpt.listing import is_complete
from trainfold.ckpt.run_identity import RUN_FILE
from trainfold.ckpt.sidecar import SIDECAR_FILE, read_metadata, step_in_name
from trainfold.ckpt.writer import disk_full, is_disk_full

__all__ = ["LOCK_FILE", "lock", "read_record", "remove_leftovers"]

LOCK_FILE = "trainfold.lock"

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
        pass
    return True


def read_record(path: Path) -> dict[str, Any]:
    """Return the JSON object in the file ``path`` (the lock holder's, the run file); ``{}`` if there is none."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(path.read_text())
        return record if isinstance(record, dict) else {}
    return {}


@contextlib.contextmanager
def lock(output_dir: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on ``output_dir`` while the block runs (a dead holder's is taken over, said on stderr).

    A second holder is refused with ``RuntimeError`` naming the holder's pid and host (``trainfold.lock.json``).
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    held, holder = filelock.FileLock(root / LOCK_FILE, mode=0o644, is_singleton=False), root / f"{LOCK_FILE}.json"
    try:
        held.acquire(timeout=0)
    except filelock.Timeout:
        record = read_record(holder)
        raise RuntimeError(
            f"another trainfold run is writing to this output_dir (pid {record.get('pid', '?')} on host "
            f"{record.get('host', '?')}, lock {root / LOCK_FILE}); wait for it to finish, or give this run another "
            "output_dir"
        ) from None
    try:
        previous = read_record(holder)  # left by a holder that died (one that ended removed it)
        if previous and previous.get("pid") != os.getpid():
            print(
                f"trainfold: took over the lock of {root} left by pid {previous.get('pid')} on host "
                f"{previous.get('host')} (no longer running)",
                file=sys.stderr,
            )
        _write_record(holder)
        yield
        holder.unlink(missing_ok=True)
    finally:
        held.release()


def _write_record(holder: Path) -> None:
    """Write the lock holder's record (pid, host, time); a full disk raises ``OSError(ENOSPC)`` naming the file,
    the bytes and the intact checkpoint, as a save does, and leaves no partial record."""
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    try:
        holder.write_text(record)
    except OSError as e:
        holder.unlink(missing_ok=True)
        if not is_disk_full(e):
            raise
        raise disk_full(e, holder, f"the lock record {holder} could not be written", len(record)) from e


def remove_leftovers(output_dir: str | os.PathLike) -> list[Path]:
    """Remove the ``.tmp-*``, ``.old-*``, ``.deleting-*`` checkpoint directories and files of dead writers.

    An ``.old-*`` checkpoint whose name is free (a replace killed between its renames) is put back
    instead. A leftover named with a live pid (or this one's) is kept. Call it holding ``lock(output_dir)``;
    returns what it removed, said in one line on stderr.
    """
    root, gone = Path(output_dir), []
    for path in sorted([*root.glob(".*"), *root.glob("checkpoint-*/.*")]):  # in the dir, or in its checkpoints
        m = _LEFTOVER.match(path.name)
        if m is None or path.is_symlink() or path.parent.is_symlink():
            continue
        target, pid = root / m.group(1), int(m.group(3) or 0)
        if m.group(2) == "old" and not target.exists() and is_complete(path):
            if read_metadata(path)["step"] == step_in_name(target):  # a replace cut short: put it back
                os.replace(path, target)
                print(f"trainfold: restored {target} (a replace of it was cut short)", file=sys.stderr)
                continue
        if not pid or (pid != os.getpid() and not _alive(pid)):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            gone.append(path)
    if gone:
        names = ", ".join(p.name for p in gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        print(f"trainfold: removed {len(gone)} leftover(s) of interrupted writes in {root}: {names}", file=sys.stderr)
    return gone
