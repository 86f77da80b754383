"""What ``import trainfold`` adds to ``import torch``: wall time of fresh interpreters, interleaved.

Run: ``python benchmarks/import_time.py [--rounds 15] [--before /path/to/an/older/src]``. Each round starts
one fresh interpreter per case, in turn (so load on the machine touches every case alike), and the table
shows each case's median and its excess over the median of ``import torch`` alone, with how many
``trainfold`` modules it loads and whether ``fcntl`` (POSIX-only) was imported. ``--before`` adds the same
cases for another source tree (``PYTHONPATH``), e.g. a checkout of the commit before lazy imports.
``python -X importtime -c "import trainfold"`` shows where the time goes, module by module.

Measured (5 rounds, CPU torch 2.13, the shared 2-core machine at a quiet moment: `import torch` 1.30 s),
before = commit 0a06911 (the hf layer imported ``trainfold.step.sharded``, hence DTensor and sympy, at its
top; ``__version__`` read the package metadata on ``import trainfold``), after = this tree (both on use):

| case | before: over `import torch` | after | trainfold modules before / after |
|---|---:|---:|---:|
| `import torch, trainfold` | +0.01 s | -0.04 s (noise: nothing is imported) | 3 / 1 |
| the functional core (`TrainState`, `adamw`, `fit`, `init_state`, `make_step`) | +0.04 s | +0.04 s | 40 / 39 |
| `from trainfold import train` | +0.81 s | +0.24 s | 117 / 114 |

Under heavy load (`import torch` 7.7-8.6 s) the same cases measured +8.0 s before and +1.7 s after for `train`.
``python -X importtime -c "from trainfold import train"`` before (under that load): 5.6 s of it under
``trainfold.step.sharded`` (``torch.distributed.tensor`` -> ``torch.fx.experimental.symbolic_shapes`` ->
sympy); after: no DTensor, no sympy, no transformers (``tests/test_import.py``); what is left is the ~110
trainfold modules the run wires (``attrs`` classes, ``torch.utils.data``): ~0.23 s of module code together.
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
    torch_alone = {tag: statistics.median(wall for wall, _, _ in runs[tag, "import torch"]) for tag in trees}
    print("| case | median wall (s) | over its own `import torch` (s) | trainfold modules | fcntl imported |")
    print("|---|---:|---:|---:|---|")
    for (tag, case), samples in runs.items():
        wall = statistics.median(s[0] for s in samples)
        _, modules, fcntl = samples[-1]
        print(f"| {tag}{case} | {wall:.3f} | {wall - torch_alone[tag]:+.3f} | {modules} | {fcntl} |")


if __name__ == "__main__":
    main()
