"""Checkpoints: atomic snapshots of the ``TrainState`` record (the policy is in ``checkpoint_policy``).

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
  file's size and CRC-32 (computed while the file is written, and checked while it is read), and the
  CRC-32 of the sidecar itself (``checksum``). ``validate_sidecar`` checks it against its schema;
  every refusal names the path and the field.

It is written into a hidden sibling directory that holds ``checkpoint-is-incomplete.txt`` while
files are written; files and directories are fsynced, the marker is removed, and the directory is
renamed into place (swapped in atomically with ``renameat2(RENAME_EXCHANGE)`` when one is already
there, so some complete checkpoint is always visible). Nothing is pickled and loading never runs code.
Checkpoints of formats 1 and 2 (the whole record in ``state.safetensors``) still load.

>>> import tempfile, torch
>>> from trainfold.optim.base import sgd
>>> from trainfold.core.state import init_state
>>> state = init_state(torch.nn.Linear(2, 1), sgd(0.1), seed=3)
>>> out = tempfile.mkdtemp()
>>> path = save(state, checkpoint_path(out, 0))
>>> latest_checkpoint(out) == path, load(path, like=state).seed.item()
(True, 3)
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import warnings
import zlib
from collections.abc import Callable, Mapping
from importlib import metadata as _metadata
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from torch import Tensor, nn

from trainfold.ckpt import adapters, tensor_file
from trainfold.ckpt.adapters import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from trainfold.core.state import TrainState
from trainfold.core.tree import Tree, flatten, unflatten

__all__ = [
    "STATE_FILE",
    "MODEL_FILE",
    "CONFIG_FILE",
    "SIDECAR_FILE",
    "ADAPTER_FILE",
    "ADAPTER_CONFIG_FILE",
    "INCOMPLETE_MARKER",
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
]

STATE_FILE = "state.safetensors"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SIDECAR_FILE = "trainfold.json"
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
_SHARDED_INDEX = "state.index.json"  # trainfold.ckpt.sharded.INDEX_FILE
_FORMAT = "trainfold-checkpoint"
_FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)  # 1: no run identity, no checksum; 1 and 2: every tensor in state.safetensors
_NAME = re.compile(r"^checkpoint-(\d+)$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
MAX_STEP = 2**53  # a step beyond it is not a count of optimizer steps

# Tests set this to a function of a label ("replace:exchanged", "rotate:renamed", ...) to crash a
# writer at each point of a save, a rotation or a replace in turn. None in normal use.
fault_hook: Callable[[str], None] | None = None


def _point(label: str) -> None:
    if fault_hook is not None:
        fault_hook(label)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the path, the field and what to do."""


class CheckpointWarning(UserWarning):
    """A directory named like a checkpoint that ``list_checkpoints`` skipped, and why."""


def _version() -> str:
    try:
        return _metadata.version("trainfold")
    except _metadata.PackageNotFoundError:
        return "unknown"


# -- writing --------------------------------------------------------------------------------------


def checkpoint_path(output_dir: str | os.PathLike, step: int) -> Path:
    """Return ``output_dir/checkpoint-{step}``.

    >>> checkpoint_path("out", 12).as_posix()
    'out/checkpoint-12'
    """
    return Path(output_dir) / f"checkpoint-{int(step)}"


def _state_keys(state: TrainState, model: nn.Module | None) -> dict[str, str]:
    """Return ``{state_dict name: flattened state key}`` of ``model``'s weights, each tied tensor once."""
    if model is None:
        return {**{k: f"buffers.{k}" for k in state.buffers}, **{k: f"params.{k}" for k in state.params}}
    source = {id(b): n for n, b in model.named_buffers()} | {id(p): n for n, p in model.named_parameters()}
    out: dict[str, str] = {}
    done: set[str] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        name = source.get(id(value), key)
        if name in done:
            continue  # a tied alias: saved once, under its first name
        if name in state.params:
            out[key] = f"params.{name}"
        elif name in state.buffers:
            out[key] = f"buffers.{name}"
        else:
            raise KeyError(
                f"the model's {key!r} is not in the state (params and buffers); pass the model the "
                "state was made from (init_state(model, ...))"
            )
        done.add(name)
    return out


def _tensor_at(state: TrainState, key: str) -> Tensor:
    field, name = key.split(".", 1)
    return (state.params if field == "params" else state.buffers)[name]


def model_weights(state: TrainState, model: nn.Module | None = None) -> Tree:
    """Return the state's weights under ``model``'s ``state_dict`` names, each tied tensor once.

    Non-persistent buffers are left out, as ``state_dict`` leaves them out. Without ``model`` the
    state's own names are used (params, then all buffers).

    >>> import torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state
    >>> m = torch.nn.BatchNorm1d(2)
    >>> sorted(model_weights(init_state(m, sgd(0.1)), m))
    ['bias', 'num_batches_tracked', 'running_mean', 'running_var', 'weight']
    """
    return {name: _tensor_at(state, key) for name, key in _state_keys(state, model).items()}


_SAMPLES = 1024


def _as_words(t: Tensor) -> tuple[Tensor, Tensor]:
    """Return a tensor's bytes as int32 words, and the 0-3 bytes left over (uint8)."""
    data = t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    n = data.numel() // 4 * 4
    try:
        words = data[:n].view(torch.int32)
    except RuntimeError:  # a view that does not start on a 4-byte boundary
        words = data[:n].clone().view(torch.int32)
    return words, data[n:]


def fingerprint(t: Tensor) -> str:
    """Return a cheap fingerprint of a tensor's dtype, shape and bytes, the same on every device.

    The sum (modulo 2**32, so exact in any order) of its bytes read as int32 words, and the CRC-32
    of up to 1024 evenly spaced words: one pass over the tensor on its own device (about 1 GB/s on
    one CPU core; a GPU's memory bandwidth), nothing copied to the CPU but the sample. It tells apart the frozen weights of
    another base model, another seed or another checkpoint.

    >>> import torch
    >>> fingerprint(torch.ones(3))
    'float32[3]:-1098907648:dc7c4e94'
    >>> fingerprint(torch.ones(3)) == fingerprint(torch.tensor([1.0, 1.0, 1.0 + 2**-23]))
    False
    """
    words, tail = _as_words(t)
    if words.device.type == "cpu":  # numpy: one thread, no thread-pool wake-up per tensor; it wraps the same
        total = int(words.numpy().sum(dtype=np.int32)) if words.numel() else 0
    else:
        total = int(words.sum(dtype=torch.int32)) if words.numel() else 0
    k = min(words.numel(), _SAMPLES)
    picks = torch.arange(k, device=words.device) * max(words.numel() - 1, 0) // max(k - 1, 1)
    sample = torch.cat([words[picks].cpu().view(torch.uint8), tail.cpu()])
    crc = zlib.crc32(sample.numpy().tobytes())
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{total}:{crc:08x}".replace(" ", "")


@attrs.frozen
class _Layout:
    """Where each tensor of a state goes: a weights file (under its names), the state file, or nowhere (frozen)."""

    weights_file: str
    weights: dict[str, str]  # flattened state key -> key in weights_file
    frozen: tuple[str, ...]  # flattened state keys of frozen base weights, written nowhere
    config_file: str | None
    config_text: str | None


def _layout(state: TrainState, model: nn.Module | None, config: Any) -> _Layout:
    keys = _state_keys(state, model)
    if not adapters.is_peft_model(model):
        if config is None and model is not None:
            config = getattr(model, "config", None)
        text = _config_text(config)
        return _Layout(MODEL_FILE, {v: k for k, v in keys.items()}, (), None if text is None else CONFIG_FILE, text)
    chosen = adapters.adapter_keys(model, {k: _tensor_at(state, v) for k, v in keys.items()})
    weights = {keys[k]: v for k, v in chosen.items()}
    frozen = tuple(
        f"buffers.{n}"
        for n in adapters.frozen_parameters(model)
        if f"buffers.{n}" not in weights and n in state.buffers
    )
    if config is not None:
        raise ValueError(
            "config= was given for a peft model: its checkpoint holds adapter_config.json (the adapter's "
            "config, from the model), not a config.json; leave config unset"
        )
    return _Layout(ADAPTER_FILE, weights, frozen, ADAPTER_CONFIG_FILE, adapters.adapter_config_text(model))


def _config_text(config: Any) -> str | None:
    if config is None:
        return None
    if hasattr(config, "to_json_string"):
        return config.to_json_string()
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, Mapping):
        return json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    raise TypeError(
        f"config of type {type(config).__name__} cannot be written as config.json: pass a dict, "
        "or an object with to_dict() or to_json_string() (e.g. a transformers PretrainedConfig)"
    )


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _check_json(value: Any, what: str) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable (plain numbers, strings, lists, dicts): {e}") from None


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where it is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replace_dir(tmp: Path, directory: Path) -> None:
    """Put ``tmp`` at ``directory``; an existing ``directory`` stays visible until the new one is there."""
    if not directory.exists():
        os.rename(tmp, directory)
        _point("replace:renamed")
        return
    if _exchange(tmp, directory):  # the old checkpoint is now at tmp's hidden name
        _point("replace:exchanged")
        shutil.rmtree(tmp, ignore_errors=True)
        _point("replace:removed")
        return
    old = directory.parent / f".{directory.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(directory, old)  # no atomic swap here: a crash before the next rename leaves only .old-
    _point("replace:moved-aside")
    os.rename(tmp, directory)
    _point("replace:renamed")
    shutil.rmtree(old, ignore_errors=True)
    _point("replace:removed")


def _check_run(run: Mapping[str, Any] | None) -> dict[str, str] | None:
    if run is None:
        return None
    if (
        not isinstance(run, Mapping)
        or sorted(run) != ["fingerprint", "id"]
        or not all(isinstance(v, str) and v for v in run.values())
    ):
        raise TypeError(f"run must be {{'id': str, 'fingerprint': str}} (see trainfold.ckpt.run_dir), got {run!r}")
    return {"id": run["id"], "fingerprint": run["fingerprint"]}


def _checksum(sidecar: Mapping[str, Any]) -> int:
    body = {k: v for k, v in sidecar.items() if k != "checksum"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _sidecar_bytes(sidecar: Mapping[str, Any]) -> bytes:
    sidecar = {**{k: v for k, v in sidecar.items() if k != "checksum"}, "checksum": _checksum(sidecar)}
    return (json.dumps(sidecar, indent=2) + "\n").encode()


def mark_jit(directory: str | os.PathLike) -> Path:
    """Mark the complete checkpoint ``directory`` as the JIT one, in place; return its path.

    Only the sidecar changes (``"jit": true``), replaced atomically: the tensors are not written
    again, and ``directory`` is a complete checkpoint at every moment.

    >>> import tempfile, torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state
    >>> path = save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp() + "/checkpoint-0")
    >>> read_metadata(mark_jit(path))["jit"], is_complete(path)
    (True, True)
    """
    directory = Path(directory)
    meta = read_metadata(directory)
    if meta.get("jit"):
        return directory
    tmp = directory / f".{SIDECAR_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    _write_bytes(tmp, _sidecar_bytes({**meta, "jit": True}))
    _point("mark_jit:wrote")
    os.replace(tmp, directory / SIDECAR_FILE)
    _point("mark_jit:replaced")
    _fsync_dir(directory)
    return directory


def save(
    state: TrainState,
    directory: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    config: Any = None,
    metadata: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    save_only_model: bool = False,
    jit: bool = False,
    run: Mapping[str, str] | None = None,
    on_file: Callable[[Path], None] | None = None,
    tensors: Callable[[Path], Mapping[str, dict[str, int]]] | None = None,
) -> Path:
    """Write ``state`` to ``directory`` atomically and return the directory's path.

    Each tensor is written once: the params and persistent buffers to ``model.safetensors``, under
    ``model``'s ``state_dict`` names (the state's own without ``model``), the rest of the record to
    ``state.safetensors``; for a ``peft`` model the adapter goes to ``adapter_model.safetensors`` (+
    ``adapter_config.json``) and its frozen base weights nowhere (their fingerprints to the sidecar).
    ``model`` also gives its ``config`` when ``config`` is not given; ``config`` (dict, or object with
    ``to_dict``/``to_json_string``)
    becomes ``config.json``. ``metadata`` (best metric, log history, ...) and ``settings`` (the
    run settings, checked on resume by ``check_compatible``) go into the JSON sidecar, with ``run``
    (``{"id": ..., "fingerprint": ...}``, see ``trainfold.ckpt.run_dir``): which run wrote it.
    ``save_only_model`` writes the weights but not the record. ``jit`` marks an emergency
    checkpoint that ``rotate`` never deletes. ``on_file(path)`` is called after each file is
    written (progress reports; tests use it to crash mid-save). An existing ``directory`` is
    replaced by swapping the new one in atomically (``renameat2(RENAME_EXCHANGE)``), then deleting
    the old one; there is no moment without a complete ``directory``. Call it on one rank only.
    ``tensors(tmp)`` replaces the two tensor files: it writes its own into ``tmp`` and returns their
    ``{name: {"bytes", "crc32"}}`` (``trainfold.ckpt.sharded``, where every rank writes shards).

    >>> import tempfile, torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state
    >>> model = torch.nn.Linear(2, 1)
    >>> out = tempfile.mkdtemp()
    >>> path = save(init_state(model, sgd(0.1)), checkpoint_path(out, 7), model=model, metadata={"note": "hi"})
    >>> path.name, sorted(p.name for p in path.iterdir()), read_metadata(path)["metadata"]["note"]
    ('checkpoint-7', ['model.safetensors', 'state.safetensors', 'trainfold.json'], 'hi')
    """
    directory = Path(directory)
    metadata, settings = dict(metadata or {}), dict(settings or {})
    _check_json(metadata, "save metadata")
    _check_json(settings, "save settings")
    run = _check_run(run)
    layout = _layout(state, model, config)
    flat = flatten(state)
    frozen = {k: fingerprint(flat[k]) for k in layout.frozen}
    rest = {k: v for k, v in flat.items() if k not in layout.weights and k not in frozen}
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    _point("save:started")
    try:
        marker = tmp / INCOMPLETE_MARKER
        _write_bytes(marker, b"trainfold is writing this checkpoint; if this file remains, the write failed.\n")
        files: dict[str, dict[str, int]] = {}

        def record(name: str, size: int, crc: int) -> None:
            files[name] = {"bytes": size, "crc32": crc}
            if on_file is not None:
                on_file(tmp / name)
            _point(f"save:wrote:{name}")

        if tensors is not None:  # a sharded state: every rank's shards and their index
            files.update(tensors(tmp))
        else:
            if not save_only_model:
                record(STATE_FILE, *tensor_file.write(tmp / STATE_FILE, rest, metadata={"format": "pt"}))
            weights = {name: flat[key] for key, name in layout.weights.items()}
            record(
                layout.weights_file, *tensor_file.write(tmp / layout.weights_file, weights, metadata={"format": "pt"})
            )
        if layout.config_text is not None:
            data = layout.config_text.encode()
            _write_bytes(tmp / layout.config_file, data)
            record(layout.config_file, len(data), zlib.crc32(data))
        epoch, position = (int(state.cursor.epoch), int(state.cursor.position))
        sidecar = {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "library_version": _version(),
            "step": int(state.step),
            "epoch": epoch,
            "cursor": {"epoch": epoch, "position": position},
            "save_only_model": bool(save_only_model),
            "jit": bool(jit),
            "metadata": metadata,
            "settings": settings,
            "run": run,
            "tensors": {layout.weights_file: layout.weights} if tensors is None else {},  # sharded: the index
            "frozen": frozen if tensors is None else {},
            "files": files,
        }
        _write_bytes(tmp / SIDECAR_FILE, _sidecar_bytes(sidecar))
        _point("save:wrote:sidecar")
        marker.unlink()
        _fsync_dir(tmp)
        _point("save:complete")
        _replace_dir(tmp, directory)
        _fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# -- reading --------------------------------------------------------------------------------------

_FIX = "the sidecar is damaged or was not written by trainfold; resume from another checkpoint"
_TOP = {
    "format",
    "format_version",
    "library_version",
    "step",
    "epoch",
    "cursor",
    "save_only_model",
    "jit",
    "metadata",
    "settings",
    "run",
    "tensors",
    "frozen",
    "files",
    "checksum",
}
_SINCE = {"run": 2, "checksum": 2, "tensors": 3, "frozen": 3}  # fields a format before these lacks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(path: Path, field: str, problem: str, fix: str = _FIX) -> CheckpointError:
    return CheckpointError(f"{path}: field {field!r} {problem}; {fix}")


def _count(path: Path, field: str, value: Any, top: int) -> None:
    if not _is_int(value) or not 0 <= value <= top:
        raise _bad(path, field, f"must be an int in [0, {top}], got {value!r}")


def validate_sidecar(meta: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Return ``meta`` (a parsed ``trainfold.json``) if it fits the schema, else raise ``CheckpointError``.

    Checked: every field is present with its type and no other is; steps and cursor are counts
    (``0 <= step <= MAX_STEP``); ``tensors`` maps each weights file to ``{state key: file key}``, no
    key in two files; ``frozen`` maps state keys to fingerprints; ``files`` lists every weights file
    (and ``state.safetensors`` unless weights only), each with ``bytes`` and ``crc32``; ``checksum`` is
    the CRC-32 of the rest. Formats 1 and 2 (every tensor in ``state.safetensors``, the weights again
    in ``model.safetensors``; format 1 without ``run`` and ``checksum``) are still read. The message
    names the path and field.

    >>> import tempfile, torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state
    >>> meta = read_metadata(save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp() + "/c"))
    >>> validate_sidecar({**meta, "files": {}}, "c/trainfold.json")
    Traceback (most recent call last):
    ...
    trainfold.ckpt.checkpoint.CheckpointError: c/trainfold.json: field 'files.state.safetensors' is missing: every tensor file must be listed with its size and CRC; the sidecar is damaged or was not written by trainfold; resume from another checkpoint
    """
    path = Path(path)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f'{path} is not a trainfold checkpoint sidecar (no "format": "{_FORMAT}")')
    version = meta.get("format_version")
    if not _is_int(version) or version < 1:
        raise _bad(path, "format_version", f"must be a positive int, got {version!r}")
    if version > _FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version}, written by trainfold {meta.get('library_version')}; "
            f"this trainfold reads format {_FORMAT_VERSION}: upgrade trainfold"
        )
    required = {name for name in _TOP if version >= _SINCE.get(name, 1)}
    for name in sorted(required):
        if name not in meta:
            raise _bad(path, name, "is missing")
    extra = sorted(set(meta) - required)
    if extra:
        raise _bad(path, extra[0], "is not a field of the checkpoint format")
    types = {
        "library_version": str,
        "save_only_model": bool,
        "jit": bool,
        "metadata": dict,
        "settings": dict,
        "cursor": dict,
        "files": dict,
    }
    for name, kind in types.items():
        if not isinstance(meta[name], kind):
            raise _bad(path, name, f"must be a {kind.__name__}, got {type(meta[name]).__name__} {meta[name]!r:.60}")
    _count(path, "step", meta["step"], MAX_STEP)
    cursor = meta["cursor"]
    if sorted(cursor) != ["epoch", "position"]:
        raise _bad(path, "cursor", f"must hold exactly 'epoch' and 'position', got {sorted(cursor)}")
    _count(path, "cursor.epoch", cursor["epoch"], MAX_STEP)
    _count(path, "cursor.position", cursor["position"], MAX_STEP)
    if meta["epoch"] != cursor["epoch"] or not _is_int(meta["epoch"]):
        raise _bad(path, "epoch", f"must equal cursor.epoch ({cursor['epoch']}), got {meta['epoch']!r}")
    files = meta["files"]
    tensors = meta.get("tensors", {MODEL_FILE: {}})
    if not isinstance(tensors, dict) or not all(isinstance(v, dict) for v in tensors.values()):
        raise _bad(path, "tensors", f"must map file names to {{state key: file key}}, got {tensors!r:.60}")
    needed = [*([] if meta["save_only_model"] else [STATE_FILE]), *tensors]
    if _SHARDED_INDEX in files:  # trainfold.ckpt.sharded: the index, model.safetensors on request
        needed = [_SHARDED_INDEX, *([MODEL_FILE] if meta["save_only_model"] else [])]
    for name in needed:
        if name not in files:
            raise _bad(path, f"files.{name}", "is missing: every tensor file must be listed with its size and CRC")
    seen: set[str] = set()
    for name, keys in tensors.items():
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            raise _bad(path, f"tensors.{name}", f"must map state keys to file keys (strings), got {keys!r:.60}")
        if seen & set(keys):
            raise _bad(path, f"tensors.{name}", f"holds {sorted(seen & set(keys))[:3]}, which another file holds")
        seen |= set(keys)
    frozen = meta.get("frozen", {})
    if not isinstance(frozen, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in frozen.items()):
        raise _bad(path, "frozen", f"must map state keys to fingerprints (strings), got {frozen!r:.60}")
    for name, entry in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name):
            raise _bad(path, "files", f"names {name!r}, which is not a plain file name")
        if not isinstance(entry, dict) or sorted(entry) != ["bytes", "crc32"]:
            raise _bad(path, f"files.{name}", f"must be {{'bytes': int, 'crc32': int}}, got {entry!r:.60}")
        _count(path, f"files.{name}.bytes", entry["bytes"], 2**62)
        _count(path, f"files.{name}.crc32", entry["crc32"], 2**32 - 1)
    if version >= 2:
        run = meta["run"]
        if run is not None and (
            not isinstance(run, dict)
            or sorted(run) != ["fingerprint", "id"]
            or not all(isinstance(v, str) and v for v in run.values())
        ):
            raise _bad(path, "run", f"must be null or {{'id': str, 'fingerprint': str}}, got {run!r:.80}")
        if not _is_int(meta["checksum"]) or meta["checksum"] != _checksum(meta):
            raise _bad(path, "checksum", "does not match the sidecar's content (it was altered or damaged)")
    return meta


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Return the checkpoint's JSON sidecar (step, cursor, metadata, settings, run, files), validated.

    Raises ``FileNotFoundError`` or ``CheckpointError`` (a ``ValueError``) naming the path (and
    the field) when it is missing, unreadable or does not fit the schema (``validate_sidecar``).

    >>> import tempfile, torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state
    >>> state = init_state(torch.nn.Linear(2, 1), sgd(0.1))
    >>> meta = read_metadata(save(state, tempfile.mkdtemp() + "/c", metadata={"best_metric": 0.25}))
    >>> meta["step"], meta["cursor"], meta["metadata"], sorted(meta["files"])
    (0, {'epoch': 0, 'position': 0}, {'best_metric': 0.25}, ['model.safetensors', 'state.safetensors'])
    """
    directory = Path(directory)
    path = directory / SIDECAR_FILE
    if (directory / INCOMPLETE_MARKER).exists():
        raise CheckpointError(
            f"{directory} is an incomplete checkpoint ({INCOMPLETE_MARKER} is present: its write was "
            "interrupted); resume from latest_checkpoint(output_dir) instead"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {directory} is not a complete trainfold checkpoint; "
            "resume from latest_checkpoint(output_dir) instead"
        )
    try:
        meta = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupted (not valid JSON: {e}); resume from an earlier checkpoint") from None
    return validate_sidecar(meta, path)


def _read_tensors(directory: Path, name: str, meta: Mapping[str, Any]) -> Tree:
    path = directory / name
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symbolic link; a checkpoint's files must be its own; copy the file in")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; the checkpoint is incomplete or was altered; "
            "resume from latest_checkpoint(output_dir) instead"
        )
    size = path.stat().st_size
    expected = meta["files"].get(name)
    if expected is None:
        raise _bad(directory / SIDECAR_FILE, f"files.{name}", "is missing: the file cannot be checked")
    if size != expected["bytes"]:
        raise CheckpointError(
            f"{path} is truncated or altered: it has {size} bytes, {SIDECAR_FILE} records "
            f"{expected['bytes']}; resume from an earlier checkpoint"
        )
    try:
        return tensor_file.read(path, crc32=expected["crc32"])
    except tensor_file.TensorFileError as e:
        raise CheckpointError(f"{e} (the CRC-32 {SIDECAR_FILE} records); resume from an earlier checkpoint") from None


def _fit(flat: Mapping[str, Tensor], like: Any, path: Path, note: str = "") -> Any:
    try:
        return unflatten(flat, like=like)
    except KeyError as e:
        raise KeyError(
            f"{path} does not fit the template state{note}; was it saved from a different model or "
            f"optimizer? {e.args[0]}"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path} does not fit the template state{note} (a different model size?): {e}") from None


def _frozen(directory: Path, meta: Mapping[str, Any], like: TrainState) -> Tree:
    """Return the template's frozen tensors the checkpoint left out, after checking their fingerprints."""
    if not meta.get("frozen"):
        return {}
    mine = {
        **{f"buffers.{k}": v for k, v in like.buffers.items()},
        **{f"params.{k}": v for k, v in like.params.items()},
    }
    absent = sorted(k for k in meta["frozen"] if k not in mine)
    if absent:
        raise KeyError(
            f"{directory} was trained on frozen weights the template state lacks: {absent[:5]} "
            f"({len(absent)} in all); pass the model the run trained, with its frozen base (init_state(model, ...))"
        )
    differ = sorted(k for k, fp in meta["frozen"].items() if fingerprint(mine[k]) != fp)
    if differ:
        raise CheckpointError(
            f"{directory / SIDECAR_FILE}: field 'frozen': the template's frozen weights are not those this "
            f"checkpoint was trained on: {differ[:5]} ({len(differ)} of {len(meta['frozen'])}) differ; build the "
            "model on the same base weights as the run (the same pretrained checkpoint, or the same seed), "
            "or start a new run"
        )
    return {k: mine[k] for k in meta["frozen"]}


def _read_weights(directory: Path, meta: Mapping[str, Any], like: TrainState) -> Tree:
    """Return ``{flattened state key: tensor}`` from the weights files and the frozen weights (the template's)."""
    out: Tree = {}
    for name, keys in meta["tensors"].items():
        data = _read_tensors(directory, name, meta)
        absent = sorted(v for v in keys.values() if v not in data)
        if absent:
            raise CheckpointError(
                f"{directory / name} lacks {absent[:5]}, which {SIDECAR_FILE} says it holds: the checkpoint was "
                "altered; resume from an earlier checkpoint"
            )
        out.update({k: data[v] for k, v in keys.items()})
    return {**out, **_frozen(directory, meta, like)}


def load(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Return the state saved in ``directory``, shaped like the template ``like`` and on its devices.

    Every tensor must match the template's keys, shapes and dtypes, except ``metrics``, which is
    free-form and loaded as saved. The params come from ``model.safetensors`` (or the adapter file),
    the rest from ``state.safetensors``; frozen base weights the checkpoint left out are the
    template's, and their fingerprints must be the recorded ones (``CheckpointError`` naming them
    otherwise). A weights-only checkpoint raises ``ValueError`` (see ``warm_start``).

    >>> import tempfile, attrs, torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state, scalar
    >>> fresh = init_state(torch.nn.Linear(2, 1), sgd(0.1))
    >>> path = save(attrs.evolve(fresh, step=scalar(12)), tempfile.mkdtemp() + "/ckpt")
    >>> load(path, like=fresh).step.item(), fresh.step.item()
    (12, 0)
    """
    directory = Path(directory)
    meta = read_metadata(directory)
    if meta.get("save_only_model"):
        raise ValueError(
            f"{directory / STATE_FILE} does not exist: {directory} was saved with save_only_model=True "
            "and holds weights only (no optimizer state, step or data cursor), so training cannot "
            "resume from it exactly; to start a new run from its weights call "
            "trainfold.ckpt.checkpoint.warm_start(directory, like=init_state(...)), which restarts the "
            "optimizer and the schedule"
        )
    if _SHARDED_INDEX in meta["files"]:  # written by every rank: resharded to like's layout
        from trainfold.ckpt import sharded as sharded_checkpoint  # noqa: PLC0415 - it builds on this module

        return sharded_checkpoint.load(directory, like)
    flat = _read_tensors(directory, STATE_FILE, meta)
    note = ""
    if "tensors" in meta:  # format 3: the weights are in their own file(s)
        weights = _read_weights(directory, meta, like)
        clash = sorted(set(weights) & set(flat))
        if clash:
            raise CheckpointError(
                f"{directory / STATE_FILE} holds {clash[:3]}, which {SIDECAR_FILE} places in "
                "a weights file: the checkpoint was altered; resume from an earlier checkpoint"
            )
        flat.update(weights)
        note = f" (with the weights of {', '.join(meta['tensors'])})"
    metrics = {k.removeprefix("metrics."): v for k, v in flat.items() if k.startswith("metrics.")}
    rest = {k: v for k, v in flat.items() if not k.startswith("metrics.")}
    state = _fit(rest, attrs.evolve(like, metrics={}), directory / STATE_FILE, note)
    saved = {
        "step": int(state.step),
        "cursor.epoch": int(state.cursor.epoch),
        "cursor.position": int(state.cursor.position),
    }
    recorded = {
        "step": meta["step"],
        "cursor.epoch": meta["cursor"]["epoch"],
        "cursor.position": meta["cursor"]["position"],
    }
    for field, value in saved.items():
        if recorded[field] != value:
            raise _bad(directory / SIDECAR_FILE, field, f"is {recorded[field]} but {STATE_FILE} holds {value}")
    return attrs.evolve(state, metrics=metrics)


def _weights_file(meta: Mapping[str, Any]) -> str:
    return next(iter(meta.get("tensors", {MODEL_FILE: {}})))


def load_weights(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Return ``like`` with params and buffers from the checkpoint's weights file; nothing else changes.

    The weights file is ``model.safetensors`` (``adapter_model.safetensors`` for a ``peft`` model, whose
    frozen base must be the template's, as for ``load``). Buffers absent from it (non-persistent
    ones) keep the template's values. Use it for ``load_best_model_at_end``; to start training from
    weights, see ``warm_start``.

    >>> import tempfile, attrs, torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state, scalar
    >>> model = torch.nn.Linear(2, 1)
    >>> trained = init_state(model, sgd(0.1), params={"weight": torch.ones(1, 2), "bias": torch.ones(1)})
    >>> path = save(attrs.evolve(trained, step=scalar(9)), tempfile.mkdtemp() + "/ckpt", model=model)
    >>> s = load_weights(path, like=init_state(model, sgd(0.1)))
    >>> s.params["weight"].tolist(), s.step.item()            # the weights, not the step
    ([[1.0, 1.0]], 0)
    """
    directory = Path(directory)
    meta = read_metadata(directory)
    if _SHARDED_INDEX in meta["files"]:
        from trainfold.ckpt import sharded as sharded_checkpoint  # noqa: PLC0415 - it builds on this module

        return sharded_checkpoint.load(directory, like, weights_only=True)
    path = directory / _weights_file(meta)
    if "tensors" not in meta:  # formats 1 and 2: model.safetensors under the state's names
        flat = _read_tensors(directory, MODEL_FILE, meta)
        params_in = {k: v for k, v in flat.items() if k in like.params}
        buffers_in = {k: v for k, v in flat.items() if k not in like.params}
    else:
        flat = _read_weights(directory, meta, like)
        if any(k.startswith("params.") and k[7:] not in flat for k in like.params) and STATE_FILE in meta["files"]:
            # trainable tensors peft does not save (a base norm unfrozen by hand) are in the state file
            flat = {
                **{k: v for k, v in _read_tensors(directory, STATE_FILE, meta).items() if k.startswith("params.")},
                **flat,
            }
        params_in = {k[7:]: v for k, v in flat.items() if k.startswith("params.")}
        buffers_in = {k[8:]: v for k, v in flat.items() if k.startswith("buffers.")}
    unexpected = sorted((set(params_in) - set(like.params)) | (set(buffers_in) - set(like.buffers)))
    missing = sorted(set(like.params) - set(params_in))
    if unexpected or missing:
        raise KeyError(
            f"{path} does not fit the template state; was it saved from a different model? "
            f"missing {missing}, unexpected {unexpected}"
        )
    params = _fit(params_in, like.params, path)
    kept = {k: buffers_in.get(k, v) for k, v in like.buffers.items()}
    buffers = _fit(kept, like.buffers, path)
    return attrs.evolve(like, params=params, buffers=buffers)


def warm_start(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Start a new run from a checkpoint's weights: ``load_weights`` with a warning.

    Pass a fresh ``like = init_state(...)``: the optimizer state, step (and so the learning-rate
    schedule), data cursor and metrics are ``like``'s, not the checkpoint's.

    >>> import tempfile, warnings, torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state
    >>> model = torch.nn.Linear(2, 1)
    >>> ones = {"weight": torch.ones(1, 2), "bias": torch.ones(1)}
    >>> path = save(init_state(model, sgd(0.1), params=ones), tempfile.mkdtemp() + "/ckpt", model=model)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     s = warm_start(path, like=init_state(model, sgd(0.1)))
    >>> s.params["bias"].tolist(), [w.category.__name__ for w in caught]
    ([1.0], ['UserWarning'])
    """
    state = load_weights(directory, like)
    warnings.warn(
        f"warm start from the weights in {Path(directory) / _weights_file(read_metadata(directory))}: the "
        f"optimizer state, schedule and data order restart from step {int(like.step)} (not an exact resume)",
        UserWarning,
        stacklevel=2,
    )
    return state


# -- finding ---------------------------------------------------------------------------------------


def _problem(directory: Path, root: Path | None = None) -> str | None:
    """Say why ``directory`` is not a usable complete checkpoint (``None``: it is one)."""
    if directory.is_symlink():
        return f"it is a symbolic link (to {os.path.realpath(directory)}); checkpoints must lie in the output_dir"
    if root is not None and directory.resolve().parent != root.resolve():
        return f"it lies outside {root}"
    if not directory.is_dir():
        return "it is not a directory"
    try:
        meta = read_metadata(directory)
    except (OSError, ValueError) as e:
        return str(e)
    step = _step_of(directory)
    if step is not None and step != meta["step"]:
        return f"its name says step {step} but {SIDECAR_FILE} says step {meta['step']}"
    for name, entry in meta["files"].items():
        path = directory / name
        if path.is_symlink() or not path.is_file():
            return f"{path} is missing or not a plain file"
        if path.stat().st_size != entry["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {SIDECAR_FILE} records {entry['bytes']}"
    return None


def is_complete(directory: str | os.PathLike) -> bool:
    """Say whether ``directory`` is a finished checkpoint: no marker, a valid sidecar, every file at its size.

    A directory named ``checkpoint-{n}`` must also hold step ``n``; a symbolic link is never one.

    >>> is_complete("no/such/dir")
    False
    """
    return _problem(Path(directory)) is None


def _step_of(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Return the complete ``checkpoint-{step}`` directories in ``output_dir``, oldest step first.

    Never raises on what else is there: a directory named like a checkpoint that is incomplete,
    malformed, a symbolic link, or holds another step than its name says is skipped with a
    ``CheckpointWarning`` saying why.

    >>> list_checkpoints("no/such/dir")
    []
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = sorted((s, p) for p in root.iterdir() if (s := _step_of(p)) is not None)
    out = []
    for _, path in found:
        problem = _problem(path, root)
        if problem is None:
            out.append(path)
        else:
            warnings.warn(f"skipping {path}: {problem}", CheckpointWarning, stacklevel=2)
    return out


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """Return the complete checkpoint with the highest step in ``output_dir``, or ``None``.

    It may be any run's; ``trainfold.ckpt.run_dir.resumable`` finds the latest of one run.

    >>> latest_checkpoint("no/such/dir") is None
    True
    """
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def resume_checkpoint(
    resume_from_checkpoint: bool | str | os.PathLike | None, output_dir: str | os.PathLike
) -> Path | None:
    """Return the checkpoint that ``resume_from_checkpoint`` (HF semantics) names, or ``None``.

    ``None``/``False``: start fresh; ``True``: the latest complete checkpoint in ``output_dir``
    (an error if there is none); a path: that checkpoint, which must be complete. ``train`` goes
    through ``trainfold.ckpt.run_dir.claim``, which takes only checkpoints of the same run.

    >>> resume_checkpoint(False, "out") is None
    True
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        found = latest_checkpoint(output_dir)
        if found is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint-<step> "
                "directory; pass a checkpoint path, or resume_from_checkpoint=None to start fresh"
            )
        return found
    path = Path(resume_from_checkpoint)
    read_metadata(path)  # names the path and what is wrong with it
    problem = _problem(path)
    if problem is not None:
        raise CheckpointError(
            f"{path} is incomplete or unusable ({problem}); resume from latest_checkpoint({str(path.parent)!r}) instead"
        )
    return path
