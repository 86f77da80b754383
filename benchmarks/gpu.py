"""Everything to measure on a lent GPU, in one script: the Trainer comparison and the ensemble.

1. The side-by-side comparison in bf16 with a ~100M-parameter Llama at sequence 1024: tokens/s,
   MFU (model FLOPs / peak: 6 x params x tokens per second, plus attention) and
   ``torch.cuda.max_memory_allocated`` for the eager loop, the HF Trainer, trainfold eager and
   trainfold compiled.
2. ``benchmarks/ensemble.py --device cuda``: four tiny Llamas in one ensemble step against four
   sequential eager loops (the issue's GPU target: >= 2x).
3. ``benchmarks/fsdp.py``'s ``vs_fully_shard`` on every GPU (one NCCL process each, bf16):
   ``trainfold.train(fsdp="full_shard")`` (``fully_shard`` per decoder layer and the root,
   ``MixedPrecisionPolicy(bf16, fp32)``, a lent state) against a hand-written loop on the same FSDP2
   wrapping with ``torch.optim.AdamW``, jobs interleaved: step time and ``torch.cuda.max_memory_allocated``
   per GPU, and their ratios. CUDA only (``python benchmarks/fsdp.py --quick`` runs it tiny on CPU).
4. ``benchmarks/vllm_rollout.py``: GRPO's rollouts through a vLLM server (``trainfold.rollout.VLLMEngine``,
   weights published over NCCL): seconds per 100 MB published and generation tokens/s. Needs vllm and two GPUs;
   elsewhere it prints why it was skipped.

Without CUDA it runs the same code paths smaller (tiny model, float32, CPU; the ensemble part only
with ``--ensemble``, eager variants), so the suite can test it.

    python benchmarks/gpu.py                  # CUDA: both parts; CPU: part 1 on the tiny model
    python benchmarks/gpu.py --peak-tflops 989 --steps 30
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vs_hf_trainer as bench  # noqa: E402


def model_flops_per_token(params: int, size: str) -> float:
    """Return training FLOPs per token: 6N for the matmuls plus 12 * layers * hidden * seq for attention."""
    spec = bench.SIZES[size]
    return 6 * params + 12 * spec["num_hidden_layers"] * spec["hidden_size"] * spec["seq"]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", nargs="*", default=list(bench.VARIANTS))
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100/H200 SXM: 989)"
    )
    parser.add_argument("--ensemble", action="store_true", help="also run the ensemble part on CPU (always on CUDA)")
    parser.add_argument("--ensemble-rounds", type=int, default=5)
    ns = parser.parse_args()
    cuda = torch.cuda.is_available()
    size, device, bf16 = ("100m", "cuda", True) if cuda else ("tiny", "cpu", False)
    results = bench.drive(ns.variants, size, ns.steps, ns.rounds, device, bf16)
    rows = bench.table(results)
    params = results[0]["params"]
    for r in rows:
        achieved = r["tokens_per_s"] * model_flops_per_token(params, size)
        r["mfu"] = achieved / (ns.peak_tflops * 1e12) if cuda else float("nan")
    print(f"{size} model ({params / 1e6:.1f}M params), device {device}{' bf16' if bf16 else ''}, {ns.steps} steps")
    bench.print_table(rows)
    if cuda or ns.ensemble:
        cmd = [sys.executable, str(HERE / "ensemble.py"), "--device", device, "--rounds", str(ns.ensemble_rounds)]
        cmd += [] if cuda else ["--eager-only", "--per-round", "1"]
        print(flush=True)
        subprocess.run(cmd, check=True)
    if cuda:  # part 3; skipped on CPU
        import fsdp

        fsdp.vs_fully_shard("cuda", torch.cuda.device_count())
    import vllm_rollout  # part 4: runs where vllm and two GPUs are, else says why not

    print(flush=True)
    vllm_rollout.main([])


if __name__ == "__main__":
    main()
