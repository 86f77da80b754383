"""Peak RSS of ``trainfold.train`` vs ``transformers.Trainer(...).train()`` vs a hand-written in-place loop.

Each variant runs alone in a fresh subprocess and reports its own ``VmHWM`` (the high-water RSS):
the same Llama-from-config model and rows (``step_overhead.py``'s ``CONFIGS``), AdamW + clipping
(``max_grad_norm=1.0``), batch 4, gradient accumulation 2, no evaluation, ``save_strategy="no"``,
``report_to="none"``, sequential order, a few optimizer steps. The hand loop (the floor) is
``step_overhead.py``'s: forward/backward per micro-batch, ``clip_grad_norm_``, fused ``AdamW``.
``--phases`` also prints the current RSS (``VmRSS``) at each phase of a run: model built, first step
begun (state initialised), after the first step, after the last step, after ``train`` returned.

    python benchmarks/peak_memory.py --threads 1                  # small, mid-8k, wide-128k: markdown table
    python benchmarks/peak_memory.py --models tiny --steps 2      # the test suite
    python benchmarks/peak_memory.py --models small --phases      # RSS by phase
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead import CONFIGS, MICRO, ROWS, build, hand_runner

VARIANTS = ("hand", "hf_trainer", "trainfold")


def _status_mb(key: str) -> float:
    """This process's ``VmHWM`` or ``VmRSS`` from ``/proc/self/status``, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def rows_of(batches: list[list[dict]]) -> list[dict]:
    """The rows of ``batches`` (steps of micro-batches of ``ROWS`` rows), in order, as the trainers' dataset."""
    return [{k: mb[k][i] for k in mb} for step in batches for mb in step for i in range(ROWS)]


def settings(steps: int, output_dir: str) -> dict:
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=MICRO,
        learning_rate=1e-3,
        weight_decay=0.01,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        use_cpu=True,
    )


def run_hand(model, batches, steps, phases):
    run, _ = hand_runner(model)
    phases["first step begun"] = _status_mb("VmRSS")
    for i in range(steps):
        run(batches[i % len(batches)])
        if i == 0:
            phases["after first step"] = _status_mb("VmRSS")
    phases["after last step"] = _status_mb("VmRSS")


def run_hf(model, batches, steps, phases, output_dir):
    import transformers

    class Phases(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                phases["first step begun"] = _status_mb("VmRSS")

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                phases["after first step"] = _status_mb("VmRSS")
            phases["after last step"] = _status_mb("VmRSS")

    args = transformers.TrainingArguments(**settings(steps, output_dir))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows_of(batches), callbacks=[Phases()])
    trainer.train()


def run_trainfold(model, batches, steps, phases, output_dir):
    import trainfold

    def stamp(state):  # asked before every step and after the last
        key = {0: "first step begun", 1: "after first step"}.get(int(state.step), "after last step")
        phases[key] = _status_mb("VmRSS")
        return False

    args = trainfold.TrainingArguments(**settings(steps, output_dir))
    trainfold.train(model, args, rows_of(batches), stop=stamp)


def child(name: str, variant: str, steps: int) -> dict:
    """(In a subprocess) build the model, run one variant for ``steps`` optimizer steps; its RSS by phase."""
    phases = {"start": _status_mb("VmRSS")}
    model, batches = build(name)
    batches = [batches[i % len(batches)] for i in range(steps)]  # a step of data each
    phases["model built"] = _status_mb("VmRSS")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if variant == "hand":
            run_hand(model, batches, steps, phases)
        elif variant == "hf_trainer":
            run_hf(model, batches, steps, phases, tmp)
        else:
            run_trainfold(model, batches, steps, phases, tmp)
    phases["run returned"] = _status_mb("VmRSS")
    return {"peak_rss_mb": _status_mb("VmHWM"), "phases": phases, "seconds": time.perf_counter() - started}


def measure(name: str, variant: str, steps: int, threads: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", name, variant, "--steps", str(steps)]
    cmd += ["--threads", str(threads)] if threads else []
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(peak: dict, a: str, b: str) -> str:
    return f"{peak[a] / peak[b]:.3f}" if a in peak and b in peak else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["small", "mid-8k", "wide-128k"], choices=sorted(CONFIGS))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--phases", action="store_true", help="also print each run's RSS by phase")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(*args.child, args.steps)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {ROWS} x {MICRO}, {args.steps} steps")
    cols = " | ".join(f"{v} MB" for v in args.variants)
    print(f"| model | params | vocab | {cols} | trainfold / hand | trainfold / hf_trainer |")
    print("|---|---|---|" + "---|" * (len(args.variants) + 2))
    for name in args.models:
        got = {v: measure(name, v, args.steps, args.threads) for v in args.variants}
        model, _ = build(name)
        params = sum(p.numel() for p in model.parameters())
        del model
        peak = {v: r["peak_rss_mb"] for v, r in got.items()}

        cells = " | ".join(f"{peak[v]:.0f}" for v in args.variants)
        print(
            f"| {name} | {params / 1e6:.2f}M | {CONFIGS[name]['vocab_size']} | {cells} | "
            f"{_ratio(peak, 'trainfold', 'hand')} | {_ratio(peak, 'trainfold', 'hf_trainer')} |",
            flush=True,
        )
        if args.phases:
            for v, r in got.items():
                print(f"  {v}: " + ", ".join(f"{k} {mb:.0f}" for k, mb in r["phases"].items()), flush=True)


if __name__ == "__main__":
    main()
