"""Sampler construction and epoch plans at dataset scale, against Hugging Face in the same process.

Run: ``python benchmarks/sampler_scale.py [--rows 1000000]``. Prints two tables:

1. building a ``group_by_length`` sampler over a ``datasets.Dataset`` (reading one length per row):
   from a length column, and from the list lengths of ``input_ids`` when there is no length column;
   both go through arrow in one call (the per-row loop they replace is timed on a 20k-row slice and
   scaled, so the table stays quick);
2. one epoch's ``batch_rebalance`` plan (all ranks' micro-batches) against
   ``transformers.trainer_pt_utils.BatchRebalanceSampler`` iterated for one rank, on the same lengths.

Lengths are lognormal (median ~150 tokens). Times are the best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

from trainfold.data.lengths import item_length as _item_length
from trainfold.data.samplers import Sampler, make_sampler


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    import datasets
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 0.8, ns.rows).astype(np.int64), 1, 2048)
    with_column = datasets.Dataset.from_dict({"length": lengths})
    with_lists = datasets.Dataset.from_dict({"input_ids": [[1] * int(n % 64 + 1) for n in lengths]})
    slice_rows = min(20_000, ns.rows)
    print(f"rows: {ns.rows}\n")
    print("| lengths from | arrow (s) | per row (s, scaled) |")
    print("|---|---|---|")
    for name, ds, per_row in (
        ("length column", with_column, lambda d: [int(n) for n in d["length"]]),
        ("input_ids lists", with_lists, lambda d: [_item_length(d[i], "input_ids", i) for i in range(len(d))]),
    ):
        arrow = best(lambda ds=ds: make_sampler("group_by_length", ds, per_device_train_batch_size=8), ns.rounds)
        small = ds.select(range(slice_rows))
        loop = best(lambda per_row=per_row, small=small: per_row(small), 1) * ns.rows / slice_rows
        print(f"| {name} | {arrow:.3f} | {loop:.1f} |")
    print("\n| batch_rebalance epoch plan (per device 8) | trainfold (s) | HF (s) | ratio |")
    print("|---|---|---|---|")
    as_list = lengths.tolist()
    for accumulation, world in ((1, 1), (4, 1), (2, 2)):
        ours = Sampler(
            "batch_rebalance",
            ns.rows,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=accumulation,
            world_size=world,
            seed=1,
            lengths=as_list,
        )
        theirs = BatchRebalanceSampler(
            lengths=as_list,
            effective_batch_size=8 * accumulation * world,
            dp_size=world,
            grad_accum=accumulation,
            rank=0,
        )
        a = best(lambda ours=ours: ours.global_steps(0), ns.rounds)
        b = best(lambda theirs=theirs: list(iter(theirs)), ns.rounds)
        print(f"| GA {accumulation}, world {world} | {a:.2f} | {b:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
