"""How long a sharded checkpoint stalls the step: synchronous vs ``async_save``, on 2 gloo processes (CPU).

Each rank holds half of a TinyLM's params and AdamW moments (``fully_shard``: ``trainfold.step.fsdp``) and trains;
every round it saves a sharded checkpoint (``trainfold.ckpt.sharded.Saver``, safetensors
shards + JSON index) after a step. The stall is the time the training loop is blocked by the
save call: the whole write when synchronous; with ``async_save`` the copy of the shards to the
CPU, while a thread writes them and the next step runs. Reported per rank: the median step with
no save, the save call (sync and async), the step that runs while the async write is in flight,
and the async write's total time (save call to complete, renamed directory).

    python benchmarks/fsdp_checkpoint.py            # prints a markdown table
    python benchmarks/fsdp_checkpoint.py --quick    # a small model, few rounds

``benchmarks/fsdp.py`` prints this table after its own.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainfold import adamw, init_state, make_step
from trainfold.core.models import TinyLM, TinyLMConfig


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str, queue) -> None:
    from trainfold.ckpt.sharded import Saver
    from trainfold.step.fsdp import fully_shard_model, make_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyLM(TinyLMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, max_len=args.seq))
        rows = args.batch // world
        ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        batch = [{"input_ids": ids[rank * rows : (rank + 1) * rows], "labels": ids[rank * rows : (rank + 1) * rows]}]
        fully_shard_model(model, make_mesh())
        state = init_state(model, adamw(1e-3), copy=False)  # lent: the module's DTensor shards
        step = make_step(model, optimizer=adamw(1e-3))
        times: dict[str, list[float]] = {"step": [], "sync": [], "async": [], "step in flight": [], "write": []}
        savers = {"sync": Saver(), "async": Saver(async_save=True)}
        for i in range(args.warmup + args.rounds):
            for mode, saver in savers.items():
                dist.barrier()
                start = time.perf_counter()
                state = step(state, batch, donate=True)
                stepped = time.perf_counter()
                saver.save(state, Path(out_dir) / mode / f"checkpoint-{i}", model=model)
                saved = time.perf_counter()
                state = step(state, batch, donate=True)  # runs while an async save writes
                after = time.perf_counter()
                saver.wait()
                done = time.perf_counter()
                if i >= args.warmup:
                    times[mode].append(saved - stepped)
                    if mode == "async":
                        times["step"].append(stepped - start)
                        times["step in flight"].append(after - saved)
                        times["write"].append(done - stepped)
        queue.put((rank, {k: statistics.median(v) for k, v in times.items()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stall_table(args: argparse.Namespace) -> str:
    """Run the 2-process measurement with ``args`` (batch, seq, d_model, layers, rounds, warmup); return the table."""
    world = 2
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker, args=(world, _free_port(), args, out, queue), nprocs=world, join=True, start_method="spawn"
        )
    per_rank = dict(queue.get() for _ in range(world))
    lines = [
        f"Sharded checkpoint stall: {world} gloo processes, TinyLM d_model {args.d_model}, {args.layers} blocks, "
        f"medians of {args.rounds} rounds\n",
        "| rank | step (ms) | sync save stall (ms) | async save stall (ms) | step during async write (ms) "
        "| async write done (ms) | stall async vs sync |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rank in range(world):
        r = per_rank[rank]
        lines.append(
            f"| {rank} | {r['step'] * 1e3:.1f} | {r['sync'] * 1e3:.1f} | {r['async'] * 1e3:.1f} | "
            f"{r['step in flight'] * 1e3:.1f} | {r['write'] * 1e3:.1f} | {r['async'] / r['sync']:.3f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="global batch (samples per optimizer step)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="d_model 64, 2 layers, seq 32, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.d_model, args.layers, args.seq, args.rounds, args.warmup = 64, 2, 32, 2, 1
    print(stall_table(args))


if __name__ == "__main__":
    main()
