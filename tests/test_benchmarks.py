"""The benchmark scripts run (in reduced form): they are code too, and the README quotes them.

Each runs in the test process (``run``): its ``main()`` under the ``sys.argv`` of ``python benchmarks/X.py ...``
from the repository root, so the suite pays no interpreter start and ``import torch, transformers`` a script; the
children a script starts itself (its fresh-process RSS measures, its gloo ranks) still start. The rest are in
``test_benchmarks_more.py``: two files of about equal time, one for each ``make test`` worker."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")


def run(capfd: pytest.CaptureFixture[str], script: str, *args: str) -> str:
    """Return what ``python script *args`` prints (its children's output too), run here from the repository root.

    The script is imported under its own name (its spawned ranks import it so) and its ``main()`` called with that
    ``sys.argv``; afterwards this process is as before: argv, path, cwd, environment, torch threads and RNGs, and
    no module from the script's folder stays imported.
    """
    path = ROOT / script
    saved = (sys.argv, sys.path[:], os.getcwd(), dict(os.environ), torch.get_num_threads())
    rngs = (torch.random.get_rng_state(), random.getstate())
    modules = set(sys.modules)
    assert path.stem not in sys.modules, f"{path.stem} is imported already: rename {script}"
    capfd.readouterr()
    sys.argv, sys.path[:0] = [str(path), *args], [str(path.parent)]
    os.chdir(ROOT)
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main()
    except SystemExit as exit:
        assert exit.code in (None, 0), f"{script} exited {exit.code}: {capfd.readouterr().err[-3000:]}"
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.chdir(saved[2])
        os.environ.clear()
        os.environ.update(saved[3])
        torch.set_num_threads(saved[4])
        torch.random.set_rng_state(rngs[0])
        random.setstate(rngs[1])
        for name in set(sys.modules) - modules:
            if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == path.parent:
                del sys.modules[name]
    return capfd.readouterr().out


def test_step_overhead_quick(capfd):
    out = run(capfd, "benchmarks/step_overhead.py", "--quick", "--no-rss")  # the RSS children: peak_memory's smoke test
    assert "| tiny |" in out


def test_gpu_script_runs_small_on_cpu(capfd):
    out = run(
        capfd,
        "benchmarks/gpu.py",
        "--steps",
        "2",
        "--variants",
        "eager",
        "trainfold",
        "--ensemble",
        "--ensemble-rounds",
        "1",
    )
    assert "| eager |" in out and "| trainfold |" in out
    assert "| ensemble vmap eager |" in out and "| 4 x eager loop (sdpa) |" in out
    assert "vLLM part skipped: needs vllm and 2 CUDA GPUs" in out  # part 4 says why it did not run here


def test_recompute_quick(capfd):
    out = run(capfd, "benchmarks/recompute.py", "--quick")
    assert "| every block |" in out


def test_llm_memory_quick(capfd):
    out = run(capfd, "benchmarks/llm_memory.py", "--quick")
    assert "| 32000 | 1024 |" in out and "| packed |" in out and "| padding_free |" in out


def test_sampler_scale_small(capfd):
    out = run(capfd, "benchmarks/sampler_scale.py", "--rows", "20000", "--rounds", "1")
    assert "| length column |" in out and "| GA 2, world 2 |" in out


def test_long_run_saves_quick(capfd):
    out = run(capfd, "benchmarks/long_run_saves.py", "--steps", "100", "--repeat", "1")
    assert "| 100 | before |" in out and "| 100 | after |" in out


def test_checkpoint_vs_safetensors_tiny(capfd):
    out = run(capfd, "benchmarks/checkpoint.py", "--mb", "4", "--rounds", "1")
    assert "| 4 MB |" in out


def test_listing_reads_each_sidecar_once_small(capfd):
    out = run(capfd, "benchmarks/listing.py", "--checkpoints", "5", "--rounds", "1")
    assert out.startswith("5 checkpoints: each sidecar read once ")


def test_rollout_publish_quick(capfd):
    out = run(capfd, "benchmarks/rollout_publish.py", "--quick")
    assert "| ProcessEngine.publish |" in out and "| dist.broadcast |" in out and "| ratio (median of rounds) |" in out


def test_grpo_async_quick(capfd):
    out = run(capfd, "benchmarks/grpo_async.py", "--quick")
    assert "| synchronous (max_staleness=0) |" in out and "| asynchronous (max_staleness=1) |" in out
    assert "| ratio (median of rounds) |" in out
