"""Checkpoints: atomic, verified snapshots of the ``TrainState`` record; sharded storage, policies, the run directory.

``output_dir/checkpoint-{step}/`` holds each tensor once: ``model.safetensors`` (+ ``config.json``) under the
model's ``state_dict`` names, so ``from_pretrained`` loads it (a ``peft`` model: the adapter files);
``state.safetensors``, the rest of the record; ``trainfold.json``, the sidecar: step, cursor, run settings
and identity, every file's size and XXH3-64 hash. Written in a hidden sibling, fsynced, renamed into place;
a resume that finds one damaged sets it aside and takes the previous one. Nothing is pickled.

>>> import tempfile, torch
>>> from trainfold.optim import sgd
>>> from trainfold.core.state import init_state
>>> state = init_state(torch.nn.Linear(2, 1), sgd(0.1), seed=3)
>>> path = save(state, checkpoint_path(tempfile.mkdtemp(), 0))
>>> load(path, like=state).seed.item()
3

Modules: ``sidecar`` (the format), ``layout`` (which tensor goes where), ``tensor_file``, ``writer``,
``reader``, ``listing``, ``sharded`` (DCP), ``policy``, ``run_identity``/``run_lock``/``run_dir`` (a run's
output directory), ``faults`` (crash points for tests).
"""

from trainfold.ckpt.best import BEST_METRIC_KEY
from trainfold.ckpt.layout import model_weights
from trainfold.ckpt.listing import checkpoint_path, is_complete, latest_checkpoint, list_checkpoints, resume_checkpoint
from trainfold.ckpt.policy import SAVE_STRATEGIES
from trainfold.ckpt.reader import FrozenWeightsError, load, load_weights, warm_start
from trainfold.ckpt.sidecar import (
    CONFIG_FILE,
    INCOMPLETE_MARKER,
    MODEL_FILE,
    SHARD_DIR,
    SIDECAR_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointWarning,
    read_metadata,
    validate_sidecar,
)
from trainfold.ckpt.writer import mark_jit, save
from trainfold.core.adapters import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from trainfold.core.fingerprint import fingerprint

__all__ = [
    "STATE_FILE",
    "MODEL_FILE",
    "CONFIG_FILE",
    "SIDECAR_FILE",
    "ADAPTER_FILE",
    "ADAPTER_CONFIG_FILE",
    "INCOMPLETE_MARKER",
    "SHARD_DIR",
    "save",
    "load",
    "load_weights",
    "warm_start",
    "read_metadata",
    "model_weights",
    "fingerprint",
    "checkpoint_path",
    "is_complete",
    "list_checkpoints",
    "latest_checkpoint",
    "resume_checkpoint",
    "mark_jit",
    "validate_sidecar",
    "CheckpointError",
    "CheckpointWarning",
    "FrozenWeightsError",
    "SAVE_STRATEGIES",
    "BEST_METRIC_KEY",
]
