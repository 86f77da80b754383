"""Step time of trainfold's pure step vs a hand-written eager loop, interleaved in one process.

The eager loop is ``model(**b).loss.backward()``, ``clip_grad_norm_``, ``AdamW(fused=True)``,
``zero_grad``. trainfold runs ``make_step`` with ``chain(clip_by_global_norm, adamw)`` on the
same batches. Both start from the same weights; the ratio is the median over rounds of
(trainfold's median step / eager's median step in the same round).

    python benchmarks/step_overhead.py            # tiny and small, prints a markdown table
    python benchmarks/step_overhead.py --quick    # fewer rounds (used by the test suite)
    python benchmarks/step_overhead.py --threads 1  # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.losses import causal_lm

CONFIGS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=172, vocab_size=256, seq=128),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=688, vocab_size=2048, seq=256),
}


def build(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(CONFIGS[name])
    seq = spec.pop("seq")
    cfg = LlamaConfig(**spec, num_key_value_heads=spec["num_attention_heads"], max_position_embeddings=seq,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (8, seq), generator=g) for _ in range(4)]
    return model, [{"input_ids": b, "labels": b} for b in batches]


def eager_runner(model):
    """Return ``run(batch)`` for the hand-written eager loop, and a way to read its params."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)

    def run(batch):
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run, lambda: {k: v.detach() for k, v in model.named_parameters()}


def trainfold_runner(model, compile: bool = False):
    """Return ``run(batch)`` for trainfold's step folded over batches, and a way to read its params."""
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01, mask=None))
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


def measure(name: str, rounds: int, per_round: int) -> dict:
    model, batches = build(name)
    runners = {"eager": eager_runner(model), "trainfold": trainfold_runner(model)}
    for run, _ in runners.values():  # warm-up, also the parity check below
        timed(run, batches, 3)
    a, b = runners["eager"][1](), runners["trainfold"][1]()
    drift = max((a[k] - b[k]).abs().max().item() for k in a)
    ratios, times = [], {k: [] for k in runners}
    for r in range(rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        med = {}
        for key in order:
            ts = timed(runners[key][0], batches, per_round)
            times[key] += ts
            med[key] = statistics.median(ts)
        ratios.append(med["trainfold"] / med["eager"])
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "eager_ms": 1e3 * statistics.median(times["eager"]),
        "trainfold_ms": 1e3 * statistics.median(times["trainfold"]),
        "ratio": statistics.median(ratios),
        "max_param_diff_after_warmup": drift,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, tiny model only")
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.models or (["tiny"] if args.quick else ["tiny", "small"])
    rounds = {"tiny": 12, "small": 8} if not args.quick else {"tiny": 2, "small": 1}
    per = {"tiny": 5, "small": 3} if not args.quick else {"tiny": 2, "small": 1}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | params | eager ms | trainfold ms | ratio | max param diff after 3 steps |")
    print("|---|---|---|---|---|---|")
    for name in names:
        r = measure(name, rounds[name], per[name])
        print(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['eager_ms']:.1f} | {r['trainfold_ms']:.1f} | "
              f"{r['ratio']:.3f} | {r['max_param_diff_after_warmup']:.1e} |")


if __name__ == "__main__":
    main()
