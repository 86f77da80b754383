"""Step time of a 4-member ensemble in one step (eager and compiled) vs 4 sequential eager steps.

Four tiny Llamas (different initial weights), each with its own batch. The baseline is four
hand-written eager loops (``backward``, ``clip_grad_norm_``, ``AdamW(fused=True)``) run one after
the other, with sdpa attention (fastest eager) and with eager attention (what the vmapped
ensemble runs: CPU sdpa has no vmap batching rule). trainfold runs ``make_ensemble_step`` with
``batching="vmap"`` eagerly and compiled, and with ``batching="unroll"`` compiled (sdpa
attention, all members in one graph). Rounds rotate the order; a speed-up is the median over
rounds of (baseline's median / variant's median in the same round).

    python benchmarks/ensemble.py                 # default threads
    python benchmarks/ensemble.py --threads 1
    python benchmarks/ensemble.py --quick         # a smoke run
    python benchmarks/ensemble.py --device cuda   # on a GPU (benchmarks/gpu.py runs this)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled_step import build, eager_runner, make_batches

from trainfold import adamw, chain, clip_by_global_norm
from trainfold.core.losses import causal_lm
from trainfold.step.ensemble import (
    init_ensemble_state,
    make_ensemble_step,
    split_ensemble,
    stack_batches,
)

K = 4


def sequential_runner(attn: str, device: str = "cpu"):
    """Return ``run(member_batches)``: K eager loops stepped one after another."""
    runs = [eager_runner(build(attn, seed=m, device=device)) for m in range(K)]

    def run(batches):
        for (r, _), b in zip(runs, batches):
            r(b)

    return run, lambda: [get() for _, get in runs]


def ensemble_runner(compile: bool, batching: str = "vmap", device: str = "cpu"):
    """Return ``run(member_batches)``: one ensemble step over all K members."""
    models = [build("eager" if batching == "vmap" else "sdpa", seed=m, device=device) for m in range(K)]
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01, mask=None, fused=True))
    step = make_ensemble_step(models[0], causal_lm, opt, batching=batching, compile=compile)
    box = [init_ensemble_state(models, opt)]

    def run(batches):
        box[0] = step(box[0], stack_batches([[b] for b in batches]))

    return run, lambda: [m.params for m in split_ensemble(box[0])]


def timed(run, groups, n: int, start: int) -> list[float]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out = []
    for i in range(n):
        sync()
        t = time.perf_counter()
        run(groups[(start + i) % len(groups)])
        sync()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eager-only", action="store_true", help="skip the compiled variants (a fast smoke run)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="There is a performance drop")
    rounds, per = (2, 1) if args.quick else (args.rounds, args.per_round)
    flat = make_batches(4 * K, device=args.device)
    groups = [flat[i * K : (i + 1) * K] for i in range(4)]
    dev = args.device
    runners = {
        "4 x eager loop (sdpa)": sequential_runner("sdpa", dev),
        "4 x eager loop (eager attn)": sequential_runner("eager", dev),
        "ensemble vmap eager": ensemble_runner(False, device=dev),
    }
    if not args.eager_only:
        runners["ensemble vmap compiled"] = ensemble_runner(True, device=dev)
        runners["ensemble unroll compiled"] = ensemble_runner(True, "unroll", device=dev)
    compiled = [k for k in runners if k.endswith("compiled")]
    compile_s = {}
    for key in compiled:
        t0 = time.perf_counter()
        runners[key][0](groups[0])
        compile_s[key] = time.perf_counter() - t0
    for key, (run, _) in runners.items():  # 2 warm-up steps each, on the same batches
        timed(run, groups, 1 if key in compiled else 2, start=1 if key in compiled else 0)
    ref = runners["4 x eager loop (eager attn)"][1]()
    drift = {}
    for key, (_, get) in runners.items():
        got = get()
        drift[key] = max((ref[m][n] - got[m][n]).abs().max().item() for m in range(K) for n in ref[m])
    names = list(runners)
    times: dict[str, list[float]] = {k: [] for k in names}
    speed: dict[str, dict[str, list[float]]] = {b: {k: [] for k in names} for b in names[:2]}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        med = {}
        for key in order:
            ts = timed(runners[key][0], groups, per, start=r * per)
            times[key] += ts
            med[key] = statistics.median(ts)
        for base in names[:2]:
            for key in names:
                speed[base][key].append(med[base] / med[key])
    print(
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, {K} tiny Llamas "
        f"(batch 8x128 each), {rounds} rounds x {per} steps; first call (compile): "
        + (", ".join(f"{k} {v:.0f} s" for k, v in compile_s.items()) or "none")
    )
    print(
        "| variant | median ms (all 4 members) | speed-up vs 4 x eager (sdpa) | vs 4 x eager (eager attn) "
        "| max param diff after 2 steps |"
    )
    print("|---|---|---|---|---|")
    for key in names:
        print(
            f"| {key} | {1e3 * statistics.median(times[key]):.1f} | {statistics.median(speed[names[0]][key]):.2f}x | "
            f"{statistics.median(speed[names[1]][key]):.2f}x | {drift[key]:.1e} |"
        )


if __name__ == "__main__":
    main()
