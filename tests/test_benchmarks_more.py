"""The benchmark scripts run (in reduced form), continued from ``test_benchmarks.py`` (the two take about
equal time: ``make test`` runs them on its two workers at once)."""

from __future__ import annotations

import pytest
from test_benchmarks import run

pytest.importorskip("transformers")


def test_peak_memory_tiny(capfd):
    out = run(
        capfd,
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


def test_state_hash_quick(capfd):
    out = run(capfd, "benchmarks/state_hash.py", "--quick")
    assert "| 0.1M |" in out


def test_lora_adapters_quick(capfd):
    out = run(capfd, "benchmarks/lora_adapters.py", "--quick", "-k", "2", "--steps", "2")
    assert "| ensemble of 2 |" in out and "speed-up over 2 sequential steps" in out


def test_import_time_one_round(capfd):
    out = run(capfd, "benchmarks/import_time.py", "--rounds", "1")
    assert "| import torch, trainfold |" in out and "| from trainfold import train |" in out


@pytest.mark.slow  # 2 jobs of 2 spawned processes (a tiny Llama, 3 steps each)
def test_fsdp_quick_compares_train_full_shard_with_a_hand_fully_shard_loop(capfd):
    out = run(capfd, "benchmarks/fsdp.py", "--quick")
    rows = [line for line in out.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert len(rows) == 2 and all(len(line.split("|")) == 9 for line in rows)


def test_streaming_quick(capfd):
    pytest.importorskip("datasets")
    out = run(capfd, "benchmarks/streaming.py", "--quick")
    assert "| files(), shuffled |" in out and "| datasets streaming, file order |" in out
