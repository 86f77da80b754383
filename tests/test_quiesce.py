"""At exit, gloo's worker threads are let go idle before the interpreter finalizes (``distributed.quiesce``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainfold.distributed.quiesce import quiesce

ROOT = Path(__file__).resolve().parents[1]


def _looks(*snapshots):
    """A ``threads`` reader that returns the given snapshots in turn (then the last one forever)."""
    seen = list(snapshots)

    def threads():
        return seen.pop(0) if len(seen) > 1 else seen[0]

    return threads


def test_it_waits_while_a_thread_runs_or_still_uses_cpu_and_returns_once_it_rests():
    reads = _looks({7: ("R", 5)}, {7: ("S", 6)}, {7: ("S", 9)}, {7: ("S", 9)})
    assert quiesce(nap=0.001, threads=reads) is True
    assert reads() == {7: ("S", 9)}  # every snapshot was looked at


def test_it_never_holds_an_exit_past_its_timeout():
    busy = _looks({7: ("R", 1)})
    assert quiesce(timeout=0.05, nap=0.001, threads=busy) is False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread states come from Linux /proc")
def test_it_sees_a_live_gloo_group_s_threads_and_the_job_exits_cleanly(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from trainfold.distributed.quiesce import gloo_threads, quiesce
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        t = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])  # DTensor caches keep the group alive
        x = torch.ones(3)
        dist.all_reduce(x)
        del t, mesh
        dist.destroy_process_group()
        print(len(gloo_threads()), quiesce())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    alive, quiet = done.stdout.split()
    assert int(alive) >= 1 and quiet == "True"  # the group outlived destroy_process_group; its threads rest
