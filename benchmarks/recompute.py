"""Activation checkpointing: activations kept for backward, and step time, with and without it.

A Llama-like model from config, one step of two micro-batches; "saved" counts the bytes autograd
stores for the backward pass (``saved_tensors_hooks``), the step time is the median of interleaved
runs in this process. Ratios are against the same step without checkpointing.

    python benchmarks/recompute.py              # small model
    python benchmarks/recompute.py --quick      # tiny model, few runs (the suite runs this)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainfold import adamw, init_state, make_step
from trainfold.core.losses import causal_lm
from trainfold.testing import saved_for_backward  # needs the test extra (hypothesis)

SIZES = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 172,
        "vocab_size": 256,
        "seq": 128,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "intermediate_size": 688,
        "vocab_size": 2048,
        "seq": 512,
    },
}


def build(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(SIZES[size])
    seq = spec.pop("seq")
    cfg = LlamaConfig(
        **spec, num_key_value_heads=spec["num_attention_heads"], max_position_embeddings=seq, use_cache=False
    )
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": (x := torch.randint(0, cfg.vocab_size, (4, seq), generator=g)), "labels": x} for _ in range(2)
    ]
    return LlamaForCausalLM(cfg), data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    size, rounds = ("tiny", 2) if ns.quick else ("small", 5)
    model, data = build(size)
    opt = adamw(1e-3)
    state = init_state(model, opt)
    variants = {"off": 0, "every block": 1, "every 2nd block": 2}
    steps = {name: make_step(model, causal_lm, opt, gradient_checkpointing=n) for name, n in variants.items()}
    saved = {name: saved_for_backward(lambda step=step: step(state, data))[1] for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(reversed(steps)):
            t = time.perf_counter()
            steps[name](state, data)
            times[name].append(time.perf_counter() - t)
    print(
        f"{size} Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), 2 micro-batches of "
        f"4x{SIZES[size]['seq']}, {torch.get_num_threads()} threads"
    )
    print("| checkpointing | saved for backward | ratio | step ms | ratio |")
    print("|---|---|---|---|---|")
    base_t = statistics.median(times["off"])
    for name in steps:
        t = statistics.median(times[name])
        print(
            f"| {name} | {saved[name] / 2**20:.1f} MiB | {saved[name] / saved['off']:.2f} "
            f"| {1e3 * t:.0f} | {t / base_t:.2f} |"
        )


if __name__ == "__main__":
    main()
