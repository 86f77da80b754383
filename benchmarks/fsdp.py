"""Sharded training (``make_step(..., sharding=mesh)``) vs trainfold's data parallelism on 2 gloo processes (CPU).

Both train the same TinyLM on the same global batch (each rank half of it), interleaved in the same
rounds so that other jobs on the machine slow both alike. Per rank it reports the bytes of the
state a step needs (params + gradients + AdamW moments: the shards, or the full replica), the most
bytes of gathered full params alive at once (``trainfold.step.sharded.gathered_bytes``: the root's and
one block's), and the median step time.

On CPU the all-gathers and reduce-scatters of gloo are copies through the loopback, so the
sharded step is slower than the replicated one; what it buys is the memory column.

    python benchmarks/fsdp.py                # prints a markdown table
    python benchmarks/fsdp.py --quick        # a small model, few rounds
    python benchmarks/fsdp.py --compile inductor   # the sharded step eager vs compiled: compile and step time
    python benchmarks/fsdp.py --prefetch           # without and with the next block's all-gather in flight

``vs_fully_shard`` (``--vs-fully-shard``; ``benchmarks/gpu.py`` runs it on CUDA, one process per GPU
on NCCL, in bf16 at ~100M params) compares trainfold's sharded step, and trainfold's lent step on a
module wrapped with torch's FSDP2 (``make_step`` runs it as it is), with a hand-written FSDP2 loop
(``fully_shard`` per block and at the root, ``MixedPrecisionPolicy(bf16)``, ``torch.optim.AdamW``):
tokens/s and ``torch.cuda.max_memory_allocated`` per GPU, and the lent step's time over the hand
loop's, the two interleaved step by step. On CPU it runs the same code on 2 gloo processes (tiny
with ``--quick``, so the suite can check it runs).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.tree import flatten
from trainfold.distributed.distributed import ProcessGroupCollective
from trainfold.optim import GradientTransformation


def build(args: argparse.Namespace) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, max_len=args.seq))


def local_bytes(tree) -> int:
    from torch.distributed.tensor import DTensor

    return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in flatten(tree).values())


def grad_bytes(opt: GradientTransformation, seen: list[int]) -> GradientTransformation:
    """``opt``, recording the bytes of the gradients (this rank's part) it is given."""

    def tap(grads, state, params):  # sees the gradients the optimizer is given, changes nothing
        seen.append(local_bytes(grads))
        return grads, state

    return chain(GradientTransformation(init=lambda params: (), update=tap), opt)


def joined(rank: int, world: int, port: int, args: argparse.Namespace) -> tuple[list[dict], Any, Any]:
    """Join the 2-rank gloo group; return this rank's part of the global batch, the optimizer and the mesh."""
    from trainfold.step import sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = args.batch // world
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = [{"input_ids": ids[rank * rows : (rank + 1) * rows], "labels": ids[rank * rows : (rank + 1) * rows]}]
    return batch, chain(clip_by_global_norm(1.0), adamw(1e-3)), sharded.make_mesh()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    from trainfold.step import sharded

    batch, opt, mesh = joined(rank, world, port, args)
    try:
        runs = {}
        for name in ("ddp", "sharded"):
            model, grads = build(args), []
            state = init_state(model, opt)
            if name == "sharded":
                state = sharded.shard_state(state, mesh)
                step = make_step(model, optimizer=grad_bytes(opt, grads), sharding=mesh)
            else:
                collective = ProcessGroupCollective(rank, world)
                step = make_step(model, optimizer=grad_bytes(opt, grads), collective=collective)
            runs[name] = [step, state, grads, [], 0]
        for i in range(args.warmup + args.rounds):
            for run in runs.values():
                dist.barrier()
                step, state = run[0], run[1]
                with sharded.gathered_bytes() as peak:
                    start = time.perf_counter()
                    run[1] = step(state, batch)
                    seconds = time.perf_counter() - start
                run[4] = max(run[4], peak[0])
                if i >= args.warmup:
                    run[3].append(seconds)
        out = {
            name: {
                "state": local_bytes(run[1].params) + local_bytes(run[1].opt_state),
                "grads": max(run[2]),
                "gathered": run[4],
                "step": statistics.median(run[3]),
            }
            for name, run in runs.items()
        }
        queue.put((rank, out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _variants_worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    """Time the sharded step's variants (eager, compiled) on the same batch, interleaved; the first step apart."""
    from trainfold.step import sharded

    batch, opt, mesh = joined(rank, world, port, args)
    try:
        runs = {}
        for name, options in variants(args).items():
            model = build(args)
            state = sharded.shard_state(init_state(model, opt), mesh)
            sharding = sharded.Sharding(mesh, prefetch=options.pop("prefetch", False))
            runs[name] = [make_step(model, optimizer=opt, sharding=sharding, **options), state, [], 0.0]
        for i in range(1 + args.warmup + args.rounds):
            for run in list(runs.values())[:: 1 if i % 2 else -1]:  # alternate the order: no variant always first
                dist.barrier()
                start = time.perf_counter()
                run[1] = run[0](run[1], batch)
                seconds = time.perf_counter() - start
                if i == 0:
                    run[3] = seconds  # the first step: compiles
                elif i > args.warmup:
                    run[2].append(seconds)
        queue.put((rank, {name: {"first": r[3], "step": statistics.median(r[2])} for name, r in runs.items()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def variants(args: argparse.Namespace) -> dict[str, dict]:
    """The sharded step's variants ``--compile`` and ``--prefetch`` compare: ``make_step`` options by row name."""
    out: dict[str, dict] = {"sharded eager": {}}
    if args.prefetch:
        out["sharded eager + prefetch"] = {"prefetch": True}
    if args.compile:
        out[f"sharded compiled ({args.compile})"] = {"compile": args.compile}
        if args.prefetch:
            out[f"sharded compiled ({args.compile}) + prefetch"] = {"compile": args.compile, "prefetch": True}
    return out


def variants_table(args: argparse.Namespace, world: int = 2) -> str:
    """Return the markdown table of the sharded step's variants: first step (compile) and median step times."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _variants_worker, args=(world, _free_port(), args, queue), nprocs=world, join=True, start_method="spawn"
    )
    per_rank = dict(queue.get() for _ in range(world))
    lines = ["| variant | rank | first step (s) | step (ms) | step vs eager |", "|---|---:|---:|---:|---:|"]
    for name in per_rank[0]:
        for rank in range(world):
            r, e = per_rank[rank][name], per_rank[rank]["sharded eager"]
            lines.append(
                f"| {name} | {rank} | {r['first']:.1f} | {r['step'] * 1e3:.1f} | {r['step'] / e['step']:.2f}x |"
            )
    return "\n".join(lines)


def _vs_worker(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainfold.core.losses import causal_lm
    from trainfold.step import sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        mesh = sharded.make_mesh()
        rows, seq = cfg["batch"], cfg["seq"]  # per rank
        ids = torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(rank)).to(device)
        n = torch.tensor(rows * (seq - 1) * world, device=device)
        bf16 = torch.bfloat16 if cfg["bf16"] else None
        out = {}

        def model() -> TinyLM:
            torch.manual_seed(0)
            return TinyLM(
                TinyLMConfig(d_model=cfg["d_model"], n_layers=cfg["layers"], n_heads=cfg["heads"], max_len=seq)
            ).to(device)

        def interleaved(into: dict, sides: dict) -> None:
            seconds = _interleaved_seconds(sides, cfg, cuda)
            hand = seconds[next(iter(sides))]
            for name, values in seconds.items():
                into[name] = {
                    "tokens_per_s": rows * seq * world / statistics.median(values),
                    "max_memory": torch.cuda.max_memory_allocated() if cuda else float("nan"),  # both sides' peak
                    "ratio": statistics.median(v / h for v, h in zip(values, hand)),
                }

        def timed(name: str, one_step) -> None:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            seconds = []
            for i in range(cfg["warmup"] + cfg["steps"]):
                dist.barrier()
                start = time.perf_counter()
                one_step()
                if cuda:
                    torch.cuda.synchronize()
                if i >= cfg["warmup"]:
                    seconds.append(time.perf_counter() - start)
            out[name] = {
                "tokens_per_s": rows * seq * world / statistics.median(seconds),
                "max_memory": torch.cuda.max_memory_allocated() if cuda else float("nan"),
            }

        net = model()  # trainfold: the state's shards, one block gathered at a time
        opt = chain(clip_by_global_norm(1.0), adamw(1e-4))
        box = {
            "state": sharded.shard_state(init_state(net, opt), mesh),
            "step": make_step(net, causal_lm, opt, sharding=mesh, autocast=bf16),
        }
        net.to("meta")  # the step needs only the module's structure; its full weights would count against it

        def trainfold_step() -> None:
            box["state"] = box["step"](box["state"], [{"input_ids": ids, "labels": ids}])

        timed("trainfold sharded", trainfold_step)
        box.clear()  # free the shards before FSDP2 runs
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()

        def wrapped() -> TinyLM:
            net = model()
            for block in net.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(net, mesh=mesh, mp_policy=policy)
            return net

        ref = wrapped()  # FSDP2, hand-written loop
        optim = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)

        def fsdp2_step() -> None:
            loss = causal_lm(ref(input_ids=ids), ids, n)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)

        lent_net = wrapped()  # trainfold's lent step on the same FSDP2 module: make_step runs it as it is
        lent_opt = chain(clip_by_global_norm(1.0), adamw(1e-4, mask=None))
        lent = {"state": init_state(lent_net, lent_opt, copy=False), "step": make_step(lent_net, causal_lm, lent_opt)}

        def lent_step() -> None:
            lent["state"] = lent["step"](lent["state"], [{"input_ids": ids, "labels": ids}], donate=True)

        interleaved(out, {"FSDP2 fully_shard loop": fsdp2_step, "trainfold lent (fully_shard)": lent_step})
        queue.put((rank, out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _interleaved_seconds(sides: dict, cfg: dict, cuda: bool) -> dict[str, list[float]]:
    """Return each side's step seconds, the sides alternating (which goes first flips every round)."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(cfg["warmup"] + cfg["steps"]):
        for name in list(sides) if i % 2 == 0 else list(reversed(sides)):
            dist.barrier()
            start = time.perf_counter()
            sides[name]()
            if cuda:
                torch.cuda.synchronize()
            if i >= cfg["warmup"]:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def vs_fully_shard(device: str = "cpu", world: int = 2, quick: bool = True) -> None:
    """Print tokens/s and max memory per GPU of trainfold's sharded step and an FSDP2 loop (see the module doc)."""
    if device == "cuda":
        cfg = {
            "d_model": 768,
            "layers": 12,
            "heads": 12,
            "seq": 1024,
            "batch": 8,
            "bf16": True,
            "steps": 20,
            "warmup": 3,
        }
    else:  # quick: tiny, so that the suite can run it; else a ~3M-param model for the ratio
        cfg = {
            "d_model": 64 if quick else 256,
            "layers": 2 if quick else 4,
            "heads": 4,
            "seq": 32 if quick else 128,
            "batch": 2 if quick else 4,
            "bf16": False,
            "steps": 2 if quick else 8,
            "warmup": 1,
        }
    cfg["device"] = device
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _vs_worker, args=(world, _free_port(), cfg, queue), nprocs=world, join=True, start_method="spawn"
    )
    per_rank = dict(queue.get() for _ in range(world))
    precision = "bf16" if cfg["bf16"] else "fp32"
    print(
        f"\nTinyLM d_model {cfg['d_model']}, {cfg['layers']} blocks, {world} x {device} ({precision}), "
        f"{cfg['batch']} x {cfg['seq']} tokens per rank, medians of {cfg['steps']} steps\n"
    )
    print("| run | rank | tokens/s (all ranks) | max memory (GiB) | step time / FSDP2 loop's (interleaved) |")
    print("|---|---:|---:|---:|---:|")
    for name in per_rank[0]:
        for rank in range(world):
            r = per_rank[rank][name]
            ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
            print(f"| {name} | {rank} | {r['tokens_per_s']:.0f} | {r['max_memory'] / 2**30:.2f} | {ratio} |")


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
    parser.add_argument("--vs-fully-shard", action="store_true", help="only the comparison with FSDP2 (tiny on CPU)")
    parser.add_argument(
        "--compile",
        metavar="BACKEND",
        help="only the sharded step eager vs compiled with BACKEND (inductor, aot_eager)",
    )
    parser.add_argument("--prefetch", action="store_true", help="only the sharded step without and with prefetch")
    args = parser.parse_args()
    if args.vs_fully_shard:
        vs_fully_shard("cpu", 2, quick=args.quick)
        return
    if args.quick:
        args.d_model, args.layers, args.seq, args.rounds, args.warmup = 64, 2, 32, 2, 1
    if args.compile or args.prefetch:
        print(
            f"TinyLM d_model {args.d_model}, {args.layers} blocks, global batch {args.batch} x {args.seq} tokens, "
            f"2 gloo processes of 1 thread (load average {os.getloadavg()[0]:.1f}), medians of {args.rounds} "
            "interleaved rounds; the first step compiles\n"
        )
        print(variants_table(args))
        return

    world = 2
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), args, queue), nprocs=world, join=True, start_method="spawn")
    per_rank = dict(queue.get() for _ in range(world))
    n_params = sum(p.numel() for p in build(args).parameters())
    print(
        f"TinyLM {n_params / 1e6:.2f}M params (d_model {args.d_model}, {args.layers} blocks), global batch "
        f"{args.batch} x {args.seq} tokens, {world} gloo processes of 1 thread, {os.cpu_count()} CPUs (load "
        f"average {os.getloadavg()[0]:.1f}), medians of {args.rounds} interleaved rounds\n"
    )
    print(
        "| run | rank | params + opt state (MiB) | grads (MiB) | state + grads vs DDP | gathered peak (MiB) "
        "| step (ms) | step vs DDP |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    mib = 2**20
    for name in ("ddp", "sharded"):
        for rank in range(world):
            r, d = per_rank[rank][name], per_rank[rank]["ddp"]
            ratio = (r["state"] + r["grads"]) / (d["state"] + d["grads"])
            print(
                f"| {name} | {rank} | {r['state'] / mib:.2f} | {r['grads'] / mib:.2f} | {ratio:.3f} | "
                f"{r['gathered'] / mib:.2f} | {r['step'] * 1e3:.1f} | {r['step'] / d['step']:.2f}x |"
            )
    from fsdp_checkpoint import stall_table

    print("\n" + stall_table(args))


if __name__ == "__main__":
    main()
