"""Asynchronous GRPO (``max_staleness=1``) against synchronous GRPO, both on the process engine: steps/s.

A small Llama (``transformers.LlamaConfig``) trains with GRPO through ``trainfold.loop.run`` over
``grpo_stream(...).stream()`` with ``rollout_engine="process"`` (a generation server process holding its own
copy of the model, weights published over gloo). Synchronous (``max_staleness=0``): each step publishes, waits
for its generation, then trains. Asynchronous (``max_staleness=1``): step ``v``'s prepare submits the generation
of step ``v + 1`` (weights of version ``v``) before step ``v`` trains, so the server generates while the trainer
trains.

The server generates a step's completions as one batch (prompts of one length) but with no KV cache, so a
completion of ``C`` tokens costs ``C + 1`` forward passes over the whole sequence against the training step's
forward and backward. The defaults (Llama 256 x 2 layers, 16 completions of 4 tokens on 32-token prompts) make
a synchronous step wait for the server somewhat longer than it trains (the table shows both): generation takes
at least as long as a training step, as the goal asks, and not so much longer that overlap cannot pay.

Rounds alternate the two runs (each a fresh run and server); a run's steps/s counts its steps after the first
two (server start, first publish); the ratio is the median of per-round ratios, in one run. The goal is >= 1.4x.
Both processes run one thread each (``OMP_NUM_THREADS=1``). Overlap needs a free second core: before each round
the script measures two threads against one (``two_core_speedup``), and for each run the CPU seconds trainer and
server used per second over the timed steps ("cores used": up to 2 where the overlap got two cores); on a
machine whose cores other sessions use, Linux's autogroup scheduler gives the server and trainer (one session)
no more CPU together than the trainer alone, and the async run is no faster. Results: docs/rl.md.

    python benchmarks/grpo_async.py            # prints markdown tables
    python benchmarks/grpo_async.py --quick    # a tiny model, 4 steps, 1 round (the test runs this)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: the server process inherits it

import argparse
import statistics
import tempfile
import threading
import time
from typing import Any

import attrs
import torch

from trainfold import init_state, loop, make_step, sgd
from trainfold.grpo import GRPOArguments
from trainfold.grpo.run import Codec, grpo_stream


def llama(args: argparse.Namespace) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [c.count("7") / max(1, len(c)) for c in completions]


def one_run(args: argparse.Namespace, staleness: int) -> dict[str, float]:
    """Return the steps/s of one run (after its first two steps), the seconds per step it spends in ``prepare``
    (publishing, waiting for the generation, scoring it), of it in the engine's ``poll`` (waiting for the server),
    and in training (the step, after ``prepare``)."""
    grpo = GRPOArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.batch,
        num_generations=4,
        max_completion_length=args.completion,
        rollout_engine="process",
        max_staleness=staleness,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    codec = Codec(lambda s: [1 + int(c) for c in s], lambda ids: "".join(str(i % 10) for i in ids))
    prompts = [{"prompt": (f"{i:03d}" * args.prompt)[: args.prompt]} for i in range(64)]
    run = grpo_stream(llama(args), grpo, prompts, reward, codec=codec)
    assert run.rollouts is not None
    waits: list[float] = []  # each poll's seconds: the trainer waiting for the server
    make_engine = run.rollouts.make_engine

    def timed_engine(state: Any) -> Any:
        engine = make_engine(state)
        poll = engine.poll

        def timed_poll(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            out = poll(*a, **k)
            waits.append(time.perf_counter() - start)
            return out

        engine.poll = timed_poll
        return engine

    run.rollouts.make_engine = timed_engine
    step = make_step(run.model, optimizer=sgd(1e-3), objective=run.objective)
    stamps: list[float] = []  # after each step
    cpu: list[float] = []  # after each step: CPU seconds of the trainer and the server so far
    prepared: list[tuple[float, float, float]] = []  # each prepare's start, end, seconds in poll
    stream = run.stream()

    def timed(state: Any, item: Any) -> Any:
        start, waited = time.perf_counter(), sum(waits)
        out = stream.prepare(state, item)
        prepared.append((start, time.perf_counter(), sum(waits) - waited))
        return out

    def stamp(state: Any, log: Any) -> None:
        stamps.append(time.perf_counter())
        cpu.append(cpu_seconds(run))

    try:
        loop.run(
            step,
            init_state(run.model, sgd(1e-3), seed=0),
            attrs.evolve(stream, prepare=timed),
            stop=lambda s: int(s.step) >= args.steps,
            hooks=[loop.every(1, stamp)],
        )
    finally:
        assert run.rollouts is not None
        run.rollouts.close()
    n, span = len(stamps) - 2, stamps[-1] - stamps[1]
    prepare = sum(end - start for start, end, _ in prepared[2:]) / n
    wait = sum(w for _, _, w in prepared[2:]) / n
    train = sum(stamp - end for (_, end, _), stamp in zip(prepared[2:], stamps[2:])) / n
    cores = (cpu[-1] - cpu[1]) / span
    return {"steps/s": n / span, "prepare": prepare, "wait": wait, "train": train, "cores": cores}


def cpu_seconds(run: Any) -> float:
    """Return the CPU seconds this process and the server process have used (the server's from /proc)."""
    engine = run.rollouts.engine
    ticks = 0
    if engine is not None:
        with open(f"/proc/{engine.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return time.process_time() + ticks / os.sysconf("SC_CLK_TCK")


def two_core_speedup(seconds: float = 0.4) -> float:
    """Return how much faster two threads do twice one thread's work (2.0: a second core is free; about 1.0: the
    machine's other sessions take it — Linux's autogroup scheduler shares CPU time per session, so the server
    and the trainer, one session, then get no more CPU together than the trainer alone)."""
    a = torch.randn(384, 384)

    def work(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 2:
        work(10)
        n += 10
    one = time.perf_counter() - start
    threads = [threading.Thread(target=work, args=(n,)) for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 2 * one / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--completion", type=int, default=4, help="max_completion_length")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a tiny model, 4 steps, 1 round")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.prompt, args.completion, args.steps, args.rounds = 16, 1, 3, 8, 4, 1
    torch.set_num_threads(1)
    runs: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    speedups, loads = [], []
    for r in range(args.rounds):
        speedups.append(two_core_speedup())
        for staleness in (0, 1) if r % 2 == 0 else (1, 0):
            runs[staleness].append(one_run(args, staleness))
        loads.append(os.getloadavg()[0])
    sync, asynchronous = runs[0], runs[1]

    def med(rs: list[dict[str, float]], key: str) -> float:
        return statistics.median(x[key] for x in rs)

    ratios = [a["steps/s"] / s["steps/s"] for s, a in zip(sync, asynchronous)]
    print(
        f"Llama hidden {args.hidden} x {args.layers} layers, {args.batch} completions of {args.completion} tokens "
        f"on {args.prompt}-token prompts per step, {args.steps} steps, {args.rounds} rounds, process engine over "
        "gloo, one thread each"
    )
    print("| run | steps/s | prepare s/step | of it waiting for the server | train s/step |")
    print("|---|---|---|---|---|")
    for name, rs in (("synchronous (max_staleness=0)", sync), ("asynchronous (max_staleness=1)", asynchronous)):
        cells = " | ".join(f"{med(rs, key):.3f}" for key in ("steps/s", "prepare", "wait", "train"))
        print(f"| {name} | {cells} |")
    print(f"| ratio (median of rounds) | {statistics.median(ratios):.2f}x | | | |")
    share = med(sync, "prepare") / (med(sync, "prepare") + med(sync, "train"))
    print(f"synchronous: {share:.0%} of a step prepares (publish, generate, score), the rest trains")
    print("| round | ratio | two-core speedup before | cores used: sync, async | load average (1 min) after |")
    print("|---|---|---|---|---|")
    for r, (x, sp, load) in enumerate(zip(ratios, speedups, loads)):
        used = f"{sync[r]['cores']:.2f}, {asynchronous[r]['cores']:.2f}"
        print(f"| {r} | {x:.2f}x | {sp:.2f} | {used} | {load:.1f} |")


if __name__ == "__main__":
    main()
