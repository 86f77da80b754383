"""trainfold ``train(fsdp="full_shard")`` vs a hand FSDP2 loop on 2 gloo processes (CPU): step time and peak RSS.

Both sides train the same small Llama (``transformers.LlamaForCausalLM``, ~21M params at the default
size) on the same global batch with gradient accumulation 2, each rank half of it:

* **hand**: ``fully_shard`` per decoder layer, then the root; ``torch.optim.AdamW``; the reduce-scatter
  skipped on the first micro-batch (``set_requires_gradient_sync(False)``); the loss summed over tokens
  and divided by the rank's token count (FSDP averages over ranks); ``clip_grad_norm_(1.0)``; the loss
  read every step;
* **trainfold**: ``trainfold.train`` with ``TrainingArguments(fsdp="full_shard")`` (the same
  ``fully_shard`` wrapping, a lent state, the eager step; its default AdamW and clipping), logging
  every step; a step's time is the time between two logs.

Each side runs as its own pair of processes (so each has its own peak RSS, ``ru_maxrss``), the jobs
interleaved hand, trainfold, trainfold, hand, ... so that other load on the machine hits both alike.
Reported: the median step time and the peak RSS per rank of each side, and trainfold's over the hand
loop's (medians over the jobs).

    python benchmarks/fsdp.py                # ~21M-param Llama, 2 rounds (4 jobs)
    python benchmarks/fsdp.py --quick        # a tiny Llama, 1 round (the suite's smoke test)

Peak RSS under glibc's default malloc moves by up to ~±60 MiB from job to job on both sides (the mmap threshold
rises with the first large free, after which freed 0.1-32 MiB tensors stay in the heap, fragmented differently
from job to job). ``--fixed-mmap-threshold`` runs the jobs with
``MALLOC_MMAP_THRESHOLD_=131072`` (glibc's initial threshold, held fixed: every tensor of 128 KiB or more is its
own mapping, returned when freed), where each side's peak repeats to the MiB and the ratio is what the two hold.

The full run then prints ``benchmarks/fsdp_checkpoint.py``'s table (how long a sharded save stalls the step).

``benchmarks/gpu.py`` runs ``vs_fully_shard`` on CUDA (one NCCL process per GPU, bf16): the same two sides
in one job, interleaved step by step, with tokens/s and ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import trainfold
from trainfold.core.losses import causal_lm

SIZES = {
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, seq=128),
    "tiny": dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, seq=16),
}


def llama(size: str) -> transformers.LlamaForCausalLM:
    spec = dict(SIZES[size])
    spec.pop("seq")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **spec, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False
    )
    config.use_cache = False
    return transformers.LlamaForCausalLM(config)


def tokens(cfg: dict, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's rows of every step's global batch (the same rows for both sides)."""
    seq, vocab = SIZES[cfg["size"]]["seq"], SIZES[cfg["size"]]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    rows = cfg["batch"] // world
    steps = [torch.randint(0, vocab, (cfg["batch"], seq), generator=g) for _ in range(cfg["steps"])]
    return [s[rank * rows : (rank + 1) * rows] for s in steps]


def _hand(cfg: dict, rank: int, world: int, device: torch.device) -> list[float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = llama(cfg["size"]).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg["bf16"] else None
    options: dict[str, Any] = {"mp_policy": policy} if policy is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0)
    accumulation, times = cfg["accumulation"], []
    for ids in tokens(cfg, rank, world):
        ids = ids.to(device)
        dist.barrier()
        start = time.perf_counter()
        micro = ids.chunk(accumulation)
        count = torch.tensor(float(ids[:, 1:].numel()), device=device)  # this rank's mean; FSDP averages ranks
        total = torch.zeros((), device=device)
        for i, mb in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            loss = causal_lm(model(input_ids=mb).logits, mb, count)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        total.item()
        times.append(time.perf_counter() - start)
    return times


def _trainfold(cfg: dict, rank: int, world: int, device: torch.device) -> list[float]:
    rows = [{"input_ids": r.tolist(), "labels": r.tolist()} for ids in tokens(cfg, 0, 1) for r in ids]
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        args = trainfold.TrainingArguments(
            output_dir=out,
            fsdp="full_shard",
            bf16=cfg["bf16"],
            max_steps=cfg["steps"],
            per_device_train_batch_size=cfg["batch"] // world // cfg["accumulation"],
            gradient_accumulation_steps=cfg["accumulation"],
            train_sampling_strategy="sequential",
            learning_rate=5e-5,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=device.type == "cpu",
            log_level="warning",
        )
        model = llama(cfg["size"]).to(device)

        def stamp(state: Any, logs: Any) -> None:  # every step's log (not the summary)
            if "loss" in logs and "train_loss" not in logs:
                stamps.append(time.perf_counter())

        trainfold.train(model, args, rows, observers=[stamp])
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _job(rank: int, world: int, port: int, side: str, cfg: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        times = (_hand if side == "hand" else _trainfold)(cfg, rank, world, device)
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        queue.put((rank, {"step": statistics.median(times[cfg["warmup"] :]), "peak": peak}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(side: str, cfg: dict, world: int) -> dict[int, dict[str, float]]:
    """Run one side as a job of ``world`` fresh processes; return each rank's median step and peak memory."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _job, args=(world, _free_port(), side, cfg, queue), nprocs=world, join=True, start_method="spawn"
    )
    return dict(queue.get() for _ in range(world))


def compare(cfg: dict, world: int = 2, rounds: int = 2) -> str:
    """Run the interleaved jobs (hand, trainfold, trainfold, hand, ...); return the markdown table."""
    jobs: dict[str, list[dict[int, dict[str, float]]]] = {"hand": [], "trainfold": []}
    for r in range(rounds):
        for side in ("hand", "trainfold") if r % 2 == 0 else ("trainfold", "hand"):
            jobs[side].append(run_job(side, cfg, world))
    n_params = sum(p.numel() for p in llama(cfg["size"]).parameters())
    memory = "max allocated (MiB)" if cfg["device"] == "cuda" else "peak RSS (MiB)"
    fixed = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    threshold = f", MALLOC_MMAP_THRESHOLD_={fixed}" if fixed else ""
    lines = [
        f"Llama {n_params / 1e6:.1f}M params ({cfg['size']}), {world} x {cfg['device']} "
        f"({'bf16' if cfg['bf16'] else 'fp32'}), global batch {cfg['batch']} x {SIZES[cfg['size']]['seq']} tokens, "
        f"accumulation {cfg['accumulation']}, {cfg['steps']} steps a job ({cfg['warmup']} warm-up), "
        f"{rounds} job(s) a side interleaved, load average {os.getloadavg()[0]:.1f}"
        f"{threshold}\n",
        f"| rank | hand step (ms) | trainfold step (ms) | step ratio | hand {memory} | trainfold {memory} "
        "| memory ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rank in range(world):
        step = {s: statistics.median(j[rank]["step"] for j in jobs[s]) for s in jobs}
        peak = {s: statistics.median(j[rank]["peak"] for j in jobs[s]) for s in jobs}
        lines.append(
            f"| {rank} | {step['hand'] * 1e3:.1f} | {step['trainfold'] * 1e3:.1f} | "
            f"{step['trainfold'] / step['hand']:.3f} | {peak['hand'] / 2**20:.0f} | {peak['trainfold'] / 2**20:.0f} | "
            f"{peak['trainfold'] / peak['hand']:.3f} |"
        )
    return "\n".join(lines)


def vs_fully_shard(device: str = "cuda", world: int = 2, quick: bool = False) -> None:
    """Print the comparison on ``device`` (``benchmarks/gpu.py``: CUDA, one NCCL process per GPU, bf16)."""
    cfg = dict(size="tiny" if quick else "small", batch=8 * world, accumulation=2, steps=12, warmup=2)
    print(compare({**cfg, "device": device, "bf16": device == "cuda"}, world, rounds=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="global batch (samples per optimizer step)")
    parser.add_argument("--steps", type=int, default=10, help="steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of a job left out of its median")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per side (interleaved)")
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, 3 steps, one job a side")
    parser.add_argument(
        "--fixed-mmap-threshold", action="store_true", help="jobs under MALLOC_MMAP_THRESHOLD_=131072 (see above)"
    )
    ns = parser.parse_args()
    if ns.fixed_mmap_threshold:  # read by glibc when each spawned job starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    cfg = dict(size="small", batch=ns.batch, accumulation=2, steps=ns.steps, warmup=ns.warmup, device="cpu")
    if ns.quick:
        cfg.update(size="tiny", steps=3, warmup=1)
        ns.rounds = 1
    print(compare({**cfg, "bf16": False}, 2, rounds=ns.rounds))
    if ns.quick:  # the checkpoint stall has its own smoke run (python benchmarks/fsdp_checkpoint.py --quick)
        return
    from fsdp_checkpoint import stall_table

    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)  # the stall under the default malloc

    stall = argparse.Namespace(batch=ns.batch, seq=128, d_model=256, layers=4, rounds=5, warmup=1)
    print("\n" + stall_table(stall))


if __name__ == "__main__":
    main()
