"""Memory held by accumulated eval predictions: full logits vs argmax vs argmax + eval_accumulation_steps.

A causal LM with a 32k vocabulary (an embedding and a linear head: the head's logits are what
matters) is evaluated with ``trainfold.evaluation.predict_batches`` on an eval set grown 1x, 4x and 16x:

(a) full logits accumulated (no ``preprocess_logits_for_metrics``);
(b) ``preprocess_logits_for_metrics=argmax``;
(c) argmax and ``eval_accumulation_steps=2``;
(d) as (c), through sharded evaluation (``predict_batches(..., spec=, collective=)``, one rank).

For each case it reports the peak bytes of predictions waiting on the eval device (counted
exactly: bytes that ``preprocess_logits_for_metrics`` produced and the ``move`` hook has not yet
moved to the host), its ratio to (a), the bytes of the final host-side predictions, the peak
RSS of the process, the wall time, and on CUDA ``torch.cuda.max_memory_allocated``. On a
CPU-only machine the "device" is host memory too; the device column is what a GPU would hold.

Run: ``python benchmarks/eval_memory.py [--device cuda] [--scales 1 4 16]``; under a minute on CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
from pathlib import Path

import torch
from torch import nn

from trainfold.distributed import SingleProcess
from trainfold.evaluation import EvalSpec, predict_batches

VOCAB, D_MODEL, SEQ, BATCH, BASE_BATCHES, ACCUM = 32_000, 64, 32, 4, 2, 2


def _peak_rss_reset() -> bool:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the next peak starts clean
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batches(n: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids.to(device), "labels": ids.clone().to(device)})
    return out


class _Meter:
    """Counts prediction bytes entering the accumulator and leaving the device."""

    def __init__(self) -> None:
        self.ptrs: set[int] = set()
        self.held = 0
        self.peak = 0

    def preprocess(self, reduce):
        def f(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            out = reduce(logits)
            self.ptrs.add(out.untyped_storage().data_ptr())
            self.held += out.nbytes
            self.peak = max(self.peak, self.held)
            return out

        return f

    def move(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.ptrs:
            self.ptrs.discard(ptr)
            self.held -= t.nbytes
        return t.to("cpu")


CASES = {
    "(a) full logits": (lambda x: x, None, False),
    "(b) argmax": (lambda x: x.argmax(-1), None, False),
    f"(c) argmax + accum {ACCUM}": (lambda x: x.argmax(-1), ACCUM, False),
    # sharded evaluation (one rank here) folds with the same pipeline, so it honours eval_accumulation_steps too
    f"(d) sharded, argmax + accum {ACCUM}": (lambda x: x.argmax(-1), ACCUM, True),
}


def _predict(forward, params, batches, meter: _Meter, reduce, accum: int | None, sharded: bool):
    spec = EvalSpec(
        preprocess_logits_for_metrics=meter.preprocess(reduce),
        eval_accumulation_steps=accum,
        move=meter.move,
        speed_metrics=False,
    )
    return predict_batches(forward, params, batches, spec=spec, collective=SingleProcess() if sharded else None)


def run(scales: list[int], device: torch.device) -> list[dict[str, object]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, D_MODEL), nn.Linear(D_MODEL, VOCAB)).to(device)
    forward = lambda params, inputs: torch.func.functional_call(model, params, (inputs["input_ids"],))
    params = {k: v.detach() for k, v in model.named_parameters()}
    rows = []
    for scale in scales:
        batches = _batches(BASE_BATCHES * scale, device)
        full = None
        for name, (reduce, accum, sharded) in CASES.items():
            meter = _Meter()
            exact_rss = _peak_rss_reset()
            rss0 = _peak_rss_mb()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = _predict(forward, params, batches, meter, reduce, accum, sharded)
            seconds = time.perf_counter() - t0
            full = meter.peak if full is None else full
            row = {
                "scale": f"{scale}x",
                "batches": len(batches),
                "case": name,
                "device_peak": meter.peak,
                "ratio": meter.peak / full,
                "host_result": out.predictions.nbytes,
                "rss": _peak_rss_mb() - (rss0 if exact_rss else 0),
                "seconds": seconds,
            }
            if device.type == "cuda":
                row["cuda_max_mb"] = torch.cuda.max_memory_allocated() / 2**20
            rows.append(row)
            del out
    return rows


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def table(rows: list[dict[str, object]]) -> str:
    cuda = "cuda_max_mb" in rows[0]
    head = [
        "eval set",
        "batches",
        "case",
        "device-held preds at peak",
        "ratio to (a)",
        "host predictions",
        "peak RSS growth (MiB)",
        "time (s)",
    ] + (["cuda max allocated (MiB)"] if cuda else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["scale"],
            r["batches"],
            r["case"],
            _fmt_bytes(r["device_peak"]),
            f"{r['ratio']:.2e}",
            _fmt_bytes(r["host_result"]),
            f"{max(r['rss'], 0.0):.0f}",
            f"{r['seconds']:.2f}",
        ]
        if cuda:
            cells.append(f"{r['cuda_max_mb']:.0f}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _fixed_mmap_threshold() -> None:
    # glibc raises its mmap threshold after big frees, so later big tensors land in the heap and
    # RSS stops falling back between cases; a fixed threshold keeps every big tensor in its own map.
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except (OSError, AttributeError):
        pass


def main() -> None:
    _fixed_mmap_threshold()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"vocab {VOCAB}, batch {BATCH}x{SEQ} tokens, {BASE_BATCHES} batches at 1x, device {device}, "
        f"torch {torch.__version__}"
    )
    print(table(run(args.scales, device)))


if __name__ == "__main__":
    main()
