"""Step time and peak memory of trainfold's step vs a hand-written in-place loop, from 0.1M to ~70M params.

The hand loop is ``model(**b, num_items_in_batch=n).loss.backward()`` per micro-batch (gradient
accumulation 2), ``clip_grad_norm_(1.0)``, ``AdamW(fused=True).step()``, ``zero_grad`` — all in
place. trainfold runs ``make_step`` with ``chain(clip_by_global_norm(1.0), adamw(...))`` on the same
batches, donating each state to the next step (as ``fit`` and ``train`` do) on weights lent by the
module (``init_state(..., copy=False)``). Llama models from config, AdamW + clipping, GA 2.

* step time: both run interleaved in one process from the same weights; ratio = median over rounds
  of (trainfold's median step / the hand loop's median step in the same round), on the wall clock and
  on the process's CPU clock (steadier on a shared machine: other processes do not count);
* peak RSS: each variant runs alone in a fresh subprocess (its ``VmHWM`` after its steps).

    python benchmarks/step_overhead.py --threads 1                  # every size, markdown table
    python benchmarks/step_overhead.py --quick                      # tiny only, few rounds (the test suite)
    python benchmarks/step_overhead.py --models tiny small --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.core.losses import causal_lm

# hidden, layers, heads, intermediate, vocab, seq; batch 4 rows per micro-batch, 2 micro-batches
CONFIGS = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=172, vocab_size=256, seq=128
    ),
    "small": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=688, vocab_size=2048, seq=128
    ),
    "mid-8k": dict(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1376, vocab_size=8192, seq=64
    ),
    "wide-128k": dict(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=688, vocab_size=128256, seq=32
    ),
}
ROWS, MICRO = 4, 2


def build(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(CONFIGS[name])
    seq = spec.pop("seq")
    cfg = LlamaConfig(
        **spec,
        num_key_value_heads=spec["num_attention_heads"],
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, cfg.vocab_size, (ROWS, seq), generator=g) for _ in range(2 * MICRO)]
    batches = [[{"input_ids": b, "labels": b} for b in ids[i : i + MICRO]] for i in range(0, len(ids), MICRO)]
    return model, batches


def hand_runner(model):
    """Return ``run(batch)`` for the hand-written in-place loop, and a way to read its params."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)

    def run(batch):
        n = sum(int((mb["labels"][..., 1:] != -100).sum()) for mb in batch)
        for mb in batch:
            model(**mb, num_items_in_batch=torch.tensor(n)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run, lambda: {k: v.detach() for k, v in model.named_parameters()}


def trainfold_runner(model):
    """Return ``run(batch)`` for trainfold's step, each state donated to the next, and a way to read its params."""
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01, mask=None, fused=True))
    step = make_step(model, causal_lm, opt)
    step = getattr(step, "donating", step)  # before donation existed: the pure step
    try:
        box = [init_state(model, opt, copy=False)]  # lent: one copy of the weights
    except TypeError:  # before copy= existed
        box = [init_state(model, opt)]

    def run(batch):
        box[0] = step(box[0], batch)

    return run, lambda: box[0].params


RUNNERS = {"hand": hand_runner, "trainfold": trainfold_runner}


def timed(run, batches, n: int, start: int = 0) -> list[tuple[float, float]]:
    """Return the (wall, CPU) times of ``n`` calls of ``run`` over ``batches``, cycling from ``start``."""
    out = []
    for i in range(n):
        t, c = time.perf_counter(), time.process_time()
        run(batches[(start + i) % len(batches)])
        out.append((time.perf_counter() - t, time.process_time() - c))
    return out


def measure(name: str, rounds: int, per_round: int) -> dict:
    model, batches = build(name)
    runners = {"hand": hand_runner(copy.deepcopy(model)), "trainfold": trainfold_runner(model)}
    for run, _ in runners.values():  # warm-up, also the parity check below
        timed(run, batches, 2)
    a, b = runners["hand"][1](), runners["trainfold"][1]()
    drift = max((a[k] - b[k]).abs().max().item() for k in a)
    ratios, times = {"wall": [], "cpu": []}, {k: [] for k in runners}
    for r in range(rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        med = {}
        for key in order:
            ts = timed(runners[key][0], batches, per_round)
            times[key] += ts
            med[key] = [statistics.median(t[j] for t in ts) for j in (0, 1)]
        for j, clock in enumerate(ratios):
            ratios[clock].append(med["trainfold"][j] / med["hand"][j])
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": CONFIGS[name]["vocab_size"],
        "hand_ms": 1e3 * statistics.median(t[1] for t in times["hand"]),
        "trainfold_ms": 1e3 * statistics.median(t[1] for t in times["trainfold"]),
        "ratio": statistics.median(ratios["cpu"]),
        "ratio_range": (min(ratios["cpu"]), max(ratios["cpu"])),
        "wall_ratio": statistics.median(ratios["wall"]),
        "max_param_diff_after_warmup": drift,
    }


def peak_rss_child(name: str, variant: str, steps: int) -> None:
    """(In a subprocess) build the model, run ``steps`` steps of one variant, print the peak RSS in MB."""
    model, batches = build(name)
    run, _ = RUNNERS[variant](model)
    del model
    timed(run, batches, steps)
    print(json.dumps({"peak_rss_mb": _peak_rss_mb()}))


def _peak_rss_mb() -> float:
    """This process's own high-water RSS: ``VmHWM`` (``ru_maxrss`` keeps the parent's peak across fork + exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss(name: str, variant: str, steps: int, threads: int | None) -> float:
    cmd = [sys.executable, __file__, "--rss-child", name, variant, "--steps", str(steps)]
    if threads:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, tiny model only")
    parser.add_argument("--models", nargs="*", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument("--rss-child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        peak_rss_child(*args.rss_child, args.steps)
        return
    names = args.models or (["tiny"] if args.quick else list(CONFIGS))
    rounds = {"tiny": 10, "small": 6, "mid-8k": 5, "wide-128k": 5}
    per = {"tiny": 5, "small": 3, "mid-8k": 2, "wide-128k": 2}
    if args.quick:
        rounds, per = dict.fromkeys(CONFIGS, 2), dict.fromkeys(CONFIGS, 2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {ROWS} x {MICRO} micro-batches")
    print(
        "| model | params | vocab | hand CPU ms | trainfold CPU ms | CPU ratio (rounds) | wall ratio "
        "| hand peak RSS MB | trainfold peak RSS MB | RSS ratio | max param diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        r = measure(name, rounds[name], per[name])
        rss = {} if args.no_rss else {v: peak_rss(name, v, 2 if args.quick else 3, args.threads) for v in RUNNERS}
        rss_cells = (
            f"{rss['hand']:.0f} | {rss['trainfold']:.0f} | {rss['trainfold'] / rss['hand']:.3f}" if rss else "- | - | -"
        )
        lo, hi = r["ratio_range"]
        print(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['vocab']} | {r['hand_ms']:.1f} | "
            f"{r['trainfold_ms']:.1f} | "
            f"{r['ratio']:.3f} ({lo:.2f}–{hi:.2f}) | {r['wall_ratio']:.3f} | {rss_cells} | "
            f"{r['max_param_diff_after_warmup']:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
