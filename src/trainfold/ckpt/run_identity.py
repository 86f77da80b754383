"""A run's identity: the settings that define its trajectory, their fingerprint, and the run's lineage id.

A run is defined by the settings that fix its trajectory (everything in ``TrainingArguments`` but
logging, saving, evaluation, reporting and data-loader plumbing), the world size, and the model's
parameter names, shapes and dtypes: their hash is the run's ``fingerprint``. Two processes with the
same fingerprint are the same run; a restart after a preemption computes the same fingerprint and
so finds its checkpoints. The run ``id`` names a lineage: it is drawn at a fresh start, inherited on
resume, and recorded in every checkpoint's sidecar and in ``output_dir/trainfold-run.json``.

>>> fingerprint({"learning_rate": 0.1, "logging_steps": 5}) == fingerprint({"learning_rate": 0.1, "logging_steps": 1})
True
>>> trajectory_differences({"learning_rate": 0.1, "seed": 1}, {"learning_rate": 0.2, "seed": 1})
['learning_rate: 0.1 there, 0.2 here']
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

import attrs

from trainfold.ckpt.elastic import BATCH_KEYS, global_batch

__all__ = [
    "RUN_FILE",
    "NOT_TRAJECTORY",
    "RUN_LENGTH",
    "RunIdentity",
    "trajectory_settings",
    "trajectory_differences",
    "fingerprint",
    "model_signature",
]

RUN_FILE = "trainfold-run.json"  # in the output_dir: the run that owns it (trainfold.ckpt.run_dir)

# Settings that do not change which states a run goes through: where and how often it logs, saves,
# evaluates and reports, and how the data loader is run. Everything else is in the fingerprint.
NOT_TRAJECTORY = frozenset(
    {
        "output_dir",
        "overwrite_output_dir",
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "logging_nan_inf_filter",
        "report_to",
        "run_name",
        "disable_tqdm",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "save_only_model",
        "enable_jit_checkpoint",
        "eval_strategy",
        "eval_steps",
        "eval_on_start",
        "async_save",
        "save_fsync",
        "save_consolidated_model",
        "fsdp",  # sharded or replicated: the same samples, split otherwise
        "eval_delay",
        "eval_accumulation_steps",
        "per_device_eval_batch_size",
        "prediction_loss_only",
        "metric_for_best_model",
        "greater_is_better",
        "load_best_model_at_end",
        "dataloader_num_workers",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_pin_memory",
        # recomputing activations gives the same gradients bitwise (tests/test_recompute.py): turn it on to fit memory
        "activation_checkpointing",
        "activation_checkpointing_kwargs",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
    }
)

# How long the run goes on: not part of the fingerprint, so a run can be continued for more steps
# (HF's resume with a larger max_steps); a resume that changes it says that the schedule changes.
RUN_LENGTH = ("max_steps", "num_train_epochs")


def trajectory_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Return the settings that define the trajectory (all but ``NOT_TRAJECTORY`` and ``RUN_LENGTH``), by name.

    >>> trajectory_settings({"seed": 3, "save_steps": 10, "learning_rate": 0.1})
    {'learning_rate': 0.1, 'seed': 3}
    """
    return {k: settings[k] for k in sorted(settings) if k not in NOT_TRAJECTORY and k not in RUN_LENGTH}


def trajectory_differences(there: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    """List every trajectory setting whose value differs between two settings dicts."""
    a, b = trajectory_settings(there), trajectory_settings(here)
    return [
        f"{k}: {a.get(k, 'unset')!r} there, {b.get(k, 'unset')!r} here"
        for k in sorted(set(a) | set(b))
        if a.get(k, "unset") != b.get(k, "unset")
    ]


def model_signature(state: Any) -> dict[str, list[Any]]:
    """Return ``{name: [shape, dtype]}`` of a state's params and buffers (part of the fingerprint)."""
    tensors = {
        **{f"buffers.{k}": v for k, v in state.buffers.items()},
        **{f"params.{k}": v for k, v in state.params.items()},
    }
    return {k: [list(v.shape), str(v.dtype)] for k, v in sorted(tensors.items())}


def fingerprint(settings: Mapping[str, Any], model: Mapping[str, Any] | None = None) -> str:
    """Return the hash (16 hex digits) of the trajectory settings and the model signature.

    The batch enters as the global batch (``trainfold.ckpt.elastic``): a run resumed on another number
    of ranks with the same samples per step is the same run.
    """
    body = {"settings": _batch_as_global(trajectory_settings(settings)), "model": dict(model or {})}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _batch_as_global(settings: dict[str, Any]) -> dict[str, Any]:
    batch = global_batch(settings)
    if batch is None:
        return settings
    return {**{k: v for k, v in settings.items() if k not in BATCH_KEYS}, "global_train_batch_size": batch}


@attrs.frozen
class RunIdentity:
    """A run's lineage ``id`` and the ``fingerprint`` of its trajectory; ``as_dict`` goes into the sidecar.

    >>> RunIdentity("ab12", "f00d").as_dict()
    {'id': 'ab12', 'fingerprint': 'f00d'}
    """

    id: str
    fingerprint: str

    @classmethod
    def new(cls, fingerprint: str, *, shared: bool = False) -> RunIdentity:
        """Draw a fresh lineage id for a run with this fingerprint (``shared``: rank 0's, on every rank).

        A run has one lineage: a rank with an id of its own would take rank 0's checkpoints for another
        run's (and begin a collective save rank 0 never joins). The id travels through the process group's store.

        >>> len(RunIdentity.new("f00d", shared=True).id.split("-"))
        3
        """
        drawn = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
        return cls(_rank_zeros(drawn) if shared else drawn, fingerprint)

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "fingerprint": self.fingerprint}


def _rank_zeros(drawn: str) -> str:
    """Return rank 0's ``drawn`` on every rank of the default process group (alone: ``drawn``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return drawn
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    key = f"trainfold/run-id/{store.add(f'trainfold/claims/{rank}', 1)}"  # every rank claims in the same order
    if rank == 0:
        store.set(key, drawn)
        return drawn
    return store.get(key).decode()
