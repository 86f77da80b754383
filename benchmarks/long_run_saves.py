"""Save time, sidecar size and memory of a checkpoint after 1k, 10k and 50k logged steps, before and after.

Run: ``.venv/bin/python benchmarks/long_run_saves.py [--steps 1000 10000 50000] [--repeat 5]``.

A stub run: each of ``N`` steps logs one entry shaped like ``train``'s (``loss``, ``grad_norm``,
``learning_rate``, ``epoch``, ``step``; ``logging_steps=1``), then the state of a small TinyLM (with
AdamW moments) is saved as ``train._save`` saves it:

- ``before``: the log history held in a list and written into every sidecar (``metadata.log_history``,
  what trainfold did up to this change), so each save rewrites all of it;
- ``after``: the entries appended to ``log_history.jsonl`` as they are logged; the sidecar records
  the file's position (``metadata.log``); ``TrainResult.log_history`` is the file read back once at
  the end of the run (a plain list).

Both are written by today's ``checkpoint.save``, which also checksums the sidecar (a second JSON
encoding of it), so ``before`` costs somewhat more than the old code did; its growth with ``N`` is the point.

Each (variant, N) runs in a fresh process; ``RSS`` is the growth of the resident set over the
process's baseline after logging and saving (``/proc/self/status`` ``VmRSS``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def measure(variant: str, steps: int, repeat: int) -> dict[str, float]:
    import attrs
    import torch

    from trainfold import ckpt
    from trainfold.core.models import TinyLM, TinyLMConfig
    from trainfold.core.state import init_state, scalar
    from trainfold.observe import MetricWindow
    from trainfold.observe.history import HistoryFile, window_state
    from trainfold.optim import adamw

    torch.manual_seed(0)
    net = TinyLM(TinyLMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_len=32))
    state = attrs.evolve(init_state(net, adamw(1e-3)), step=scalar(steps))
    out = Path(tempfile.mkdtemp())
    base = _rss_kb()
    entries = (
        {
            "loss": 2.0 + 1e-6 * i,
            "grad_norm": 0.5 + 1e-7 * i,
            "learning_rate": 5e-5 * (1 - i / steps),
            "epoch": i / 1000,
            "step": i + 1,
        }
        for i in range(steps)
    )
    if variant == "before":
        history: list = list(entries)
        metadata = lambda: {"log_history": history, "best_metric": None, "best_step": None}
    else:
        log = HistoryFile(out / "log_history.jsonl")
        for e in entries:
            log.append(e)

        def metadata() -> dict:
            log.sync()
            return {
                "log": log.position(),
                "window": window_state(MetricWindow()),
                "best_metric": None,
                "best_step": None,
            }

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        path = ckpt.save(
            state,
            ckpt.checkpoint_path(out, steps),
            model=net,
            metadata=metadata(),
            settings={"learning_rate": 5e-5},
            run={"id": "bench", "fingerprint": "bench"},
        )
        times.append(time.perf_counter() - t0)
    return {
        "save_s": statistics.median(times),
        "sidecar_bytes": (path / ckpt.SIDECAR_FILE).stat().st_size,
        "rss_mb": (_rss_kb() - base) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "STEPS"), help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0], int(a.one[1]), a.repeat)))
        return
    print("| steps logged | variant | save (median) | sidecar | RSS growth |")
    print("|---:|---|---:|---:|---:|")
    for steps in a.steps:
        for variant in ("before", "after"):
            done = subprocess.run(
                [sys.executable, __file__, "--one", variant, str(steps), "--repeat", str(a.repeat)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ},
            )
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"| {steps:,} | {variant} | {r['save_s'] * 1e3:.1f} ms | {r['sidecar_bytes'] / 1e3:,.1f} kB "
                f"| {r['rss_mb']:.1f} MB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
