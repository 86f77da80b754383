"""Throughput of 1 vs 2 data-parallel processes (gloo, CPU), and the all-reduce share of a step.

The same global batch (``--batch`` samples of ``--seq`` tokens) is trained with ``make_step``:
in one process as one micro-batch (with 1 and with 2 intra-op threads), and in two gloo
processes of one thread each, each rank taking half the batch and summing its count and
gradients with ``ProcessGroupCollective`` (one bucketed ``all_reduce`` for the gradients). The
all-reduce time is measured around ``sum_`` on rank 0; it includes waiting for the slower rank.

On a 2-core machine two processes cannot beat one process using both cores by much: the
cores, not the algorithm, bound the speed-up, and other jobs on the machine add noise.

    python benchmarks/ddp.py                 # prints a markdown table
    python benchmarks/ddp.py --steps 5       # quicker
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.distributed import ProcessGroupCollective
from trainfold.models import TinyLM, TinyLMConfig


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


def run_steps(rows: int, seq: int, steps: int, warmup: int, collective: Timed | None = None, offset: int = 0):
    """Return per-step seconds and per-step all-reduce seconds after ``warmup`` steps."""
    model = build(seq)
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
    step = make_step(model, optimizer=opt, collective=collective)
    state = init_state(model, opt)
    batch = [batch_of(rows, seq, offset)]
    times, comm = [], []
    for i in range(warmup + steps):
        if collective is not None:
            dist.barrier()
            collective.seconds = 0.0
        start = time.perf_counter()
        state = step(state, batch)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
            comm.append(collective.seconds if collective is not None else 0.0)
    return times, comm, sum(p.numel() for p in state.params.values())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = args.batch // world
        timed = Timed(ProcessGroupCollective(rank, world))
        times, comm, _ = run_steps(rows, args.seq, args.steps, args.warmup, timed, offset=rank * rows)
        flat = torch.zeros(sum(p.numel() for p in build(args.seq).parameters()))
        pure = []
        for _ in range(args.steps):  # the all-reduce alone, ranks in step
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)
            pure.append(time.perf_counter() - start)
        if rank == 0:
            queue.put((times, comm, pure))
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        times, _, n_params = run_steps(args.batch, args.seq, args.steps, args.warmup)
        rows.append((f"1 process, {threads} thread{'s' * (threads > 1)}", statistics.median(times), None, None))
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), args, queue), nprocs=2, join=True, start_method="spawn")
    times, comm, pure = queue.get()
    share = statistics.median(c / t for c, t in zip(comm, times))
    rows.append(("2 processes (gloo), 1 thread each", statistics.median(times), statistics.median(comm), share))

    print(f"TinyLM {n_params / 1e6:.2f}M params ({n_params * 4 / 2**20:.1f} MiB of fp32 gradients, one bucket), "
          f"global batch {args.batch} x {args.seq} tokens, {os.cpu_count()} CPUs (load average "
          f"{os.getloadavg()[0]:.1f} from other jobs), median of {args.steps} steps\n")
    print("| setup | step (ms) | samples/s | all-reduce in step (ms) | all-reduce share |")
    print("|---|---:|---:|---:|---:|")
    for name, step_s, comm_s, frac in rows:
        comm_text = f"{comm_s * 1e3:.1f}" if comm_s is not None else "-"
        share_text = f"{frac:.0%}" if frac is not None else "-"
        print(f"| {name} | {step_s * 1e3:.1f} | {args.batch / step_s:.0f} | {comm_text} | {share_text} |")
    print(f"\nall_reduce of the gradient buffer alone (2 ranks in step): {statistics.median(pure) * 1e3:.2f} ms median")


if __name__ == "__main__":
    main()
