"""Padding and per-rank balance of the samplers, on skewed (lognormal) and uniform lengths.

Run: ``python benchmarks/padding.py``. Prints three tables:

1. the padded-token fraction of an epoch for ``random``, ``group_by_length`` and
   ``batch_rebalance`` (padding = tokens computed on pad positions / all tokens computed);
2. for each optimizer step, the heaviest rank's cost over the mean rank's cost, for
   ``batch_rebalance`` against a naive equal split of the same samples (``random``), plus the
   run's makespan (sum over steps of the heaviest rank) relative to the naive split;
3. the epoch's cost per rank (normalised by the heaviest rank), for ``batch_rebalance``, for the
   same groups dealt the way Hugging Face's ``BatchRebalanceSampler`` deals them (rank r always
   gets the r-th heaviest group of each slot), and for the naive split.

Cost of a micro-batch = its size times its longest length (padded tokens).
"""

from __future__ import annotations

import statistics
import time

import attrs
import torch

from trainfold.data.samplers import Sampler, padded_cost

N = 8192
CONFIGS = [(4, 2, 4), (8, 4, 8)]  # (per_device_train_batch_size, gradient_accumulation_steps, world_size)


def lognormal(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.empty(n).log_normal_(5.0, 1.0, generator=g).clamp(1, 4096).round().tolist()]


def uniform(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, 1025, (n,), generator=g).tolist()


def padding_fraction(steps, lengths) -> float:
    computed = real = 0
    for step in steps:
        for rank in step:
            for micro in rank:
                computed += padded_cost(micro, lengths)
                real += sum(lengths[i] for i in micro)
    return 1 - real / computed


def rank_costs(step, lengths) -> list[int]:
    return [sum(padded_cost(m, lengths) for m in rank) for rank in step]


def hf_dealing(step, lengths, world: int, accumulation: int):
    """Deal the step's groups like HF: sort by cost, slot k gets ranks [k*w, (k+1)*w), rank r the r-th."""
    groups = sorted((m for rank in step for m in rank), key=lambda m: -padded_cost(m, lengths))
    return [[groups[k * world + r] for k in range(accumulation)] for r in range(world)]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> None:
    pad_rows = [["lengths", "B x accum x world", "random", "group_by_length", "batch_rebalance"]]
    step_rows = [
        [
            "lengths",
            "B x accum x world",
            "naive max/mean",
            "rebalance max/mean",
            "rebalance makespan / naive",
            "sampler s/epoch",
        ]
    ]
    epoch_rows = [["lengths", "B x accum x world", "sampler", "epoch cost per rank (/ max)", "min/max"]]
    for name, make in (("lognormal", lognormal), ("uniform", uniform)):
        lengths = make(N)
        for b, a, w in CONFIGS:
            cfg = f"{b} x {a} x {w}"
            base = Sampler(
                "random",
                N,
                per_device_train_batch_size=b,
                gradient_accumulation_steps=a,
                world_size=w,
                seed=1,
                lengths=lengths,
                drop_last=True,
            )
            runs = {}
            for strategy in ("random", "group_by_length", "batch_rebalance"):
                t0 = time.perf_counter()
                runs[strategy] = attrs.evolve(base, strategy=strategy).global_steps(0)
                if strategy == "batch_rebalance":
                    seconds = time.perf_counter() - t0
            pad_rows.append([name, cfg] + [f"{padding_fraction(runs[s], lengths):.1%}" for s in runs])

            naive, ours = runs["random"], runs["batch_rebalance"]
            ratio = lambda steps, lengths=lengths: statistics.mean(
                max(c) / statistics.mean(c) for c in (rank_costs(s, lengths) for s in steps)
            )
            makespan = lambda steps, lengths=lengths: sum(max(rank_costs(s, lengths)) for s in steps)
            step_rows.append(
                [
                    name,
                    cfg,
                    f"{ratio(naive):.3f}",
                    f"{ratio(ours):.3f}",
                    f"{makespan(ours) / makespan(naive):.3f}",
                    f"{seconds:.2f}",
                ]
            )

            hf = [hf_dealing(s, lengths, w, a) for s in ours]
            for label, steps in (("batch_rebalance", ours), ("same groups, HF dealing", hf), ("naive split", naive)):
                totals = [sum(c) for c in zip(*(rank_costs(s, lengths) for s in steps))]
                top = max(totals)
                shown = " ".join(f"{t / top:.2f}" for t in totals)
                epoch_rows.append([name, cfg, label, shown, f"{min(totals) / top:.3f}"])
    print(f"## Padded-token fraction of an epoch ({N} samples, drop_last)\n")
    print(table(pad_rows))
    print("\n## Per-step rank balance (mean over steps of heaviest rank / mean rank)\n")
    print(table(step_rows))
    print("\n## Epoch cost per rank\n")
    print(table(epoch_rows))


if __name__ == "__main__":
    main()
