"""DPO step time: a frozen reference model run every step vs reference log-probs precomputed once.

Both variants run ``make_step`` with ``dpo_objective`` on the same TinyLM policy and the same
collated preference batches; one passes ``ref_params`` (a reference forward under ``no_grad``
in every step), the other reads ``ref_chosen_logps``/``ref_rejected_logps`` stored in the items
by ``precompute_ref_logps`` (whose one-time cost is reported too). Rounds alternate the two
variants; each cell is the median step time over all rounds.

    python benchmarks/dpo.py            # prints a markdown table
    python benchmarks/dpo.py --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainfold import adamw, init_state, make_step
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.dpo.objective import dpo_objective, precompute_ref_logps, preference_collate

SIZES = {
    "tiny": (TinyLMConfig(vocab_size=256, d_model=96, n_layers=3, n_heads=4, max_len=256), 8, 64),
    "small": (TinyLMConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=8, max_len=256), 8, 128),
}


def items_for(pairs: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=g).tolist()

    return [
        {"prompt_ids": ids(length // 2), "chosen_ids": ids(length // 2 - 1), "rejected_ids": ids(length // 2 - 1)}
        for _ in range(pairs)
    ]


def bench(name: str, steps: int, rounds: int) -> dict[str, float]:
    cfg, pairs, length = SIZES[name]
    torch.manual_seed(0)
    policy, ref = TinyLM(cfg), TinyLM(cfg)
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    collate = preference_collate(eos_token_id=2)
    items = items_for(pairs, length, seed=1)
    t0 = time.perf_counter()
    stored = precompute_ref_logps(ref, ref_params, items, collate, batch_size=pairs)
    precompute = time.perf_counter() - t0
    opt = adamw(1e-4)
    variants = {
        "reference model": (
            make_step(policy, optimizer=opt, objective=dpo_objective(0.1, ref_params=ref_params)),
            [collate(items)],
        ),
        "precomputed": (make_step(policy, optimizer=opt, objective=dpo_objective(0.1)), [collate(stored)]),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    states = {label: step(init_state(policy, opt), batch) for label, (step, batch) in variants.items()}  # warm-up
    for _ in range(rounds):
        for label, (step, batch) in variants.items():
            state = states[label]
            for _ in range(steps):
                t = time.perf_counter()
                state = step(state, batch)
                times[label].append(time.perf_counter() - t)
            states[label] = state
    out = {k: statistics.median(v) for k, v in times.items()}
    out["precompute (once)"] = precompute
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, rounds = (2, 2) if args.quick else (3, 10)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {steps} steps x {rounds} rounds per variant\n"
    )
    print(
        "| model | pairs x tokens | reference model (ms/step) | precomputed (ms/step) | speed-up "
        "| precompute once (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for name, (_, pairs, length) in SIZES.items():
        r = bench(name, steps, rounds)
        ref_ms, pre_ms = 1e3 * r["reference model"], 1e3 * r["precomputed"]
        print(
            f"| {name} | {pairs} x {length} | {ref_ms:.1f} | {pre_ms:.1f} | {ref_ms / pre_ms:.2f}x | "
            f"{1e3 * r['precompute (once)']:.1f} |"
        )


if __name__ == "__main__":
    main()
