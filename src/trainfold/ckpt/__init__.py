"""Checkpoints: atomic snapshots of the ``TrainState`` record; sharded storage, policies, the run directory.

A checkpoint is a directory ``output_dir/checkpoint-{step}/`` holding each tensor once:

- ``model.safetensors`` (+ ``config.json``): the params and persistent buffers under the model's
  ``state_dict`` names, tied weights once, so ``transformers`` ``from_pretrained`` loads the
  directory directly; for a ``peft`` model instead ``adapter_model.safetensors`` +
  ``adapter_config.json``, which ``PeftModel.from_pretrained`` loads (``trainfold.ckpt.adapters``);
- ``state.safetensors``: the rest of the record flattened to dotted keys (``trainfold.core.tree.flatten``):
  optimizer state, counters, seed, cursor, metrics, non-persistent buffers. The frozen base weights
  of a ``peft`` model are in neither file: they are the module's, and the sidecar records a
  fingerprint of each, checked when the checkpoint is loaded into a template;
- ``trainfold.json``: a sidecar with the library version, step, cursor, caller metadata (best
  metric, where the log history stands), the run settings, the run's identity (``run``: its id
  and the fingerprint of the settings that define the trajectory), which state key each weights
  file holds under which name (``tensors``), the frozen tensors' fingerprints (``frozen``), each
  file's size and hash (XXH3-64, computed while the file is written and checked in one streaming
  pass before it is read), and the CRC-32 of the sidecar itself (``checksum``). ``validate_sidecar``
  checks it against its schema; every refusal names the path and the field (``sidecar``).

It is written into a hidden sibling directory that holds ``checkpoint-is-incomplete.txt`` while
files are written; the marker is removed and the directory is renamed into place with
``os.replace``, its files and directories fsynced before the rename (``save``'s default) or after
it in a background thread (``save(..., syncs=atomic.Syncs())``, what ``train`` does: ``writer``).
A resume that finds a checkpoint damaged sets it aside (renamed, never deleted) and resumes the
previous one (``listing.set_aside``). Nothing is pickled and loading never runs code.
Checkpoints of formats 1 to 3 (CRC-32s; in 1 and 2 the whole record in ``state.safetensors``) still load.

>>> import tempfile, torch
>>> from trainfold.optim import sgd
>>> from trainfold.core.state import init_state
>>> state = init_state(torch.nn.Linear(2, 1), sgd(0.1), seed=3)
>>> out = tempfile.mkdtemp()
>>> path = save(state, checkpoint_path(out, 0))
>>> latest_checkpoint(out) == path, load(path, like=state).seed.item()
(True, 3)

The modules: ``sidecar`` (the format, its file names and schema), ``layout`` (which tensor goes to
which file), ``atomic`` (fsync, directory rename), ``writer`` (``save``, ``mark_jit``),
``reader`` (``load``, ``load_weights``, ``warm_start``), ``listing`` (finding complete checkpoints),
``tensor_file`` (safetensors files and their hashes), ``sharded`` (every rank writes its shards),
``policy`` (when to save, what to keep, the best one),
``run_identity``, ``run_lock`` and ``run_dir`` (the output directory of a run), ``elastic`` (the
batch split on another number of ranks), ``preempt`` (signals and the JIT checkpoint), ``faults``
(crash points for tests).
"""

from trainfold.ckpt.adapters import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from trainfold.ckpt.layout import fingerprint, model_weights
from trainfold.ckpt.listing import checkpoint_path, is_complete, latest_checkpoint, list_checkpoints, resume_checkpoint
from trainfold.ckpt.policy import SAVE_STRATEGIES
from trainfold.ckpt.reader import FrozenWeightsError, load, load_weights, warm_start
from trainfold.ckpt.run_dir import elastic_args
from trainfold.ckpt.sidecar import (
    CONFIG_FILE,
    DURABLE_MARKER,
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
from trainfold.evaluation.best import BEST_METRIC_KEY

__all__ = [
    "STATE_FILE",
    "MODEL_FILE",
    "CONFIG_FILE",
    "SIDECAR_FILE",
    "ADAPTER_FILE",
    "ADAPTER_CONFIG_FILE",
    "DURABLE_MARKER",
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
    "elastic_args",
]
