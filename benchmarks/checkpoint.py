"""Time checkpoint save and load of a ~100 MB state against plain ``safetensors`` on the same tensors.

Run: ``.venv/bin/python benchmarks/checkpoint.py [--repeat 5] [--dir /tmp]``. The state is a TinyLM
(d_model 384, 4 layers) with AdamW moments, so params, ``mu`` and ``nu`` each hold a third. Rows:

- ``safetensors save_file`` / ``load_file``: the flattened record, one file, no fsync, no checks;
- ``... + fsync``: the same, then ``os.fsync`` of the file (what durability costs by itself);
- ``trainfold save``: ``state.safetensors`` + ``model.safetensors`` (the weights again, for
  ``from_pretrained``) + sidecar, CRC-32 of each file, fsync of files and directories, rename;
- ``trainfold save (save_only_model)``: the weights file alone, with the same guarantees;
- ``trainfold load``: size and CRC-32 check (a full read), ``load_file``, rebuild into the template;
- ``... + read all``: then touch every byte (``load_file`` may map pages lazily).

The CRC-32 pass (reading each file back once) is most of the difference on save; it is what
lets ``load`` refuse a silently corrupted file, naming it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import safetensors.torch
import torch

from trainfold.checkpoint import load, save
from trainfold.models import TinyLM, TinyLMConfig
from trainfold.optim import adamw
from trainfold.state import init_state
from trainfold.tree import flatten


def median_time(fn: Callable[[], object], repeat: int, setup: Callable[[], object] = lambda: None) -> float:
    """Return the median wall time of ``fn()`` over ``repeat`` runs, each after ``setup()``."""
    times = []
    for _ in range(repeat):
        setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_all(tensors: dict[str, torch.Tensor]) -> float:
    """Touch every 4 KiB page (``load_file`` may map the file lazily, reading pages on first use)."""
    return sum(int(t.reshape(-1).view(torch.uint8)[::4096].sum()) for t in tensors.values() if t.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=256, d_model=384, n_layers=4, n_heads=6, max_len=256))
    state = init_state(model, adamw(1e-3))
    # Make the moments non-zero, like a state after training.
    mu = {k: torch.randn_like(v) for k, v in state.opt_state.mu.items()}
    nu = {k: torch.rand_like(v) for k, v in state.opt_state.nu.items()}
    state = attrs.evolve(state, opt_state=attrs.evolve(state.opt_state, mu=mu, nu=nu))
    flat = flatten(state)
    mb = sum(t.numel() * t.element_size() for t in flat.values()) / 1e6

    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="trainfold-bench-"))
    plain, ckpt = root / "plain.safetensors", root / "checkpoint-1"
    try:

        def clean() -> None:
            plain.unlink(missing_ok=True)
            shutil.rmtree(ckpt, ignore_errors=True)

        def plain_fsync() -> None:
            safetensors.torch.save_file(flat, plain)
            with open(plain, "rb+") as f:
                os.fsync(f.fileno())

        rows = [
            ("safetensors save_file", median_time(lambda: safetensors.torch.save_file(flat, plain), args.repeat, clean)),
            ("safetensors save_file + fsync", median_time(plain_fsync, args.repeat, clean)),
            ("trainfold save", median_time(lambda: save(state, ckpt, model=model), args.repeat, clean)),
            ("trainfold save (save_only_model)",
             median_time(lambda: save(state, ckpt, model=model, save_only_model=True), args.repeat, clean)),
        ]
        save(state, ckpt, model=model)
        safetensors.torch.save_file(flat, plain)
        rows += [
            ("safetensors load_file", median_time(lambda: safetensors.torch.load_file(plain), args.repeat)),
            ("safetensors load_file + read all", median_time(lambda: read_all(safetensors.torch.load_file(plain)), args.repeat)),
            ("trainfold load", median_time(lambda: load(ckpt, like=state), args.repeat)),
            ("trainfold load + read all", median_time(lambda: read_all(flatten(load(ckpt, like=state))), args.repeat)),
        ]
        on_disk = sum(p.stat().st_size for p in ckpt.iterdir()) / 1e6
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"state: {len(flat)} tensors, {mb:.1f} MB; trainfold checkpoint on disk: {on_disk:.1f} MB; "
          f"median of {args.repeat}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"| {'operation':<34} | {'seconds':>8} | {'MB/s':>7} |")
    print(f"|{'-' * 36}|{'-' * 10}:|{'-' * 8}:|")
    for name, seconds in rows:
        print(f"| {name:<34} | {seconds:8.3f} | {mb / seconds:7.0f} |")


if __name__ == "__main__":
    main()
