"""Run a test file's worker on local ranks under torchrun, in a session of its own (a hang kills its workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(
    script: str | os.PathLike, *args: object, nproc: int = 2, timeout: float = 240, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Return the finished ``torchrun --standalone --nproc_per_node=nproc script *args`` (1 thread a rank).

    The job runs from the repository root with ``src`` first on the path; past ``timeout`` seconds
    its whole session is killed and ``subprocess.TimeoutExpired`` raised.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(Path(script).resolve()), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def torchrun_ok(script: str | os.PathLike, *args: object, **options: object) -> subprocess.CompletedProcess:
    """``torchrun(...)`` that must exit 0 (the ranks' stderr tail is the failure message)."""
    done = torchrun(script, *args, **options)
    assert done.returncode == 0, done.stderr[-4000:]
    return done
