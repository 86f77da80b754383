"""Throughput of 1 vs 2 data-parallel processes (gloo, CPU), and the all-reduce share of a step.

The same global batch (``--batch`` samples of ``--seq`` tokens) is trained with ``make_step``:
by two gloo processes of one thread each, each rank taking half the batch and summing its count
and gradients with ``ProcessGroupCollective`` (one bucketed ``all_reduce`` for the gradients);
and, interleaved with it in the same rounds (rank 1 idle at a barrier), by rank 0 alone as one
process with the whole batch, with 1 and with 2 intra-op threads. Interleaving makes the
comparison fair on a machine that other jobs share. The all-reduce time is measured around
``sum_`` on rank 0; it includes waiting for the slower rank.

On a 2-core machine two processes cannot beat one process using both cores by much: the
cores, not the algorithm, bound the speed-up, and other jobs on the machine add noise.

    python benchmarks/ddp.py                 # prints a markdown table
    python benchmarks/ddp.py --rounds 5      # quicker
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.dist.distributed import ProcessGroupCollective


def build(seq: int) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(d_model=128, n_layers=4, n_heads=4, max_len=seq))


def batch_of(rows: int, seq: int, offset: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (rows + offset, seq), generator=torch.Generator().manual_seed(1))[offset:]
    return {"input_ids": ids, "labels": ids.clone()}


@attrs.define
class Timed:
    """A collective that adds up the seconds spent in ``sum_`` (the all-reduces and the wait for peers)."""

    inner: ProcessGroupCollective
    seconds: float = 0.0

    @property
    def rank(self) -> int:
        return self.inner.rank

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        self.inner.sum_(tensors)
        self.seconds += time.perf_counter() - start


def runner(rows: int, seq: int, collective: Timed | None = None, offset: int = 0) -> Callable[[], float]:
    """Return a function that runs one optimizer step and returns its seconds."""
    model = build(seq)
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
    step = make_step(model, optimizer=opt, collective=collective)
    box = [init_state(model, opt)]
    batch = [batch_of(rows, seq, offset)]

    def run() -> float:
        start = time.perf_counter()
        box[0] = step(box[0], batch)
        return time.perf_counter() - start

    return run


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = args.batch // world
        timed = Timed(ProcessGroupCollective(rank, world))
        ddp = runner(rows, args.seq, timed, offset=rank * rows)
        solo = runner(args.batch, args.seq) if rank == 0 else None
        flat = torch.zeros(sum(p.numel() for p in build(args.seq).parameters()))
        record: dict[str, list[float]] = {"ddp": [], "comm": [], "solo1": [], "solo2": [], "allreduce": []}
        for i in range(args.warmup + args.rounds):
            dist.barrier()
            timed.seconds = 0.0
            t_ddp = ddp()
            comm = timed.seconds
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)  # the gradient all-reduce alone, ranks in step
            t_ar = time.perf_counter() - start
            dist.barrier()
            if rank == 0:  # rank 1 waits at the next barrier
                assert solo is not None
                t1 = solo()
                torch.set_num_threads(2)
                t2 = solo()
                torch.set_num_threads(1)
                if i >= args.warmup:
                    for key, value in zip(record, (t_ddp, comm, t1, t2, t_ar)):
                        record[key].append(value)
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
    parser.add_argument("--batch", type=int, default=16, help="global batch (samples per optimizer step)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), args, queue), nprocs=2, join=True, start_method="spawn")
    rec = queue.get()
    n_params = sum(p.numel() for p in build(args.seq).parameters())
    med = {k: statistics.median(v) for k, v in rec.items()}
    share = statistics.median(c / t for c, t in zip(rec["comm"], rec["ddp"]))
    speedup = {k: statistics.median(s / d for s, d in zip(rec[k], rec["ddp"])) for k in ("solo1", "solo2")}

    print(
        f"TinyLM {n_params / 1e6:.2f}M params ({n_params * 4 / 2**20:.1f} MiB of fp32 gradients, one bucket), "
        f"global batch {args.batch} x {args.seq} tokens, {os.cpu_count()} CPUs (load average "
        f"{os.getloadavg()[0]:.1f}), medians of {args.rounds} interleaved rounds\n"
    )
    print(
        "| setup | step (ms) | samples/s | 2 processes' speed-up over it | all-reduce in step (ms) | all-reduce share |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, key in (("1 process, 1 thread", "solo1"), ("1 process, 2 threads", "solo2")):
        print(f"| {name} | {med[key] * 1e3:.1f} | {args.batch / med[key]:.0f} | {speedup[key]:.2f}x | - | - |")
    print(
        f"| 2 processes (gloo), 1 thread each | {med['ddp'] * 1e3:.1f} | {args.batch / med['ddp']:.0f} | - | "
        f"{med['comm'] * 1e3:.1f} | {share:.0%} |"
    )
    print(
        f"\nall_reduce of the {n_params * 4 / 2**20:.1f} MiB gradient buffer alone (ranks in step): "
        f"{med['allreduce'] * 1e3:.2f} ms median"
    )


if __name__ == "__main__":
    main()
