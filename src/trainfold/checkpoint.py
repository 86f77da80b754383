"""Checkpoints: atomic snapshots of the ``TrainState`` record (the policy is in ``checkpoint_policy``).

A checkpoint is a directory ``output_dir/checkpoint-{step}/`` holding

- ``state.safetensors``: the whole record flattened to dotted keys (``trainfold.tree.flatten``);
- ``model.safetensors`` (+ ``config.json``): the weights under the model's ``state_dict`` names,
  tied weights once, so ``transformers`` ``from_pretrained`` loads the directory directly;
- ``trainfold.json``: a sidecar with the library version, step, cursor, caller metadata (best
  metric, where the log history stands), the run settings, the run's identity (``run``: its id
  and the fingerprint of the settings that define the trajectory), each file's size and CRC-32,
  and the CRC-32 of the sidecar itself (``checksum``). ``validate_sidecar`` checks it against
  its schema; every refusal names the path and the field.

It is written into a hidden sibling directory that holds ``checkpoint-is-incomplete.txt`` while
files are written; files and directories are fsynced, the marker is removed, and the directory is
renamed into place (swapped in atomically with ``renameat2(RENAME_EXCHANGE)`` when one is already
there, so some complete checkpoint is always visible). Nothing is pickled and loading never runs code.

>>> import tempfile, torch
>>> from trainfold.optim import sgd
>>> from trainfold.state import init_state
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
import safetensors.torch
import torch
from torch import Tensor, nn

from trainfold.state import TrainState
from trainfold.tree import Tree, flatten, unflatten

__all__ = [
    "STATE_FILE",
    "MODEL_FILE",
    "CONFIG_FILE",
    "SIDECAR_FILE",
    "INCOMPLETE_MARKER",
    "save",
    "load",
    "load_weights",
    "warm_start",
    "read_metadata",
    "model_weights",
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
_SHARDED_INDEX = "state.index.json"  # trainfold.sharded_checkpoint.INDEX_FILE
_FORMAT = "trainfold-checkpoint"
_FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # format 1: no run identity and no checksum
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


def _storable(flat: Mapping[str, Tensor]) -> Tree:
    """Return CPU, contiguous tensors, cloning any that share storage with an earlier one."""
    out: Tree = {}
    seen: set[int] = set()
    for key, t in flat.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def model_weights(state: TrainState, model: nn.Module | None = None) -> Tree:
    """Return the state's weights under ``model``'s ``state_dict`` names, each tied tensor once.

    Non-persistent buffers are left out, as ``state_dict`` leaves them out. Without ``model`` the
    state's own names are used (params, then all buffers).

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state
    >>> m = torch.nn.BatchNorm1d(2)
    >>> sorted(model_weights(init_state(m, sgd(0.1)), m))
    ['bias', 'num_batches_tracked', 'running_mean', 'running_var', 'weight']
    """
    tensors = {**state.buffers, **state.params}
    if model is None:
        return dict(tensors)
    source = {id(b): n for n, b in model.named_buffers()} | {id(p): n for n, p in model.named_parameters()}
    out: Tree = {}
    done: set[str] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        name = source.get(id(value), key)
        if name in done:
            continue  # a tied alias: saved once, under its first name
        if name not in tensors:
            raise KeyError(
                f"the model's {key!r} is not in the state (params and buffers); pass the model the "
                "state was made from (init_state(model, ...))"
            )
        done.add(name)
        out[key] = tensors[name]
    return out


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


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _crc32_written(path: Path, tensors: Mapping[str, Tensor]) -> int:
    """Return the CRC-32 of the safetensors file just written from ``tensors``, without reading it all.

    The file is its 8-byte header length, the JSON header, then each tensor's bytes at its
    offsets; only the header is read back. Any layout it does not expect falls back to a full read.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        header = f.read(int.from_bytes(head, "little"))
    spans = sorted((v["data_offsets"], k) for k, v in json.loads(header).items() if k != "__metadata__")
    crc, end = zlib.crc32(header, zlib.crc32(head)), 0
    for (start, stop), key in spans:
        if start != end or stop - start != tensors[key].numel() * tensors[key].element_size():
            return _crc32(path)
        crc = zlib.crc32(tensors[key].reshape(-1).view(torch.uint8).numpy(), crc)
        end = stop
    if 8 + len(header) + end != path.stat().st_size:
        return _crc32(path)
    return crc


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
    if not isinstance(run, Mapping) or sorted(run) != ["fingerprint", "id"] or not all(
        isinstance(v, str) and v for v in run.values()
    ):
        raise TypeError(f"run must be {{'id': str, 'fingerprint': str}} (see trainfold.run_dir), got {run!r}")
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
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state
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

    ``model`` gives ``model.safetensors`` its ``state_dict`` names (and its ``config`` when
    ``config`` is not given); ``config`` (dict, or object with ``to_dict``/``to_json_string``)
    becomes ``config.json``. ``metadata`` (best metric, log history, ...) and ``settings`` (the
    run settings, checked on resume by ``check_compatible``) go into the JSON sidecar, with ``run``
    (``{"id": ..., "fingerprint": ...}``, see ``trainfold.run_dir``): which run wrote it.
    ``save_only_model`` writes the weights but not the record. ``jit`` marks an emergency
    checkpoint that ``rotate`` never deletes. ``on_file(path)`` is called after each file is
    written (progress reports; tests use it to crash mid-save). An existing ``directory`` is
    replaced by swapping the new one in atomically (``renameat2(RENAME_EXCHANGE)``), then deleting
    the old one; there is no moment without a complete ``directory``. Call it on one rank only.
    ``tensors(tmp)`` replaces the two tensor files: it writes its own into ``tmp`` and returns their
    ``{name: {"bytes", "crc32"}}`` (``trainfold.sharded_checkpoint``, where every rank writes shards).

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state
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
    if config is None and model is not None:
        config = getattr(model, "config", None)
    config_text = _config_text(config)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    _point("save:started")
    try:
        marker = tmp / INCOMPLETE_MARKER
        _write_bytes(marker, b"trainfold is writing this checkpoint; if this file remains, the write failed.\n")
        files: dict[str, dict[str, int]] = {}

        def record(name: str, crc: int) -> None:
            path = tmp / name
            _fsync_file(path)
            files[name] = {"bytes": path.stat().st_size, "crc32": crc}
            if on_file is not None:
                on_file(path)
            _point(f"save:wrote:{name}")

        def write_tensors(name: str, tensors: Tree) -> None:
            safetensors.torch.save_file(tensors, tmp / name, metadata={"format": "pt"})
            record(name, _crc32_written(tmp / name, tensors))

        if tensors is not None:  # a sharded state: every rank's shards and their index
            files.update(tensors(tmp))
        elif not save_only_model:
            write_tensors(STATE_FILE, _storable(flatten(state)))
        if tensors is None:
            write_tensors(MODEL_FILE, _storable(model_weights(state, model)))
        if config_text is not None:
            _write_bytes(tmp / CONFIG_FILE, config_text.encode())
            record(CONFIG_FILE, zlib.crc32(config_text.encode()))
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
_TOP = {"format", "format_version", "library_version", "step", "epoch", "cursor", "save_only_model", "jit",
        "metadata", "settings", "run", "files", "checksum"}


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
    (``0 <= step <= MAX_STEP``); ``files`` lists ``model.safetensors`` (and ``state.safetensors``
    unless weights only), each with ``bytes`` and ``crc32``; ``checksum`` is the CRC-32 of the
    rest. Format 1 (no ``run``, no ``checksum``) is still read. The message names the path and field.

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state
    >>> meta = read_metadata(save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp() + "/c"))
    >>> validate_sidecar({**meta, "files": {}}, "c/trainfold.json")
    Traceback (most recent call last):
    ...
    trainfold.checkpoint.CheckpointError: c/trainfold.json: field 'files.state.safetensors' is missing: every tensor file must be listed with its size and CRC; the sidecar is damaged or was not written by trainfold; resume from another checkpoint
    """
    path = Path(path)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f"{path} is not a trainfold checkpoint sidecar (no \"format\": \"{_FORMAT}\")")
    version = meta.get("format_version")
    if not _is_int(version) or version < 1:
        raise _bad(path, "format_version", f"must be a positive int, got {version!r}")
    if version > _FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version}, written by trainfold {meta.get('library_version')}; "
            f"this trainfold reads format {_FORMAT_VERSION}: upgrade trainfold"
        )
    required = _TOP if version >= 2 else _TOP - {"run", "checksum"}
    for name in sorted(required):
        if name not in meta:
            raise _bad(path, name, "is missing")
    extra = sorted(set(meta) - required)
    if extra:
        raise _bad(path, extra[0], "is not a field of the checkpoint format")
    types = {"library_version": str, "save_only_model": bool, "jit": bool, "metadata": dict, "settings": dict,
             "cursor": dict, "files": dict}
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
    needed = [MODEL_FILE] if meta["save_only_model"] else [STATE_FILE, MODEL_FILE]
    if _SHARDED_INDEX in files:  # trainfold.sharded_checkpoint: the index, model.safetensors on request
        needed = [_SHARDED_INDEX, *needed[:meta["save_only_model"]]]
    for name in needed:
        if name not in files:
            raise _bad(path, f"files.{name}", "is missing: every tensor file must be listed with its size and CRC")
    for name, entry in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name):
            raise _bad(path, "files", f"names {name!r}, which is not a plain file name")
        if not isinstance(entry, dict) or sorted(entry) != ["bytes", "crc32"]:
            raise _bad(path, f"files.{name}", f"must be {{'bytes': int, 'crc32': int}}, got {entry!r:.60}")
        _count(path, f"files.{name}.bytes", entry["bytes"], 2**62)
        _count(path, f"files.{name}.crc32", entry["crc32"], 2**32 - 1)
    if version >= 2:
        run = meta["run"]
        if run is not None and (not isinstance(run, dict) or sorted(run) != ["fingerprint", "id"]
                                or not all(isinstance(v, str) and v for v in run.values())):
            raise _bad(path, "run", f"must be null or {{'id': str, 'fingerprint': str}}, got {run!r:.80}")
        if not _is_int(meta["checksum"]) or meta["checksum"] != _checksum(meta):
            raise _bad(path, "checksum", "does not match the sidecar's content (it was altered or damaged)")
    return meta


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Return the checkpoint's JSON sidecar (step, cursor, metadata, settings, run, files), validated.

    Raises ``FileNotFoundError`` or ``CheckpointError`` (a ``ValueError``) naming the path (and
    the field) when it is missing, unreadable or does not fit the schema (``validate_sidecar``).

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state
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
    if _crc32(path) != expected["crc32"]:
        raise CheckpointError(
            f"{path} is corrupted: its CRC-32 differs from the one {SIDECAR_FILE} records; "
            "resume from an earlier checkpoint"
        )
    try:
        return safetensors.torch.load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None


def _fit(flat: Mapping[str, Tensor], like: Any, path: Path) -> Any:
    try:
        return unflatten(flat, like=like)
    except KeyError as e:
        raise KeyError(
            f"{path} does not fit the template state; was it saved from a different model or "
            f"optimizer? {e.args[0]}"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path} does not fit the template state (a different model size?): {e}") from None


def load(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Return the state saved in ``directory``, shaped like the template ``like`` and on its devices.

    Every tensor must match the template's keys, shapes and dtypes, except ``metrics``, which is
    free-form and loaded as saved. A weights-only checkpoint raises ``ValueError`` (see ``warm_start``).

    >>> import tempfile, attrs, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state, scalar
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
            "trainfold.checkpoint.warm_start(directory, like=init_state(...)), which restarts the "
            "optimizer and the schedule"
        )
    if _SHARDED_INDEX in meta["files"]:  # written by every rank: resharded to like's layout
        from trainfold import sharded_checkpoint  # noqa: PLC0415 - it builds on this module
        return sharded_checkpoint.load(directory, like)
    flat = _read_tensors(directory, STATE_FILE, meta)
    metrics = {k.removeprefix("metrics."): v for k, v in flat.items() if k.startswith("metrics.")}
    rest = {k: v for k, v in flat.items() if not k.startswith("metrics.")}
    state = _fit(rest, attrs.evolve(like, metrics={}), directory / STATE_FILE)
    saved = {"step": int(state.step), "cursor.epoch": int(state.cursor.epoch),
             "cursor.position": int(state.cursor.position)}
    recorded = {"step": meta["step"], "cursor.epoch": meta["cursor"]["epoch"],
                "cursor.position": meta["cursor"]["position"]}
    for field, value in saved.items():
        if recorded[field] != value:
            raise _bad(directory / SIDECAR_FILE, field, f"is {recorded[field]} but {STATE_FILE} holds {value}")
    return attrs.evolve(state, metrics=metrics)


def load_weights(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Return ``like`` with params and buffers from ``directory/model.safetensors``; nothing else changes.

    Buffers absent from the file (non-persistent ones) keep the template's values. Use it for
    ``load_best_model_at_end``; to start training from weights, see ``warm_start``.

    >>> import tempfile, attrs, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state, scalar
    >>> model = torch.nn.Linear(2, 1)
    >>> trained = init_state(model, sgd(0.1), params={"weight": torch.ones(1, 2), "bias": torch.ones(1)})
    >>> path = save(attrs.evolve(trained, step=scalar(9)), tempfile.mkdtemp() + "/ckpt", model=model)
    >>> s = load_weights(path, like=init_state(model, sgd(0.1)))
    >>> s.params["weight"].tolist(), s.step.item()            # the weights, not the step
    ([[1.0, 1.0]], 0)
    """
    directory = Path(directory)
    path, meta = directory / MODEL_FILE, read_metadata(directory)
    if _SHARDED_INDEX in meta["files"]:
        from trainfold import sharded_checkpoint  # noqa: PLC0415 - it builds on this module
        return sharded_checkpoint.load(directory, like, weights_only=True)
    flat = _read_tensors(directory, MODEL_FILE, meta)
    unexpected = sorted(set(flat) - set(like.params) - set(like.buffers))
    missing = sorted(set(like.params) - set(flat))
    if unexpected or missing:
        raise KeyError(
            f"{path} does not fit the template state; was it saved from a different model? "
            f"missing {missing}, unexpected {unexpected}"
        )
    params = _fit({k: flat[k] for k in like.params}, like.params, path)
    kept = {k: flat.get(k, v) for k, v in like.buffers.items()}
    buffers = _fit(kept, like.buffers, path)
    return attrs.evolve(like, params=params, buffers=buffers)


def warm_start(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Start a new run from a checkpoint's weights: ``load_weights`` with a warning.

    Pass a fresh ``like = init_state(...)``: the optimizer state, step (and so the learning-rate
    schedule), data cursor and metrics are ``like``'s, not the checkpoint's.

    >>> import tempfile, warnings, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.state import init_state
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
        f"warm start from the weights in {Path(directory) / MODEL_FILE}: the optimizer state, "
        f"schedule and data order restart from step {int(like.step)} (not an exact resume)",
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

    It may be any run's; ``trainfold.run_dir.resumable`` finds the latest of one run.

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
    through ``trainfold.run_dir.claim``, which takes only checkpoints of the same run.

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
