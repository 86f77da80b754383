"""Let gloo's worker threads go idle before the interpreter finalizes (a torch race that aborts a finished rank).

Seen under torchrun with gloo, 1 run in 5 on 2 busy cores, after every result was written:
``terminate called without an active exception`` and exit -6. A gdb backtrace shows why. Once
DTensors have run, torch's DTensor caches keep the mesh and its process group alive past
``destroy_process_group`` (gloo's ``shutdown`` does nothing), so its ``pt_gloo_runloop`` threads
live into ``Py_FinalizeEx``. The last collective's ``wait()`` returns to Python *before* the
runloop thread drops its own reference to the work. When that thread is the last owner, it
decrefs the Python objects of the work's tensors. That needs the GIL, and during finalization
CPython ends a thread that asks for the GIL with ``pthread_exit``, whose forced unwind through
a ``noexcept`` frame calls ``std::terminate``.

``quiesce()`` runs at exit (registered once on import, so after the atexit handlers registered
later, such as the one that destroys the group): it releases the GIL in 5 ms naps until every
thread named ``pt_gloo*`` is asleep and has used no CPU since the previous look. A runloop
thread waiting for the GIL gets it during a nap and finishes. It gives up after ``timeout``
seconds (never hangs an exit). Where there are no such threads it returns at once.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["gloo_threads", "quiesce"]

_PREFIX = "pt_gloo"
_TASKS = Path("/proc/self/task")


def gloo_threads() -> dict[int, tuple[str, int]]:
    """Return ``{thread id: (state letter, CPU ticks used)}`` of this process's gloo worker threads (Linux).

    >>> isinstance(gloo_threads(), dict)
    True
    """
    out: dict[int, tuple[str, int]] = {}
    if not _TASKS.is_dir():
        return out
    for task in _TASKS.iterdir():
        try:
            if not (task / "comm").read_text().startswith(_PREFIX):
                continue
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ..., utime, stime
        out[int(task.name)] = (fields[0], int(fields[11]) + int(fields[12]))
    return out


def quiesce(
    timeout: float = 2.0,
    nap: float = 0.005,
    threads: Callable[[], Mapping[int, tuple[str, int]]] = gloo_threads,
) -> bool:
    """Nap (the GIL released) until the gloo threads are asleep and idle across a nap; return whether they are.

    >>> quiesce(threads=dict)  # no gloo threads: at once
    True
    """
    deadline = time.monotonic() + timeout
    before = threads()
    if not before:
        return True
    while time.monotonic() < deadline:
        time.sleep(nap)
        now = threads()
        if all(state == "S" and before.get(tid, (None, -1))[1] == ticks for tid, (state, ticks) in now.items()):
            return True
        before = now
    return False


atexit.register(quiesce)
