"""A run's identity: the fingerprint of its trajectory (settings not declared ``BOOKKEEPING`` or ``RUN_LENGTH``, the
model's tensors) and its lineage id (drawn at a fresh start, inherited on resume, recorded in every sidecar)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

import attrs

from trainfold.core.tree import flatten
from trainfold.data.global_batch import BATCH_KEYS, global_batch

__all__ = [
    "RUN_FILE",
    "TRAJECTORY",
    "BOOKKEEPING",
    "RUN_LENGTH",
    "SAMPLE_ORDER",
    "RunSettings",
    "RunIdentity",
    "settings_fingerprint",
]

RUN_FILE = "trainfold-run.json"  # in the output_dir: the run that owns it (trainfold.ckpt.run_dir)

# A setting declares what it is for the run's identity on its own attrs field, as ``metadata=``:
TRAJECTORY = "trajectory"  # the metadata key; absent or True: the setting is part of the trajectory
BOOKKEEPING = {TRAJECTORY: False}  # where and how often a run logs, saves, evaluates, loads data: not its states
RUN_LENGTH = {TRAJECTORY: "length"}  # how long it goes on: a run can be continued (HF's larger max_steps)
SAMPLE_ORDER = {TRAJECTORY: "samples"}  # which samples form each step (seed, batch, sampler): no resume changes it


@attrs.frozen
class RunSettings:
    """A run's settings by name, and which of them its record's fields declare outside the trajectory.

    ``of(record)`` reads an attrs record (``TrainingArguments``) generically: every field's value,
    and its ``metadata`` (``BOOKKEEPING``, ``RUN_LENGTH``, ``SAMPLE_ORDER``). The batch enters the
    fingerprint as the global batch (``trainfold.data.global_batch``).

    >>> @attrs.frozen
    ... class Args:
    ...     learning_rate: float = 0.1
    ...     logging_steps: int = attrs.field(default=5, metadata=BOOKKEEPING)
    >>> a, b = RunSettings.of(Args()), RunSettings.of(Args(logging_steps=1))
    >>> a.trajectory(), settings_fingerprint(a) == settings_fingerprint(b)
    ({'learning_rate': 0.1}, True)
    >>> RunSettings.of(Args(0.2)).differences({"learning_rate": 0.1, "logging_steps": 1})
    ['learning_rate: 0.1 there, 0.2 here']
    """

    values: dict[str, Any]
    bookkeeping: frozenset[str] = frozenset()
    length: tuple[str, ...] = ()
    samples: tuple[str, ...] = ()  # the sample-order settings (``SAMPLE_ORDER``) and the extra ones (world size)

    @classmethod
    def of(cls, record: Any, **extra: Any) -> RunSettings:
        """Read ``record``'s settings (an attrs instance), plus ``extra`` ones (``world_size``)."""
        values = record.to_dict() if hasattr(record, "to_dict") else attrs.asdict(record)
        kinds = [(f.name, f.metadata.get(TRAJECTORY)) for f in attrs.fields(type(record))]
        length, samples = ([n for n, k in kinds if k == kind] for kind in ("length", "samples"))
        bookkeeping = frozenset(n for n, k in kinds if k is False)
        return cls({**values, **extra}, bookkeeping, tuple(length), (*samples, *extra))

    def trajectory(self, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Return the trajectory settings of these, or of ``settings`` (another run's, judged by these fields)."""
        values = self.values if settings is None else settings
        return {k: values[k] for k in sorted(values) if k not in self.bookkeeping and k not in self.length}

    def differences(self, there: Mapping[str, Any]) -> list[str]:
        """List every trajectory setting whose value differs between ``there`` (a checkpoint's) and these."""
        a, b = self.trajectory(there), self.trajectory()
        differ = [k for k in sorted(set(a) | set(b)) if a.get(k, "unset") != b.get(k, "unset")]
        return [f"{k}: {a.get(k, 'unset')!r} there, {b.get(k, 'unset')!r} here" for k in differ]


def settings_fingerprint(
    settings: RunSettings, params: Mapping[str, Any] | None = None, buffers: Mapping[str, Any] | None = None
) -> str:
    """Return the hash (16 hex digits) of the trajectory settings (the batch as the global batch) and the model's
    tensors (their names, shapes and dtypes)."""
    values = settings.trajectory()
    if (batch := global_batch(values)) is not None:  # not its split over ranks and accumulation steps
        values = {k: v for k, v in values.items() if k not in BATCH_KEYS} | {"global_train_batch_size": batch}
    tensors = sorted(flatten({"buffers": buffers or {}, "params": params or {}}).items())
    body = {"settings": values, "model": {k: [list(v.shape), str(v.dtype)] for k, v in tensors}}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()[:16]


@attrs.frozen
class RunIdentity:
    """A run's lineage ``id`` and the ``fingerprint`` of its trajectory (``attrs.asdict`` goes into the sidecar).

    >>> attrs.asdict(RunIdentity("ab12", "f00d"))
    {'id': 'ab12', 'fingerprint': 'f00d'}
    """

    id: str
    fingerprint: str

    @classmethod
    def new(cls, fingerprint: str) -> RunIdentity:
        """Draw a fresh lineage id: rank 0's on every rank, through the process group's store (D1: a rank with an
        id of its own would take rank 0's checkpoints for another run's, and begin saves rank 0 never joins)."""
        import torch.distributed as dist

        drawn = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(drawn, fingerprint)
        store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
        key = f"trainfold/run-id/{store.add(f'trainfold/claims/{rank}', 1)}"  # every rank claims in the same order
        if rank == 0:
            store.set(key, drawn)
        return cls(drawn if rank == 0 else store.get(key).decode(), fingerprint)
