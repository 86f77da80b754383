"""What ``import trainfold`` adds to ``import torch``: wall time of fresh interpreters, interleaved.

Run: ``python benchmarks/import_time.py [--rounds 15] [--before /path/to/an/older/src]``. Each round starts
one fresh interpreter per case, in turn (so load on the machine touches every case alike), and the table
shows each case's median and its excess over the median of ``import torch`` alone, with how many
``trainfold`` modules it loads and whether ``fcntl`` (POSIX-only) was imported. ``--before`` adds the same
cases for another source tree (``PYTHONPATH``), e.g. a checkout of the commit before lazy imports.
``python -X importtime -c "import trainfold"`` shows where the time goes, module by module.

Measured (5 rounds, CPU torch 2.13, a shared 2-core machine under load, so walls are long; the excess is what
counts), before = the eager ``__init__`` of commit 20a02df:

| case | before: over `import torch` | after | trainfold modules before / after |
|---|---:|---:|---:|
| `import torch, trainfold` | +2.41 s | -0.25 s (noise: nothing is imported) | 131 / 3 |
| the functional core (`TrainState`, `adamw`, `fit`, `init_state`, `make_step`) | +2.76 s | -0.03 s | 131 / 33 |
| `from trainfold import train` | +3.89 s | +3.02 s | 131 / 112 |

``train`` loads ``transformers``-free but sympy-heavy parts of torch (DTensor and FSDP2 load only when a run
shards: ``trainfold.step.fsdp`` imports them lazily).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROBE = (
    "import sys, time; t = time.perf_counter(); {code}; t = time.perf_counter() - t; import json; "
    "print(json.dumps([t, sum(m.startswith('trainfold') for m in sys.modules), 'fcntl' in sys.modules]))"
)
CASES = {
    "import torch": "import torch",
    "import torch, trainfold": "import torch, trainfold",
    "the functional core": "import torch; from trainfold import TrainState, adamw, fit, init_state, make_step",
    "from trainfold import train": "import torch; from trainfold import train",
}


def probe(code: str, src: str | None) -> tuple[float, int, bool]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(done.stderr)
    _, modules, fcntl = json.loads(done.stdout)
    return wall, modules, fcntl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--before", help="another source tree to compare (its src/ directory)")
    ns = parser.parse_args()
    trees = {"": None} | ({"before: ": ns.before} if ns.before else {})
    runs = {(tag, case): [] for tag in trees for case in CASES}
    for _ in range(ns.rounds):
        for tag, src in trees.items():
            for case, code in CASES.items():
                runs[tag, case].append(probe(code, src))
    torch_alone = statistics.median(wall for wall, _, _ in runs["", "import torch"])
    print("| case | median wall (s) | over `import torch` (s) | trainfold modules | fcntl imported |")
    print("|---|---:|---:|---:|---|")
    for (tag, case), samples in runs.items():
        wall = statistics.median(s[0] for s in samples)
        _, modules, fcntl = samples[-1]
        print(f"| {tag}{case} | {wall:.3f} | {wall - torch_alone:+.3f} | {modules} | {fcntl} |")


if __name__ == "__main__":
    main()
