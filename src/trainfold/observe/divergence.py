"""Divergence: a run whose parameters turned inf or NaN, told apart from a step that was only skipped; and
where two runs of one configuration part ways (:func:`state_hash`, :func:`hash_log`, :func:`first_hash_divergence`).

A float16 step whose gradients overflow reports an inf loss or grad norm, but loss scaling skips
its update, so the parameters stay finite: that is not divergence. A run has diverged when its
*parameters* are no longer finite. The check is cheap on the common path: the loss and grad norm a
step already reports are looked at first, and the parameters only when one of them is not finite
(or when the caller is about to write them, ``confirm=True``).

>>> import attrs, torch
>>> from trainfold.core.state import TrainState
>>> ok = TrainState(params={"w": torch.ones(2)}, buffers={}, opt_state=None)
>>> skipped = attrs.evolve(ok, metrics={**ok.metrics, "loss": torch.tensor(float("inf"))})
>>> diverged(ok), diverged(skipped)                      # a skipped float16 step keeps finite params
(False, False)
>>> broken = attrs.evolve(skipped, params={"w": torch.tensor([1.0, float("nan")])})
>>> diverged(broken), nonfinite_params(broken.params)
(True, ['w'])
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainfold.core.state import TrainState, sample_certificate
from trainfold.core.tree import flatten

__all__ = [
    "DIVERGED",
    "EXIT_DIVERGED",
    "HASH_FILE",
    "diverged",
    "nonfinite_params",
    "divergence_message",
    "first_hash_divergence",
    "first_sample_divergence",
    "hash_log",
    "read_hashes",
    "state_hash",
]

HASH_FILE = "state_hashes.jsonl"  # one {"step", "state_hash", "loss"} line per logged step, in output_dir

DIVERGED = "diverged"  # the status of a run stopped because its parameters are no longer finite
EXIT_DIVERGED = 3  # the exit status of ``python -m trainfold.cli train`` for such a run (a failure, not to be retried)


def nonfinite_params(params: Mapping[str, Tensor]) -> list[str]:
    """Return the names of the tensors in ``params`` that hold an inf or NaN (one reduction per tensor).

    >>> nonfinite_params({"a": torch.zeros(2), "b": torch.tensor([float("inf")])})
    ['b']
    """
    return [name for name, t in params.items() if t.is_floating_point() and not _finite(t.detach())]


def _finite(t: Tensor) -> bool:
    # Any inf/NaN element makes the float32 sum inf/NaN, so a finite sum settles it in one reduction (5x faster
    # than isfinite(t).all() on CPU); only a sum that overflows from finite values needs the exact check.
    # A DTensor shard's reductions are partial: reduced over every rank, so all ranks agree (trainfold.step.fsdp).
    return math.isfinite(float(_whole(torch.sum(t, dtype=torch.float32)))) or bool(_whole(torch.isfinite(t).all()))


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _metrics_finite(state: TrainState) -> bool:
    return all(math.isfinite(float(state.metrics[k])) for k in ("loss", "grad_norm") if k in state.metrics)


def diverged(state: TrainState, *, confirm: bool = False) -> bool:
    """Say whether ``state``'s parameters are no longer finite.

    Without ``confirm`` the parameters are only read when the step's loss or grad norm is not
    finite (a parameter that overflows shows up in the next step's loss); with ``confirm`` (before a
    checkpoint is written, at the end of a run) they are always read.

    >>> from trainfold.core.state import TrainState
    >>> quiet = TrainState(params={"w": torch.tensor([float("nan")])}, buffers={}, opt_state=None)
    >>> diverged(quiet), diverged(quiet, confirm=True)     # finite metrics: the params are not read
    (False, True)
    """
    if not confirm and _metrics_finite(state):
        return False
    return bool(nonfinite_params(state.params))


def divergence_message(state: TrainState, last_checkpoint: object = None) -> str:
    """Return the warning for a run that diverged at ``state``'s step: where, which tensors, what is kept.

    >>> from trainfold.core.state import TrainState, scalar
    >>> s = TrainState(params={"w": torch.tensor([float("nan")])}, buffers={}, opt_state=None, step=scalar(7))
    >>> print(*divergence_message(s, "out/checkpoint-5").split("; "), sep="\\n")
    training diverged at step 7: parameters inf/NaN after the update (w)
    stopped without saving them
    the last finite checkpoint is out/checkpoint-5
    """
    names = nonfinite_params(state.params)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    kept = f"the last finite checkpoint is {last_checkpoint}"
    if not last_checkpoint:
        kept = "no checkpoint was saved in this run"
    return (
        f"training diverged at step {int(state.step)}: parameters inf/NaN after the update ({shown}); "
        f"stopped without saving them; {kept}"
    )


# -- where two runs part ways -------------------------------------------------------------------------


def state_hash(state: TrainState, samples: int = 256, *, optimizer: bool = False) -> str:
    """Return a 16-hex-digit fingerprint of ``state``: its counters, cursor and a sample of its tensors' bits.

    Of each param and buffer (and, with ``optimizer=True``, each optimizer-state tensor), at most
    ``samples`` elements evenly spaced over it are hashed (all of a small tensor), bit for bit, with
    the step, the seed and the cursor: two states that differ in any hashed bit hash differently. A
    difference confined to unsampled elements or to the optimizer state shows one update later, when
    the dense update has spread it over the params. The cost is one strided view per tensor and one
    copy to the host per dtype: about 1% of a 3M-parameter TinyLM step on a CPU (``benchmarks/state_hash.py``).

    >>> from trainfold.core.state import TrainState, scalar
    >>> s = TrainState(params={"w": torch.arange(6.0)}, buffers={}, opt_state=None)
    >>> state_hash(s) == state_hash(TrainState(params={"w": torch.arange(6.0)}, buffers={}, opt_state=None))
    True
    >>> state_hash(s) == state_hash(TrainState(params={"w": torch.arange(6.0) + 1e-7}, buffers={}, opt_state=None))
    False
    """
    record = {"params": state.params, "buffers": state.buffers}
    if optimizer:
        record["opt_state"] = state.opt_state
    tensors = [*flatten(record).values(), state.step, state.seed, state.cursor.epoch, state.cursor.position]
    grouped: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:  # bit patterns, grouped by device and dtype: one concatenation and one host copy each
        grouped.setdefault((t.device, t.dtype), []).append(_sample(t.detach(), samples))
    digest = hashlib.blake2b(digest_size=8)
    for chunks in grouped.values():
        digest.update(torch.cat(chunks).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _sample(t: Tensor, k: int) -> Tensor:
    """Return at most ``k`` elements of ``t`` evenly spaced over it, as a 1-d view where it can be one."""
    n = t.numel()
    if n > k and t.is_contiguous():
        return t.as_strided((k,), (n // k,), t.storage_offset())
    return t.reshape(-1)[:: max(1, n // k)][:k]


def hash_log(output_dir: str | os.PathLike, samples: int = 256) -> Callable[[TrainState, Mapping[str, Any]], None]:
    """Return an observer for ``train(observers=[...])`` that appends each logged step's :func:`state_hash`.

    Each training log (an entry with a ``loss``) adds ``{"step", "state_hash", "loss"}`` to
    ``output_dir/state_hashes.jsonl``; with ``logging_steps=1`` that is every step.
    :func:`first_hash_divergence` compares two such files.

    >>> import tempfile
    >>> from trainfold.core.state import TrainState
    >>> out = tempfile.mkdtemp()
    >>> hash_log(out)(TrainState(params={"w": torch.ones(2)}, buffers={}, opt_state=None), {"loss": 0.5, "step": 0})
    >>> [sorted(e) for e in read_hashes(out).values()]
    [['loss', 'state_hash', 'step']]
    """
    path = Path(output_dir) / HASH_FILE

    def observe(state: TrainState, entry: Mapping[str, Any]) -> None:
        if "loss" not in entry:  # evaluations and the summary
            return
        line = {"step": int(state.step), "state_hash": state_hash(state, samples), "loss": entry["loss"]}
        certificate = sample_certificate(state.cursor)  # a streaming source's rolling hash of its steps' sample ids
        if certificate is not None:
            line["samples"] = certificate
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    return observe


def read_hashes(output_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Return ``{step: entry}`` of ``output_dir``'s hash log (the last entry of a step wins: a resumed run's)."""
    path = Path(output_dir) / HASH_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: train with observers=[trainfold.observe.divergence.hash_log(output_dir)]"
        )
    entries = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {int(e["step"]): e for e in entries}


def first_hash_divergence(run_a: str | os.PathLike, run_b: str | os.PathLike) -> tuple[int | None, int | None]:
    """Return ``(first, last_agreed)``: the first step both runs hashed where the hashes differ, and the step before it
    where they last agreed (``None`` when there is none); ``first`` is ``None`` if every common step agrees.

    >>> import tempfile
    >>> from trainfold.core.state import TrainState, scalar
    >>> a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> for step in (1, 2, 3):
    ...     for out, w in ((a, 1.0), (b, 1.0 if step < 3 else 2.0)):
    ...         s = TrainState(params={"w": torch.full((2,), w)}, buffers={}, opt_state=None, step=scalar(step))
    ...         hash_log(out)(s, {"loss": 0.1})
    >>> first_hash_divergence(a, b)
    (3, 2)
    """
    ha, hb = read_hashes(run_a), read_hashes(run_b)
    last = None
    for step in sorted(ha.keys() & hb.keys()):
        if ha[step]["state_hash"] != hb[step]["state_hash"]:
            return step, last
        last = step
    return None, last


def first_sample_divergence(run_a: str | os.PathLike, run_b: str | os.PathLike) -> tuple[int | None, int | None]:
    """Return ``(first, last_agreed)`` as :func:`first_hash_divergence` does, for the steps' sample certificates
    (``trainfold.core.state.sample_certificate``: runs on streaming sources), ``(None, None)`` when either log
    has none: the first logged step whose rolling hash of sample ids differs, i.e. whose rows differ."""
    ha, hb = read_hashes(run_a), read_hashes(run_b)
    last = None
    for step in sorted(ha.keys() & hb.keys()):
        if "samples" not in ha[step] or "samples" not in hb[step]:
            return None, None
        if ha[step]["samples"] != hb[step]["samples"]:
            return step, last
        last = step
    return None, last
