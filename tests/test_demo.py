"""`make demo`'s job runs end to end (shortened): progress lines, held-out loss, a checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trainfold.ckpt import is_complete, latest_checkpoint
from trainfold.cli.demo import byte_chunks, stdlib_text

ROOT = Path(__file__).resolve().parents[1]


def test_demo_text_ships_with_python():
    text = stdlib_text(50_000)
    assert len(text) == 50_000 and "def " in text
    rows = byte_chunks(text, 64)
    assert len(rows) == 50_000 // 64 and all(len(r["input_ids"]) == 64 for r in rows)


def test_demo_command_trains_evaluates_and_checkpoints(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "trainfold.cli", "demo", "--max-steps", "16", "--output-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out loss" in done.stdout and "step    16/16" in done.stdout
    before, after = done.stdout.split("held-out loss: ")[1].split(" before training -> ")
    assert float(after.split()[0]) < float(before)
    latest = latest_checkpoint(out)
    assert latest is not None and is_complete(latest) and latest.name == "checkpoint-16"
    assert (out / "log.jsonl").exists() and str(out.resolve()) in done.stdout


def test_demo_args_scale_logging_evaluation_and_saves_with_the_run():
    from trainfold.cli.demo import demo_args

    short, long = demo_args("out", 8), demo_args("out", 1600, seed=3)
    assert (short.logging_steps, short.eval_steps, short.save_steps) == (1, 4, 4)
    assert (long.logging_steps, long.eval_steps, long.save_steps, long.seed) == (100, 800, 800, 3)
    assert long.reporters == ("jsonl",) and long.lr_scheduler_type == "cosine"
