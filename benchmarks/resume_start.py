"""What the CRC check beside a resume's first steps costs those steps, against checking before them.

Run: ``.venv/bin/python benchmarks/resume_start.py [--size large] [--steps 3] [--repeat 5]``.

A ``LlamaForCausalLM`` from config (``benchmarks/checkpoint.py``'s sizes) with AdamW state is
saved once; then, in turn, ``--repeat`` times each (the files in the page cache):

- **inline**: ``load(path, like=template, donate=True)`` (every byte CRC-checked as it is read),
  then ``--steps`` steps: what a resume under torchrun does;
- **beside**: ``load(..., crc_checked=True, frozen_checked=True)``, ``verify_later(path)`` started,
  the same steps, then ``wait()`` (a run's first save waits there): what a one-process resume does.

Printed: the median time to the first step's start (the load), to the end of the steps, and until
the check ended; the steps' own time, so what the check running beside them costs them shows.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from checkpoint import SIZES, llama, trainfold_state  # benchmarks/checkpoint.py, beside this script

from trainfold.ckpt import load, save, verify, verify_later
from trainfold.core.losses import causal_lm
from trainfold.optim import adamw
from trainfold.step import make_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--same-priority", action="store_true", help="run the check at the steps' priority (not SCHED_IDLE)"
    )
    args = parser.parse_args()
    if args.same_priority:
        verify._yield_to_training = lambda: None
    warnings.filterwarnings("ignore")
    model = llama(args.size)
    path = save(trainfold_state(model), Path(tempfile.mkdtemp(prefix="trainfold-bench-")) / "saved", model=model)
    step = make_step(model, causal_lm, adamw(1e-3))
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = [{"input_ids": ids[:2], "labels": ids[:2]}, {"input_ids": ids[2:], "labels": ids[2:]}]

    def steps(state):
        for _ in range(args.steps):
            state = step(state, batch, donate=True)
        return state

    times: dict[str, list[tuple[float, float, float]]] = {"inline": [], "beside": []}
    steps(load(path, like=trainfold_state(model)))  # warm-up: the kernels, the page cache
    for _ in range(args.repeat):
        for how in times:
            template = trainfold_state(model)
            start = time.perf_counter()
            if how == "inline":
                state = load(path, like=template, donate=True)
                check = None
            else:
                state = load(path, like=template, donate=True, crc_checked=True, frozen_checked=True)
                check = verify_later(path)
            loaded = time.perf_counter()
            steps(state)
            stepped = time.perf_counter()
            if check is not None:
                check.wait()
            times[how].append((loaded - start, stepped - start, time.perf_counter() - start))
    print(
        f"{args.size}: {args.steps} steps of batch 2 x 2 x 64 tokens, median of {args.repeat}, "
        f"{torch.get_num_threads()} threads; seconds"
    )
    print("| resume | load (first step starts) | steps end | check ended | the steps alone |")
    print("|---|---:|---:|---:|---:|")
    for how, runs in times.items():
        load_s, end_s, checked_s = (statistics.median(r[i] for r in runs) for i in range(3))
        alone = statistics.median(r[1] - r[0] for r in runs)
        print(f"| {how} | {load_s:.3f} | {end_s:.3f} | {checked_s:.3f} | {alone:.3f} |")


if __name__ == "__main__":
    main()
