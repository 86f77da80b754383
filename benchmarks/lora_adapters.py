"""K LoRA adapters on one frozen base in one step (``recipes.ensemble_lora``) vs K sequential single-adapter runs.

A Llama from config (eager attention) with LoRA on q/v; each adapter trains on its own batches with SGD +
momentum. Two measures, each variant alone in a fresh subprocess:

* speed: the adapter ensemble step (K adapters x B rows per step) and K sequential ``make_step`` runs
  (one PEFT model, each adapter's state stepped in turn) on the same batches, interleaved in one process
  (so that load from other processes falls on both); the speed-up is the median over rounds of
  (sequential time / ensemble time);
* peak memory: each variant alone in a fresh subprocess, its peak RSS (``VmHWM``) after its steps and the
  part above the RSS once the model is built (the base's weights, torch itself), for the ensemble of K and
  for one adapter's run; the goal is ensemble <= (1 + 0.1 K) x one adapter's run, on the total RSS.

    python benchmarks/lora_adapters.py                 # K = 4, markdown table
    python benchmarks/lora_adapters.py --quick         # tiny model, few steps (the test suite)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

SIZES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64, seq=16, rows=2),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, vocab_size=8192, seq=64, rows=4),
}


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _build(size: str, k: int):
    import peft
    import transformers

    spec = dict(SIZES[size])
    seq, rows = spec.pop("seq"), spec.pop("rows")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **spec,
        num_attention_heads=8 if spec["hidden_size"] >= 256 else 4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        use_cache=False,
        attn_implementation="eager",
    )
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
    g = torch.Generator().manual_seed(1)
    batches = [
        [{"input_ids": (x := torch.randint(0, spec["vocab_size"], (rows, seq), generator=g)), "labels": x}]
        for _ in range(k)
    ]
    return model, batches, rows


def run_variant(variant: str, size: str, k: int, steps: int) -> dict[str, float]:
    """Run one variant in this process; return samples/s (median over steps) and memory."""
    from trainfold import init_state, make_step, sgd
    from trainfold.core.losses import causal_lm
    from trainfold.step import ensemble as ens
    from trainfold.step.ensemble.lora import init_adapter_ensemble, make_adapter_ensemble_step

    model, batches, rows = _build(size, k)
    opt = sgd(1e-2, momentum=0.9)
    built = _rss_kib("VmRSS")
    times = []
    if variant == "ensemble":
        state = init_adapter_ensemble(model, opt, size=k)
        step, stacked = make_adapter_ensemble_step(model, causal_lm, opt), ens.stack_batches(batches)
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            state = step(state, stacked)
            times.append(time.perf_counter() - t0)
        samples = k * rows
    else:
        count = k if variant == "sequential" else 1
        step = make_step(model, causal_lm, opt)
        states = [init_state(model, opt) for _ in range(count)]
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            states = [step(s, b) for s, b in zip(states, batches)]
            times.append(time.perf_counter() - t0)
        samples = count * rows
    return {
        "samples_per_s": samples / statistics.median(times[1:]),
        "peak_mib": _rss_kib("VmHWM") / 1024,
        "above_model_mib": (_rss_kib("VmHWM") - built) / 1024,
    }


def _in_subprocess(variant: str, size: str, k: int, steps: int, threads: int) -> dict[str, float]:
    code = (
        f"import torch, json, sys; torch.set_num_threads({threads}); sys.path.insert(0, 'benchmarks'); "
        f"import lora_adapters as b; print(json.dumps(b.run_variant({variant!r}, {size!r}, {k}, {steps})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def interleaved(size: str, k: int, rounds: int) -> list[float]:
    """Return, per round, (K sequential single-adapter steps' time) / (one ensemble step's time)."""
    from trainfold import init_state, make_step, sgd
    from trainfold.core.losses import causal_lm
    from trainfold.step import ensemble as ens
    from trainfold.step.ensemble.lora import init_adapter_ensemble, make_adapter_ensemble_step

    model, batches, _ = _build(size, k)
    opt = sgd(1e-2, momentum=0.9)
    ensemble, stacked = init_adapter_ensemble(model, opt, size=k), ens.stack_batches(batches)
    ens_step, one_step = make_adapter_ensemble_step(model, causal_lm, opt), make_step(model, causal_lm, opt)
    states = [init_state(model, opt) for _ in range(k)]
    ratios = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        ensemble = ens_step(ensemble, stacked)
        t1 = time.perf_counter()
        states = [one_step(s, b) for s, b in zip(states, batches)]
        t2 = time.perf_counter()
        if r:  # the first round warms up
            ratios.append((t2 - t1) / (t1 - t0))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    ns = parser.parse_args()
    size, steps = ("tiny", 2) if ns.quick else (ns.size, ns.steps)
    torch.set_num_threads(ns.threads)
    ratios = interleaved(size, ns.k, steps)
    results = {v: _in_subprocess(v, size, ns.k, steps, ns.threads) for v in ("one", "ensemble")}
    print(f"K = {ns.k} LoRA adapters on one Llama ({size}), SGD + momentum, CPU, {ns.threads} thread(s)\n")
    print("| variant | peak RSS (MiB) | above the built model (MiB) |")
    print("|---|---|---|")
    names = {"one": "one adapter", "ensemble": f"ensemble of {ns.k}"}
    for v, r in results.items():
        print(f"| {names[v]} | {r['peak_mib']:.0f} | {r['above_model_mib']:.0f} |")
    memory = results["ensemble"]["peak_mib"] / results["one"]["peak_mib"]
    print(
        f"\nensemble speed-up over {ns.k} sequential steps (interleaved, median of {len(ratios)} rounds): "
        f"{statistics.median(ratios):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in ratios)}); "
        f"ensemble / one-adapter peak RSS: {memory:.2f}x (goal <= {1 + 0.1 * ns.k:.1f}x)"
    )


if __name__ == "__main__":
    main()
