"""What a resume and a rotation read of an output_dir holding many checkpoints: each sidecar once, or twice.

Run: ``.venv/bin/python benchmarks/listing.py [--checkpoints 200] [--rounds 7]``.

``N`` small checkpoints of one run are saved into a temporary output_dir. Each round then asks what
``train`` asks at a start (the checkpoints of this run, newest first: ``run_dir.candidates``) and after a
save (``rotate``), two ways, interleaved ABBA, the minimum of each side reported:

- ``twice``: ``list_checkpoints``, then ``read_metadata`` of each listed checkpoint (what ``run_dir`` and
  ``rotate`` did before ``listing.catalog``): the completeness check reads and validates each sidecar, and
  the caller reads and validates it again;
- ``once``: ``listing.catalog``, the complete checkpoints with the sidecars their check already read.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from trainfold.ckpt import checkpoint_path, list_checkpoints, read_metadata, save
from trainfold.ckpt.listing import catalog
from trainfold.core.state import init_state, scalar
from trainfold.optim import sgd


def _twice(out: str) -> list[tuple[Any, dict[str, Any]]]:
    return [(p, read_metadata(p)) for p in list_checkpoints(out)]


def _time(fn: Callable[[str], Any], out: str) -> float:
    start = time.perf_counter()
    ours = [p for p, m in reversed(fn(out)) if m["run"]["id"] == "bench"]  # candidates
    kept = [p for p, m in fn(out) if not m["jit"]]  # rotate
    assert len(ours) == len(kept)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args()
    out, state = tempfile.mkdtemp(prefix="trainfold-listing-"), init_state(torch.nn.Linear(4, 2), sgd(0.1))
    run = {"id": "bench", "fingerprint": "f"}
    for step in range(1, opts.checkpoints + 1):
        save(attrs.evolve(state, step=scalar(step)), checkpoint_path(out, step), run=run)
    once, twice = [], []
    for _ in range(opts.rounds):  # ABBA
        once.append(_time(catalog, out))
        twice += [_time(_twice, out), _time(_twice, out)]
        once.append(_time(catalog, out))
    a, b = min(once) * 1e3, min(twice) * 1e3
    print(f"{opts.checkpoints} checkpoints: each sidecar read once {a:.1f} ms, twice {b:.1f} ms ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
