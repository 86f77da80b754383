"""Step time of trainfold's compiled step vs a hand-written eager loop, interleaved in one process.

The eager loop is ``model(**b).loss.backward()``, ``clip_grad_norm_``, ``AdamW(fused=True)``,
``zero_grad``. trainfold runs ``make_step(..., compile=True)`` (and the eager ``make_step`` for
reference) with ``chain(clip_by_global_norm, adamw)`` on the same batches, from the same weights.
Each ratio is the median over rounds of (variant's median step / eager loop's median step in the
same round); rounds rotate the order of the variants.

    python benchmarks/compiled_step.py                 # tiny Llama, default threads
    python benchmarks/compiled_step.py --threads 1     # less sensitive to other processes
    python benchmarks/compiled_step.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.core.losses import causal_lm

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 172,
    "vocab_size": 256,
}
SEQ, BATCH = 128, 8


def build(attn: str = "sdpa", seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """Return the tiny Llama of the issue, randomly initialised from ``seed``, on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **TINY,
        num_key_value_heads=TINY["num_attention_heads"],
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device)


def make_batches(n: int, seed: int = 1, device: str = "cpu") -> list[dict]:
    """Return ``n`` batches of random token ids with ``labels = input_ids``, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=g).to(device) for _ in range(n)]
    return [{"input_ids": x, "labels": x} for x in ids]


def eager_runner(model):
    """Return ``run(batch)`` for the hand-written eager loop (on a copy of ``model``), and a way to read its params."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)

    def run(batch):
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run, lambda: {k: v.detach() for k, v in model.named_parameters()}


def trainfold_runner(model, compile: bool = False):
    """Return ``run(batch)`` for trainfold's step folded over batches, and its params.

    Pure: ``model`` is not touched.
    """
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01, mask=None, fused=True))
    step = make_step(model, causal_lm, opt, compile=compile)
    box = [init_state(model, opt)]

    def run(batch):
        box[0] = step(box[0], [batch])

    return run, lambda: box[0].params


def timed(run, batches, n: int, start: int = 0) -> list[float]:
    """Return the times of ``n`` calls of ``run`` over ``batches``, cycling from ``start``."""
    out = []
    for i in range(n):
        t = time.perf_counter()
        run(batches[(start + i) % len(batches)])
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--per-round", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, per = (2, 2) if args.quick else (args.rounds, args.per_round)
    model, batches = build(), make_batches(8)
    runners = {
        "eager loop": eager_runner(model),
        "trainfold eager": trainfold_runner(model, False),
        "trainfold compiled": trainfold_runner(model, True),
    }
    t0 = time.perf_counter()
    runners["trainfold compiled"][0](batches[0])  # compiles
    compile_s = time.perf_counter() - t0
    for key, (run, _) in runners.items():  # warm-up to the same 3 steps each (the parity check below)
        timed(run, batches, 3 if key != "trainfold compiled" else 2, start=0 if key != "trainfold compiled" else 1)
    ref = runners["eager loop"][1]()
    drift = {
        k: max((ref[n] - p[n]).abs().max().item() for n in ref) for k, (_, get) in runners.items() for p in [get()]
    }
    times: dict[str, list[float]] = {k: [] for k in runners}
    ratios: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        med = {}
        for key in order:
            ts = timed(runners[key][0], batches, per, start=r * per)
            times[key] += ts
            med[key] = statistics.median(ts)
        for key in names:
            ratios[key].append(med[key] / med["eager loop"])
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, tiny Llama "
        f"({sum(p.numel() for p in model.parameters()) / 1e3:.0f}k params, batch {BATCH}x{SEQ}), "
        f"{rounds} rounds x {per} steps; first compiled call (compile) {compile_s:.1f} s"
    )
    print("| variant | median step ms | ratio to eager loop | max param diff after 3 steps |")
    print("|---|---|---|---|")
    for key in names:
        print(
            f"| {key} | {1e3 * statistics.median(times[key]):.1f} | {statistics.median(ratios[key]):.3f} | "
            f"{drift[key]:.1e} |"
        )


if __name__ == "__main__":
    main()
