"""The checkpoint format: its file names, the JSON sidecar ``trainfold.json``, its schema and its reading.

The sidecar holds the library version, step, cursor, caller metadata, the run settings, the run's
identity (``run``), which state key each weights file holds under which name (``tensors``), the
frozen tensors' fingerprints (``frozen``), each file's size and hash (XXH3-64; CRC-32 before format
4), and the CRC-32 of the sidecar itself (``checksum``). ``validate_sidecar`` checks it against its
schema; every refusal names the path and the field.

>>> sorted(new_sidecar(step=3, cursor=(0, 6), files={}))[:4]
['cursor', 'epoch', 'files', 'format']
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from trainfold.ckpt.tensor_file import HASHES
from trainfold.core.version import library_version

__all__ = [
    "STATE_FILE",
    "MODEL_FILE",
    "CONFIG_FILE",
    "SIDECAR_FILE",
    "INCOMPLETE_MARKER",
    "SHARD_DIR",
    "is_sharded_checkpoint",
    "MAX_STEP",
    "CheckpointError",
    "CheckpointWarning",
    "field_error",
    "new_sidecar",
    "sidecar_bytes",
    "validate_sidecar",
    "read_metadata",
]

STATE_FILE = "state.safetensors"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SIDECAR_FILE = "trainfold.json"
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
SHARD_DIR = "sharded"  # a sharded checkpoint's folder of DCP shard files (trainfold.ckpt.sharded)
_FORMAT = "trainfold-checkpoint"
_FORMAT_VERSION = 4  # 1: no run identity, no checksum; 1 and 2: every tensor in state.safetensors; 1-3: CRC-32s
_FILE_NAME = re.compile(rf"^(?:{SHARD_DIR}/)?[A-Za-z0-9_][A-Za-z0-9_.-]*$")
MAX_STEP = 2**53  # a step beyond it is not a count of optimizer steps


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the path, the field and what to do."""


class CheckpointWarning(UserWarning):
    """A directory named like a checkpoint that ``list_checkpoints`` skipped, and why."""


def new_sidecar(
    *,
    step: int,
    cursor: tuple[int, int],
    files: Mapping[str, dict[str, int]],
    save_only_model: bool = False,
    jit: bool = False,
    metadata: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    run: Mapping[str, str] | None = None,
    tensors: Mapping[str, Mapping[str, str]] | None = None,
    frozen: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Return the sidecar of a checkpoint at ``step`` and ``cursor`` (epoch, position), its fields in order."""
    epoch, position = cursor
    return {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "library_version": library_version(),
        "step": step,
        "epoch": epoch,
        "cursor": {"epoch": epoch, "position": position},
        "save_only_model": bool(save_only_model),
        "jit": bool(jit),
        "metadata": dict(metadata or {}),
        "settings": dict(settings or {}),
        "run": None if run is None else dict(run),
        "tensors": dict(tensors or {}),
        "frozen": dict(frozen or {}),
        "files": dict(files),
    }


def _checksum(sidecar: Mapping[str, Any]) -> int:
    body = {k: v for k, v in sidecar.items() if k != "checksum"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def sidecar_bytes(sidecar: Mapping[str, Any]) -> bytes:
    """Return the sidecar's bytes as written: indented JSON with its ``checksum`` (the CRC-32 of the rest) last."""
    sidecar = {**{k: v for k, v in sidecar.items() if k != "checksum"}, "checksum": _checksum(sidecar)}
    return (json.dumps(sidecar, indent=2) + "\n").encode()


_FIX = "the sidecar is damaged or was not written by trainfold; resume from another checkpoint"
_SINCE = {"run": 2, "checksum": 2, "tensors": 3, "frozen": 3}  # fields a format before these lacks


_TOP = {*new_sidecar(step=0, cursor=(0, 0), files={}), "checksum"}  # every field of the format


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def field_error(path: Path, field: str, problem: str, fix: str = _FIX) -> CheckpointError:
    """Return the ``CheckpointError`` saying that field ``field`` of the sidecar ``path`` has ``problem``."""
    return CheckpointError(f"{path}: field {field!r} {problem}; {fix}")


def _count(path: Path, field: str, value: Any, top: int) -> None:
    if not _is_int(value) or not 0 <= value <= top:
        raise field_error(path, field, f"must be an int in [0, {top}], got {value!r}")


def validate_sidecar(meta: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Return ``meta`` (a parsed ``trainfold.json``) if it fits the schema, else raise ``CheckpointError``.

    Checked: every field is present with its type and no other is; steps and cursor are counts
    (``0 <= step <= MAX_STEP``); ``tensors`` maps each weights file to ``{state key: file key}``, no
    key in two files; ``frozen`` maps state keys to fingerprints; ``files`` lists every weights file
    (and ``state.safetensors`` unless weights only), each with ``bytes`` and its hash; ``checksum`` is
    the CRC-32 of the rest. Formats 1 and 2 (every tensor in ``state.safetensors``, the weights again
    in ``model.safetensors``; format 1 without ``run`` and ``checksum``) are still read. The message
    names the path and field.

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> from trainfold.ckpt.writer import save
    >>> meta = read_metadata(save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp() + "/c"))
    >>> validate_sidecar({**meta, "files": {}}, "c/trainfold.json")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    trainfold.ckpt.sidecar.CheckpointError: c/trainfold.json: field 'files.state.safetensors' is missing: every tensor
    file must be listed with its size and hash; the sidecar is damaged or was not written by trainfold; resume from
    another checkpoint
    """
    path = Path(path)
    version = _check_version(meta, path)
    _check_fields(meta, path, version)
    _check_position(meta, path)
    _check_tensors(meta, path)
    _check_files(meta, path)
    if version >= 2:
        _check_identity(meta, path)
    return meta


def _check_version(meta: Any, path: Path) -> int:
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f'{path} is not a trainfold checkpoint sidecar (no "format": "{_FORMAT}")')
    version = meta.get("format_version")
    if not _is_int(version) or version < 1:
        raise field_error(path, "format_version", f"must be a positive int, got {version!r}")
    if version > _FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version}, written by trainfold {meta.get('library_version')}; "
            f"this trainfold reads format {_FORMAT_VERSION}: upgrade trainfold"
        )
    return version


_TYPES = {
    "library_version": str,
    "save_only_model": bool,
    "jit": bool,
    "metadata": dict,
    "settings": dict,
    "cursor": dict,
    "files": dict,
}


def _check_fields(meta: dict[str, Any], path: Path, version: int) -> None:
    required = {name for name in _TOP if version >= _SINCE.get(name, 1)}
    for name in sorted(required):
        if name not in meta:
            raise field_error(path, name, "is missing")
    extra = sorted(set(meta) - required)
    if extra:
        raise field_error(path, extra[0], "is not a field of the checkpoint format")
    for name, kind in _TYPES.items():
        if not isinstance(meta[name], kind):
            problem = f"must be a {kind.__name__}, got {type(meta[name]).__name__} {meta[name]!r:.60}"
            raise field_error(path, name, problem)


def _check_position(meta: dict[str, Any], path: Path) -> None:
    _count(path, "step", meta["step"], MAX_STEP)
    cursor = meta["cursor"]
    if sorted(cursor) != ["epoch", "position"]:
        raise field_error(path, "cursor", f"must hold exactly 'epoch' and 'position', got {sorted(cursor)}")
    _count(path, "cursor.epoch", cursor["epoch"], MAX_STEP)
    _count(path, "cursor.position", cursor["position"], MAX_STEP)
    if meta["epoch"] != cursor["epoch"] or not _is_int(meta["epoch"]):
        raise field_error(path, "epoch", f"must equal cursor.epoch ({cursor['epoch']}), got {meta['epoch']!r}")


def _check_tensors(meta: dict[str, Any], path: Path) -> None:
    files = meta["files"]
    tensors = meta.get("tensors", {MODEL_FILE: {}})
    if not isinstance(tensors, dict) or not all(isinstance(v, dict) for v in tensors.values()):
        raise field_error(path, "tensors", f"must map file names to {{state key: file key}}, got {tensors!r:.60}")
    needed = [*([] if meta["save_only_model"] else [STATE_FILE]), *tensors]
    if "state.index.json" in files:
        raise field_error(
            path,
            "files",
            "lists state.index.json: a sharded checkpoint of trainfold's own storage "
            "(before DCP's safetensors storage)",
            "load it with the trainfold release that wrote it",
        )
    if is_sharded_checkpoint(meta):  # trainfold.ckpt.sharded: the shards, model.safetensors on request
        needed = [MODEL_FILE] if meta["save_only_model"] else []
    for name in needed:
        if name not in files:
            problem = "is missing: every tensor file must be listed with its size and hash"
            raise field_error(path, f"files.{name}", problem)
    seen: set[str] = set()
    for name, keys in tensors.items():
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            problem = f"must map state keys to file keys (strings), got {keys!r:.60}"
            raise field_error(path, f"tensors.{name}", problem)
        if seen & set(keys):
            problem = f"holds {sorted(seen & set(keys))[:3]}, which another file holds"
            raise field_error(path, f"tensors.{name}", problem)
        seen |= set(keys)
    frozen = meta.get("frozen", {})
    if not isinstance(frozen, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in frozen.items()):
        raise field_error(path, "frozen", f"must map state keys to fingerprints (strings), got {frozen!r:.60}")


def is_sharded_checkpoint(meta: Mapping[str, Any]) -> bool:
    """Say whether the sidecar ``meta`` is a sharded checkpoint's (its files include ``sharded/`` ones).

    >>> is_sharded_checkpoint({"files": {"sharded/shard-00001-model-00001-of-00001.safetensors": {}}})
    True
    """
    return any(name.startswith(f"{SHARD_DIR}/") for name in meta["files"])


def _check_files(meta: dict[str, Any], path: Path) -> None:
    for name, entry in meta["files"].items():
        if not isinstance(name, str) or not _FILE_NAME.match(name):
            raise field_error(path, "files", f"names {name!r}, which is not a plain file name")
        kind = next((k for k in HASHES if isinstance(entry, dict) and sorted(entry) == sorted(["bytes", k])), None)
        if kind is None:
            problem = f"must be {{'bytes': int, 'xxh3_64' (or 'crc32'): int}}, got {entry!r:.60}"
            raise field_error(path, f"files.{name}", problem)
        _count(path, f"files.{name}.bytes", entry["bytes"], 2**62)
        _count(path, f"files.{name}.{kind}", entry[kind], 2**64 - 1)


def _check_identity(meta: dict[str, Any], path: Path) -> None:
    run = meta["run"]
    if run is not None and (
        not isinstance(run, dict)
        or sorted(run) != ["fingerprint", "id"]
        or not all(isinstance(v, str) and v for v in run.values())
    ):
        raise field_error(path, "run", f"must be null or {{'id': str, 'fingerprint': str}}, got {run!r:.80}")
    if not _is_int(meta["checksum"]) or meta["checksum"] != _checksum(meta):
        raise field_error(path, "checksum", "does not match the sidecar's content (it was altered or damaged)")


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Return the checkpoint's JSON sidecar (step, cursor, metadata, settings, run, files), validated.

    Raises ``FileNotFoundError`` or ``CheckpointError`` (a ``ValueError``) naming the path (and
    the field) when it is missing, unreadable or does not fit the schema (``validate_sidecar``).

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> from trainfold.ckpt.writer import save
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
