"""The benchmark scripts run (in reduced form): they are code too, and the README quotes them."""

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


def test_peak_memory_tiny():
    out = run(
        "benchmarks/peak_memory.py",
        "--models",
        "tiny",
        "--steps",
        "1",
        "--variants",
        "hf_trainer",
        "trainfold",
        "--phases",
    )
    assert "| tiny |" in out and "hf_trainer: start" in out and "trainfold: start" in out


def test_state_hash_quick():
    out = run("benchmarks/state_hash.py", "--quick")
    assert "| 0.1M |" in out


def test_lora_adapters_quick():
    out = run("benchmarks/lora_adapters.py", "--quick", "-k", "2", "--steps", "2")
    assert "| ensemble of 2 |" in out and "speed-up over 2 sequential steps" in out


def test_import_time_one_round():
    out = run("benchmarks/import_time.py", "--rounds", "1")
    assert "| import torch, trainfold |" in out and "| from trainfold import train |" in out


@pytest.mark.slow  # 2 jobs of 2 spawned processes (a tiny Llama, 3 steps each)
def test_fsdp_quick_compares_train_full_shard_with_a_hand_fully_shard_loop():
    out = run("benchmarks/fsdp.py", "--quick")
    rows = [line for line in out.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert len(rows) == 2 and all(len(line.split("|")) == 9 for line in rows)


def test_streaming_quick():
    pytest.importorskip("datasets")
    out = run("benchmarks/streaming.py", "--quick")
    assert "| files(), shuffled |" in out and "| datasets streaming, file order |" in out


def test_grpo_async_quick():
    out = run("benchmarks/grpo_async.py", "--quick")
    assert "| synchronous (max_staleness=0) |" in out and "| asynchronous (max_staleness=1) |" in out
    assert "| ratio (median of rounds) |" in out


def test_rollout_publish_quick():
    out = run("benchmarks/rollout_publish.py", "--quick")
    assert "| ProcessEngine.publish |" in out and "| dist.broadcast |" in out and "| ratio (median of rounds) |" in out
