"""Checkpoint save and verified load against ``safetensors.torch`` + ``load_state_dict``, ABBA interleaved.

Run: ``.venv/bin/python benchmarks/checkpoint.py [--mb 200 1000] [--rounds 3] [--dir /tmp]``.

For each size, a stack of ``Linear(1024, 1024)`` layers holding that many MB of float32 weights
(SGD without momentum: the state is the weights and a few counters), and two ways to checkpoint it:

- **trainfold**: ``save(state, path, model=model)`` (the safetensors files, each hashed while it is
  written, the sidecar, every file and the directory fsynced, the atomic rename, the parent
  fsynced: what ``train`` does); the load a resume does: ``load(path, like=template)`` (every file's size and XXH3-64
  checked in one streaming pass, then ``safetensors.torch.load_file``) and ``lend(model, state)``
  (the tensors copied into the module's own);
- **HF**: what ``transformers.Trainer`` does with the weights: ``save_file(model.state_dict(), path)``
  (no fsync, no hash), and ``load_file(path)`` + ``model.load_state_dict(...)``.

Each pair is timed ABBA (trainfold, HF, HF, trainfold) ``--rounds`` times; the table gives the median
of each side and their ratio. The files are in the page cache (a load reads what was just saved).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainfold.ckpt import load, save
from trainfold.core.state import init_state, lend
from trainfold.optim import sgd


def model_of(mb: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(max(1, mb // 4))])


def abba(a: Callable[[], object], b: Callable[[], object], rounds: int, before: Callable[[], object]) -> tuple:
    """Return the median seconds of ``a`` and of ``b``, run in the order a b b a ``rounds`` times."""
    times: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(rounds):
        for name in "abba":
            before()
            t = time.perf_counter()
            (a if name == "a" else b)()
            times[name].append(time.perf_counter() - t)
    return statistics.median(times["a"]), statistics.median(times["b"])


def compare(mb: int, root: Path, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    model = model_of(mb)
    state = init_state(model, sgd(0.1))
    tf_dir, hf_file = root / "checkpoint-0", root / "hf" / "model.safetensors"
    hf_file.parent.mkdir(parents=True, exist_ok=True)

    def clean() -> None:
        shutil.rmtree(tf_dir, ignore_errors=True)
        hf_file.unlink(missing_ok=True)

    tf_save, hf_save = abba(
        lambda: save(state, tf_dir, model=model), lambda: save_file(model.state_dict(), hf_file), rounds, clean
    )
    save(state, tf_dir, model=model)
    save_file(model.state_dict(), hf_file)
    template = init_state(model, sgd(0.1), copy=False)  # lent: the module's own tensors, as a resume builds it

    def tf_load() -> None:
        lend(model, load(tf_dir, like=template))

    def hf_load() -> None:
        model.load_state_dict(load_file(hf_file))

    tf_read, hf_read = abba(tf_load, hf_load, rounds, lambda: None)
    bytes_ = sum(p.stat().st_size for p in tf_dir.iterdir())
    clean()
    saving = {"mb": bytes_ / 1e6, "tf_save": tf_save, "hf_save": hf_save}
    return saving, {"tf_load": tf_read, "hf_load": hf_read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", nargs="+", type=int, default=[200, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="trainfold-bench-"))
    print(f"ABBA x {args.rounds}, medians; torch {torch.__version__}, {torch.get_num_threads()} threads; seconds")
    print("| state | trainfold save (fsynced) | HF save_file | ratio | verified load | HF load | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    try:
        for mb in args.mb:
            s, r = compare(mb, root, args.rounds)
            print(
                f"| {s['mb']:.0f} MB | {s['tf_save']:.3f} | {s['hf_save']:.3f} | "
                f"{s['tf_save'] / s['hf_save']:.2f} | {r['tf_load']:.3f} | {r['hf_load']:.3f} | "
                f"{r['tf_load'] / r['hf_load']:.2f} |",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
