"""Shared by the resume tests and their fresh processes: a tiny model, ragged rows, a keyed collator
(test_train.py), and one fold with dropout, a schedule and accumulation (test_checkpoint.py, test_preempt.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import init_state
from trainfold.data import keyed, pad_collate
from trainfold.optim import adamw
from trainfold.step import make_step


def model():
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_len=24, dropout=0.1))


def rows(n=22):
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        ids = torch.randint(0, 40, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids), "note": i})  # "note" is not a model input
    return out


_pad = pad_collate()


def _mask_some(items, keys):
    batch = _pad(items)
    for row, key in enumerate(keys):  # per-sample randomness from (seed, epoch, index)
        g = torch.Generator().manual_seed(key)
        drop = torch.rand(batch["labels"].shape[1], generator=g) < 0.2
        batch["labels"][row, drop] = -100
    return batch


collate = keyed(_mask_some)


def fold_run(n_steps):
    """Return ``(model, step, state, batches)``: TinyLM with dropout, AdamW on a schedule, accumulation 2."""
    torch.manual_seed(0)
    net = TinyLM(TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=16, dropout=0.1))
    opt = adamw(lambda step: 1e-2 / (1 + step), weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [
        [{"input_ids": (ids := torch.randint(0, 32, (3, 12), generator=g)), "labels": ids} for _ in range(2)]
        for _ in range(n_steps)
    ]
    return net, make_step(net, causal_lm, opt), init_state(net, opt, seed=7), batches


def endless_cli_config(folder: Path, output_dir: Path) -> Path:
    """Write a CLI config that trains until preempted (JIT checkpoint on, a jsonl line per step); return its path."""
    config = folder / "run.toml"
    config.write_text(
        textwrap.dedent(f"""
        [model]
        type = "tinylm"
        config = {{ d_model = 16, n_layers = 1, n_heads = 2, max_len = 32 }}
        [data]
        train = "stdlib"
        seq_len = 32
        max_bytes = 40000
        [args]
        output_dir = "{output_dir}"
        max_steps = 100000
        per_device_train_batch_size = 4
        save_strategy = "no"
        enable_jit_checkpoint = true
        disable_tqdm = true
        logging_steps = 1
        report_to = ["jsonl"]
    """)
    )
    return config


class ListDataset(torch.utils.data.Dataset):
    """A list of rows as the map-style dataset ``transformers.Trainer`` wants."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def sigterm_rank_one_of_cli_ranks(config: Path, out: Path, world: int = 2) -> list[tuple[str, str, int]]:
    """Run ``python -m trainfold.cli train --config`` as ``world`` ranks (torchrun's env), SIGTERM rank 1 only.

    Waits until the run has logged 3 entries, signals rank 1, and returns each rank's
    ``(stdout, stderr, returncode)``; a rank that has not exited by then is killed.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    procs = []
    for rank in range(world):  # what torchrun sets for each worker
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(root / "src"),
        }
        command = [sys.executable, "-m", "trainfold.cli", "train", "--config", str(config)]
        procs.append(
            subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        log = out / "log.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
            assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)  # only rank 1
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(stdout, stderr, p.returncode) for p, (stdout, stderr) in zip(procs, results)]
