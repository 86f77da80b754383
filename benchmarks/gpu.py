"""The side-by-side comparison on a CUDA machine: bf16, a ~100M-parameter Llama, sequence 1024.

Prints tokens/s, MFU (model FLOPs / peak: 6 x params x tokens per second, plus attention) and
``torch.cuda.max_memory_allocated`` for the eager loop, the HF Trainer, trainfold eager and
trainfold compiled. Without CUDA it runs the same code path smaller (tiny model, float32, CPU), so
the suite can test it.

    python benchmarks/gpu.py                  # CUDA: 100m model, bf16; CPU: tiny model
    python benchmarks/gpu.py --peak-tflops 989
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100/H200 SXM: 989)")
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


if __name__ == "__main__":
    main()
