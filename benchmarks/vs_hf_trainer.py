"""Side-by-side: hand-written eager loop, transformers.Trainer, trainfold.train eager and compiled.

Same Llama-like model, data and hyperparameters (accumulation 2, warmup, clipping, weight decay,
linear schedule, logging every 10 steps, no saving), the same number of steps. Each run is a fresh
subprocess (so peak RSS is its own); rounds alternate the order of the variants. Reported: median
steady-state step time (steps after the first 5), whole-run time including data loading, logging
and (for the compiled variant) compilation, tokens/s, and peak RSS.

    python benchmarks/vs_hf_trainer.py                   # tiny model, 3 rounds, table + PNG
    python benchmarks/vs_hf_trainer.py --quick           # 1 round, few steps (the test suite runs this)
    python benchmarks/vs_hf_trainer.py --variants eager trainfold
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("eager", "hf_trainer", "trainfold", "trainfold_compiled")

SIZES = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=172,
        vocab_size=256,
        seq=128,
        batch=4,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        intermediate_size=688,
        vocab_size=2048,
        seq=256,
        batch=4,
    ),
    "100m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=2048,
        vocab_size=32000,
        seq=1024,
        batch=8,
    ),
}
HYPER = dict(learning_rate=1e-3, warmup_steps=3, weight_decay=0.01, max_grad_norm=1.0, accumulation=2)


def build(size: str, steps: int, device: str = "cpu", dtype: str = "float32"):
    """Return (model, rows) for ``size``: a LlamaForCausalLM from config and random token rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(SIZES[size])
    seq, batch = spec.pop("seq"), spec.pop("batch")
    cfg = LlamaConfig(
        **spec,
        num_key_value_heads=spec["num_attention_heads"],
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=getattr(torch, dtype))
    g = torch.Generator().manual_seed(1)
    n = batch * HYPER["accumulation"] * steps
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, cfg.vocab_size, (n, seq), generator=g)]
    return model, rows, batch, seq


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_eager(model, rows, batch, steps, device, bf16):
    import torch
    from transformers import get_scheduler

    loader = torch.utils.data.DataLoader(
        rows,
        batch_size=batch,
        shuffle=False,
        collate_fn=lambda items: {k: torch.stack([i[k] for i in items]) for k in items[0]},
    )
    opt = torch.optim.AdamW(
        model.parameters(), lr=HYPER["learning_rate"], weight_decay=HYPER["weight_decay"], fused=True
    )
    sched = get_scheduler("linear", opt, num_warmup_steps=HYPER["warmup_steps"], num_training_steps=steps)
    model.train()
    stamps = [time.perf_counter()]
    it = iter(loader)
    for _ in range(steps):
        for _ in range(HYPER["accumulation"]):
            b = {k: v.to(device) for k, v in next(it).items()}
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
                (model(**b).loss / HYPER["accumulation"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HYPER["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
    return stamps


def _settings(steps, batch, output_dir, bf16):
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=HYPER["accumulation"],
        learning_rate=HYPER["learning_rate"],
        warmup_steps=HYPER["warmup_steps"],
        weight_decay=HYPER["weight_decay"],
        max_grad_norm=HYPER["max_grad_norm"],
        lr_scheduler_type="linear",
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        bf16=bf16,
    )


def run_hf(model, rows, batch, steps, device, bf16, output_dir):
    import transformers

    stamps = [time.perf_counter()]

    class Stamp(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    class Rows:
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    args = transformers.TrainingArguments(use_cpu=device == "cpu", **_settings(steps, batch, output_dir, bf16))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Stamp()])
    stamps[0] = time.perf_counter()
    trainer.train()
    return stamps


def run_trainfold(model, rows, batch, steps, device, bf16, output_dir, compiled):
    import trainfold

    stamps: list[float] = []

    def stamp(state):  # a stop predicate is asked before every step: a free timestamp
        stamps.append(time.perf_counter())
        return False

    args = trainfold.TrainingArguments(
        use_cpu=device == "cpu", torch_compile=compiled, **_settings(steps, batch, output_dir, bf16)
    )
    trainfold.train(model, args, rows, stop=stamp)
    stamps.append(time.perf_counter())
    return stamps[:1] + stamps[1:-1][: steps - 1] + stamps[-1:]


def one(variant: str, size: str, steps: int, device: str, bf16: bool, output_dir: str) -> dict:
    """Run one variant in this process and return its measurements."""
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    model, rows, batch, seq = build(size, steps, device)
    started = time.perf_counter()
    if variant == "eager":
        stamps = run_eager(model, rows, batch, steps, device, bf16)
    elif variant == "hf_trainer":
        stamps = run_hf(model, rows, batch, steps, device, bf16, output_dir)
    else:
        stamps = run_trainfold(model, rows, batch, steps, device, bf16, output_dir, variant == "trainfold_compiled")
    whole = time.perf_counter() - started
    deltas = [b - a for a, b in zip(stamps, stamps[1:])]
    steady = deltas[5:] if len(deltas) > 8 else deltas[1:] or deltas
    tokens = batch * HYPER["accumulation"] * seq
    out = {
        "variant": variant,
        "size": size,
        "steps": steps,
        "step_s": statistics.median(steady),
        "first_step_s": deltas[0],
        "whole_run_s": whole,
        "tokens_per_s": tokens / statistics.median(steady),
        "peak_rss_mb": _peak_rss_mb(),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if device.startswith("cuda"):
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def drive(variants, size, steps, rounds, device="cpu", bf16=False) -> list[dict]:
    """Run every variant ``rounds`` times, each in a fresh subprocess, alternating the order."""
    results = []
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for v in order:
            cmd = [sys.executable, __file__, "--one", v, "--size", size, "--steps", str(steps), "--device", device]
            cmd += ["--bf16"] if bf16 else []
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{v} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def table(results: list[dict]) -> list[dict]:
    """Return one row per variant: medians over rounds and ratios to the eager loop."""
    rows = []
    base = (
        statistics.median(r["step_s"] for r in results if r["variant"] == "eager")
        if any(r["variant"] == "eager" for r in results)
        else None
    )
    base_run = (
        statistics.median(r["whole_run_s"] for r in results if r["variant"] == "hf_trainer")
        if any(r["variant"] == "hf_trainer" for r in results)
        else None
    )
    for v in VARIANTS:
        rs = [r for r in results if r["variant"] == v]
        if not rs:
            continue
        step = statistics.median(r["step_s"] for r in rs)
        whole = statistics.median(r["whole_run_s"] for r in rs)
        rows.append(
            {
                "variant": v,
                "step_ms": 1e3 * step,
                "step_vs_eager": step / base if base else float("nan"),
                "whole_run_s": whole,
                "hf_trainer_whole_run_over_this": base_run / whole if base_run else float("nan"),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
                **(
                    {"max_mem_gb": statistics.median(r["max_memory_allocated_gb"] for r in rs)}
                    if "max_memory_allocated_gb" in rs[0]
                    else {}
                ),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")


def chart(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    names = [r["variant"] for r in rows]
    axes[0].bar(names, [r["step_ms"] for r in rows], color="#4c72b0")
    axes[0].set_ylabel("median step (ms)")
    axes[1].bar(names, [r["whole_run_s"] for r in rows], color="#dd8452")
    axes[1].set_ylabel("whole run (s)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=25)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results"))
    ns = parser.parse_args()
    if ns.one:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(ns.one, ns.size, ns.steps, ns.device, ns.bf16, tmp)))
        return
    if ns.quick:
        ns.steps, ns.rounds = 8, 1
        ns.variants = [v for v in ns.variants if v != "trainfold_compiled"]
    results = drive(ns.variants, ns.size, ns.steps, ns.rounds, ns.device, ns.bf16)
    rows = table(results)
    print(f"{ns.size} model, {ns.steps} steps, {ns.rounds} rounds, device {ns.device}{' bf16' if ns.bf16 else ''}")
    print_table(rows)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"vs_hf_trainer_{ns.size}_{ns.device.split(':')[0]}.json").write_text(json.dumps(results, indent=1))
    if not ns.quick:
        chart(rows, out / f"vs_hf_trainer_{ns.size}_{ns.device.split(':')[0]}.png")


if __name__ == "__main__":
    main()
