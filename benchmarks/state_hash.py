"""What the per-step state hash (``observe.divergence.state_hash``) costs, as a fraction of a training step.

A TinyLM (byte vocabulary) trains with ``make_step`` + AdamW + clipping, donating each state as ``train``
does; each round times a block of steps without hashing and a block that also hashes every step's state
(the work ``hash_log`` adds per logged step: the hash, not the file line), interleaved so that load on the
machine falls on both. The cost is the median over rounds of (hashed block / plain block - 1). Goal: <= 2%.

    python benchmarks/state_hash.py                # TinyLM sizes, markdown table
    python benchmarks/state_hash.py --quick        # the smallest, few rounds (the test suite)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.observe.divergence import state_hash

SIZES = {
    "0.1M": dict(d_model=48, n_layers=2, n_heads=4),
    "0.4M": dict(d_model=96, n_layers=3, n_heads=4),
    "3M": dict(d_model=256, n_layers=4, n_heads=8),
}
ROWS, SEQ = 8, 128


def measure(size: str, rounds: int, steps: int, samples: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(max_len=SEQ, **SIZES[size]))
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
    step = make_step(model, causal_lm, opt)
    state = init_state(model, opt, copy=False)
    ids = torch.randint(0, 256, (ROWS, SEQ))
    batch = [{"input_ids": ids, "labels": ids}]
    for _ in range(3):  # warm up
        state = step(state, batch, donate=True)
    costs, plain_ms, hash_ms = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            state = step(state, batch, donate=True)
        t1 = time.perf_counter()
        spent = 0.0
        for _ in range(steps):
            state = step(state, batch, donate=True)
            h0 = time.perf_counter()
            state_hash(state, samples)
            spent += time.perf_counter() - h0
        t2 = time.perf_counter()
        costs.append((t2 - t1) / (t1 - t0) - 1)
        plain_ms.append((t1 - t0) / steps * 1e3)
        hash_ms.append(spent / steps * 1e3)
    params = sum(p.numel() for p in model.parameters())
    return {
        "params": params,
        "step_ms": statistics.median(plain_ms),
        "hash_ms": statistics.median(hash_ms),
        "hash_over_step": statistics.median(hash_ms) / statistics.median(plain_ms),
        "block_cost": statistics.median(costs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES))
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    sizes, rounds, steps = (["0.1M"], 2, 3) if ns.quick else (ns.sizes, 7, 10)
    print(f"state_hash(samples={ns.samples}) per step vs a TinyLM step ({ROWS}x{SEQ} tokens, AdamW + clipping, CPU)\n")
    print("| model | params | step (ms) | hash (ms) | hash / step | hashed block / plain block - 1 |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        r = measure(size, rounds, steps, ns.samples)
        print(
            f"| {size} | {r['params']:,} | {r['step_ms']:.1f} | {r['hash_ms']:.3f} | "
            f"{100 * r['hash_over_step']:.2f}% | {100 * r['block_cost']:+.1f}% |"
        )


if __name__ == "__main__":
    main()
