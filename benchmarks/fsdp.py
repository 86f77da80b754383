"""Sharded training (``make_step(..., sharding=mesh)``) vs trainfold's data parallelism on 2 gloo processes (CPU).

Both train the same TinyLM on the same global batch (each rank half of it), interleaved in the same
rounds so that other jobs on the machine slow both alike. Per rank it reports the bytes of the
state a step needs (params + gradients + AdamW moments: the shards, or the full replica), the most
bytes of gathered full params alive at once (``trainfold.sharded.gathered_bytes``: the root's and
one block's), and the median step time.

On CPU the all-gathers and reduce-scatters of gloo are copies through the loopback, so the
sharded step is slower than the replicated one; what it buys is the memory column.

    python benchmarks/fsdp.py                # prints a markdown table
    python benchmarks/fsdp.py --quick        # a small model, few rounds
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.distributed import ProcessGroupCollective
from trainfold.models import TinyLM, TinyLMConfig
from trainfold.optim import GradientTransformation
from trainfold.tree import flatten


def build(args: argparse.Namespace) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, max_len=args.seq))


def local_bytes(tree) -> int:
    from torch.distributed.tensor import DTensor

    return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in flatten(tree).values())


def grad_bytes(opt: GradientTransformation, seen: list[int]) -> GradientTransformation:
    """``opt``, recording the bytes of the gradients (this rank's part) it is given."""

    def apply(grads, state, params):
        seen.append(local_bytes(grads))
        return opt.apply(grads, state, params)

    return GradientTransformation(opt.init, opt.update, apply, opt.learning_rate, opt.spec)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    from trainfold import sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = args.batch // world
        ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        batch = [{"input_ids": ids[rank * rows:(rank + 1) * rows], "labels": ids[rank * rows:(rank + 1) * rows]}]
        opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
        mesh = sharded.make_mesh()
        runs = {}
        for name in ("ddp", "sharded"):
            model, grads = build(args), []
            state = init_state(model, opt)
            if name == "sharded":
                state = sharded.shard_state(state, mesh)
                step = make_step(model, optimizer=grad_bytes(opt, grads), sharding=mesh)
            else:
                step = make_step(model, optimizer=grad_bytes(opt, grads), collective=ProcessGroupCollective(rank, world))
            runs[name] = [step, state, grads, [], 0]
        for i in range(args.warmup + args.rounds):
            for name, run in runs.items():
                dist.barrier()
                step, state = run[0], run[1]
                with sharded.gathered_bytes() as peak:
                    start = time.perf_counter()
                    run[1] = step(state, batch)
                    seconds = time.perf_counter() - start
                run[4] = max(run[4], peak[0])
                if i >= args.warmup:
                    run[3].append(seconds)
        out = {name: {"state": local_bytes(run[1].params) + local_bytes(run[1].opt_state), "grads": max(run[2]),
                      "gathered": run[4], "step": statistics.median(run[3])} for name, run in runs.items()}
        queue.put((rank, out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="global batch (samples per optimizer step)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="d_model 64, 2 layers, seq 32, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.d_model, args.layers, args.seq, args.rounds, args.warmup = 64, 2, 32, 2, 1

    world = 2
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), args, queue), nprocs=world, join=True, start_method="spawn")
    per_rank = dict(queue.get() for _ in range(world))
    n_params = sum(p.numel() for p in build(args).parameters())
    print(f"TinyLM {n_params / 1e6:.2f}M params (d_model {args.d_model}, {args.layers} blocks), global batch "
          f"{args.batch} x {args.seq} tokens, {world} gloo processes of 1 thread, {os.cpu_count()} CPUs (load "
          f"average {os.getloadavg()[0]:.1f}), medians of {args.rounds} interleaved rounds\n")
    print("| run | rank | params + opt state (MiB) | grads (MiB) | state + grads vs DDP | gathered peak (MiB) "
          "| step (ms) | step vs DDP |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    mib = 2**20
    for name in ("ddp", "sharded"):
        for rank in range(world):
            r, d = per_rank[rank][name], per_rank[rank]["ddp"]
            ratio = (r["state"] + r["grads"]) / (d["state"] + d["grads"])
            print(f"| {name} | {rank} | {r['state'] / mib:.2f} | {r['grads'] / mib:.2f} | {ratio:.3f} | "
                  f"{r['gathered'] / mib:.2f} | {r['step'] * 1e3:.1f} | {r['step'] / d['step']:.2f}x |")


if __name__ == "__main__":
    main()
