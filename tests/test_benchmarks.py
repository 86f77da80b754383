"""The benchmark scripts run (in reduced form): they are code too, and the README quotes them.

The rest are in ``test_benchmarks_more.py``: two files of about equal time, one for each ``make test`` worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_step_overhead_quick():
    out = run("benchmarks/step_overhead.py", "--quick", "--no-rss")  # the RSS children: peak_memory's smoke test
    assert "| tiny |" in out


def test_gpu_script_runs_small_on_cpu():
    out = run(
        "benchmarks/gpu.py", "--steps", "2", "--variants", "eager", "trainfold", "--ensemble", "--ensemble-rounds", "1"
    )
    assert "| eager |" in out and "| trainfold |" in out
    assert "| ensemble vmap eager |" in out and "| 4 x eager loop (sdpa) |" in out


def test_recompute_quick():
    out = run("benchmarks/recompute.py", "--quick")
    assert "| every block |" in out


def test_llm_memory_quick():
    out = run("benchmarks/llm_memory.py", "--quick")
    assert "| 32000 | 1024 |" in out and "| packed |" in out and "| padding_free |" in out


def test_sampler_scale_small():
    out = run("benchmarks/sampler_scale.py", "--rows", "20000", "--rounds", "1")
    assert "| length column |" in out and "| GA 2, world 2 |" in out


def test_long_run_saves_quick():
    out = run("benchmarks/long_run_saves.py", "--steps", "100", "--repeat", "1")
    assert "| 100 | before |" in out and "| 100 | after |" in out


def test_checkpoint_vs_safetensors_tiny():
    out = run("benchmarks/checkpoint.py", "--mb", "4", "--rounds", "1")
    assert "| 4 MB |" in out


def test_listing_reads_each_sidecar_once_small():
    out = run("benchmarks/listing.py", "--checkpoints", "5", "--rounds", "1")
    assert out.startswith("5 checkpoints: each sidecar read once ")


def test_rollout_publish_quick():
    out = run("benchmarks/rollout_publish.py", "--quick")
    assert "| ProcessEngine.publish |" in out and "| dist.broadcast |" in out and "| ratio (median of rounds) |" in out
