"""Data parallel at 2 gloo ranks: trainfold's lent step against a hand ``DistributedDataParallel`` loop.

Both sides train the same model, batch and AdamW (clipped) on two gloo processes of one thread
each, with ``--accumulation`` micro-batches per optimizer step:

- **hand**: ``DistributedDataParallel`` (``no_sync`` on all but the last micro-batch), the summed
  loss over the step's labelled tokens, ``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)``;
- **trainfold**: ``make_step(..., collective=...)`` on a lent state (``init_state(copy=False)``),
  donated each step: the module runs under DDP (``trainfold.step.data_parallel``).

The two run interleaved in the same processes, alternating which goes first each round, so that
other jobs on a shared machine slow both alike; the ratio is the median of the per-round ratios.

    python benchmarks/ddp.py                 # prints a markdown table
    python benchmarks/ddp.py --rounds 3      # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.distributed.distributed import ProcessGroupCollective


def build(args: argparse.Namespace) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, max_len=args.seq))


def micro_batches(args: argparse.Namespace, rank: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1 + rank)
    out = []
    for _ in range(args.accumulation):
        ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def hand(args: argparse.Namespace, group: ProcessGroupCollective) -> Callable[[], float]:
    """Return one step of the hand loop (seconds)."""
    model = DistributedDataParallel(build(args), forward_sync_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    batch = micro_batches(args, group.rank)

    def run() -> float:
        start = time.perf_counter()
        n = torch.tensor(sum(int((mb["labels"][..., 1:] != -100).sum()) for mb in batch))
        dist.all_reduce(n)
        for i, mb in enumerate(batch):
            sync = model.no_sync() if i < len(batch) - 1 else contextlib.nullcontext()
            with sync:
                out = model(input_ids=mb["input_ids"])
                (causal_lm(out, mb["labels"], n) * group.world_size).backward()  # DDP averages over ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return run


def ours(args: argparse.Namespace, group: ProcessGroupCollective) -> Callable[[], float]:
    """Return one step of trainfold's lent, donated step (seconds)."""
    model = build(args)
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3, mask=None, fused=True))
    step = make_step(model, causal_lm, opt, collective=group)
    box = [init_state(model, opt, copy=False)]
    batch = micro_batches(args, group.rank)

    def run() -> float:
        start = time.perf_counter()
        box[0] = step(box[0], batch, donate=True)
        return time.perf_counter() - start

    return run


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = ProcessGroupCollective(rank, world)
        sides = {"hand": hand(args, group), "trainfold": ours(args, group)}
        record: dict[str, list[float]] = {"hand": [], "trainfold": []}
        for i in range(args.warmup + args.rounds):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                dist.barrier()
                seconds = sides[name]()
                if i >= args.warmup:
                    record[name].append(seconds)
        if rank == 0:
            queue.put(record)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="rows per micro-batch on each rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), args, queue), nprocs=2, join=True, start_method="spawn")
    rec = queue.get()
    n_params = sum(p.numel() for p in build(args).parameters())
    med = {k: statistics.median(v) for k, v in rec.items()}
    ratio = statistics.median(t / h for t, h in zip(rec["trainfold"], rec["hand"]))
    print(
        f"TinyLM {n_params / 1e6:.2f}M params, 2 gloo ranks x {args.accumulation} micro-batches of "
        f"{args.batch} x {args.seq} tokens, AdamW (clipped), {os.cpu_count()} CPUs (load average "
        f"{os.getloadavg()[0]:.1f}), medians of {args.rounds} interleaved rounds\n"
    )
    print("| loop | step (ms) | ratio to the hand DDP loop |")
    print("|---|---:|---:|")
    print(f"| hand DDP + torch.optim.AdamW | {med['hand'] * 1e3:.1f} | 1.00 |")
    print(f"| trainfold lent step (DDP) | {med['trainfold'] * 1e3:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
