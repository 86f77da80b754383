"""Weight publish to a generation process: ``ProcessEngine.publish`` against a plain ``dist.broadcast``.

Both sides move the same float32 tensors (``--mb`` MB in ``--tensors`` tensors) from this process to a
second process on the same machine over gloo:

- **publish**: ``trainfold.rollout.ProcessEngine.publish(version, weights)`` — the weights copied once
  (``gather_weights``: the engine's copy cannot change under the optimizer), checked against the model,
  sent in ``--bucket-mb`` buckets over the engine's private 2-rank group, and acknowledged by the server
  once it holds them all (the publish is atomic);
- **broadcast**: ``dist.broadcast`` of each tensor on a default 2-rank gloo group to a process that
  receives into preallocated tensors, then a ``barrier`` (so both sides end when the receiver has it all).

Rounds alternate the two; the ratio is the median of per-round ratios, in one run. The goal is <= 1.2x.

    python benchmarks/rollout_publish.py            # 100 MB, prints a markdown table
    python benchmarks/rollout_publish.py --quick    # 4 MB, 2 rounds (the test runs this)
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
from torch import nn

from trainfold.rollout.process import ProcessEngine


def build(args: argparse.Namespace) -> nn.Module:
    side = int((args.mb * 2**20 / 4 / args.tensors) ** 0.5)
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(args.tensors)])


def receiver(port: int, shapes: list[tuple[int, ...]], rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    buffers = [torch.empty(s) for s in shapes]
    for _ in range(rounds):
        for b in buffers:
            dist.broadcast(b, src=0)
        dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--tensors", type=int, default=25)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="4 MB, 2 rounds")
    args = p.parse_args()
    if args.quick:
        args.mb, args.rounds = 4.0, 2
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = build(args)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    engine = ProcessEngine(model, bucket_mb=args.bucket_mb)
    port = free_port()
    peer = mp.get_context("spawn").Process(
        target=receiver, args=(port, [tuple(t.shape) for t in weights.values()], args.rounds + 1)
    )
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)

    def publish(version: int) -> float:
        start = time.perf_counter()
        engine.publish(version, weights)
        return time.perf_counter() - start

    def broadcast() -> float:
        start = time.perf_counter()
        for t in weights.values():
            dist.broadcast(t, src=0)
        dist.barrier()
        return time.perf_counter() - start

    publish(0), broadcast()  # warm up: connections, allocations
    rows = []
    for r in range(args.rounds):
        pair = (publish(r + 1), broadcast()) if r % 2 == 0 else tuple(reversed((broadcast(), publish(r + 1))))
        rows.append(pair)
    peer.join()
    dist.destroy_process_group()
    engine.close()
    per_100mb = 100 * 2**20 / nbytes
    pub = statistics.median(a for a, _ in rows) * per_100mb
    base = statistics.median(b for _, b in rows) * per_100mb
    ratio = statistics.median(a / b for a, b in rows)
    print(f"{nbytes / 2**20:.1f} MB in {len(weights)} tensors, bucket {args.bucket_mb} MB, {args.rounds} rounds, gloo")
    print("| transfer | s per 100 MB |")
    print("|---|---|")
    print(f"| ProcessEngine.publish | {pub:.3f} |")
    print(f"| dist.broadcast | {base:.3f} |")
    print(f"| ratio (median of rounds) | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
