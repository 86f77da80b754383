"""The checkpoint format: its file names, the JSON sidecar ``trainfold.json``, its schema and its reading.

The sidecar holds the library version, step, cursor, caller metadata, the run settings, the run's
identity (``run``), which state key each weights file holds under which name (``tensors``), the
frozen tensors' fingerprints (``frozen``), each file's size and XXH3-64 hash, and the CRC-32 of the
sidecar itself (``checksum``). ``validate_sidecar`` checks it against its schema; every refusal names
the path and the field.

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
from typing import Any

from trainfold.core.version import library_version

__all__ = [
    "STATE_FILE",
    "MODEL_FILE",
    "CONFIG_FILE",
    "SIDECAR_FILE",
    "INCOMPLETE_MARKER",
    "SHARD_DIR",
    "is_sharded_checkpoint",
    "is_weights_only",
    "hash_chunk",
    "CHUNK",
    "MAX_STEP",
    "CheckpointError",
    "OldFormatError",
    "CheckpointWarning",
    "field_error",
    "new_sidecar",
    "sidecar_bytes",
    "validate_sidecar",
    "read_metadata",
    "check_name",
    "step_in_name",
]

STATE_FILE = "state.safetensors"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SIDECAR_FILE = "trainfold.json"
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
SHARD_DIR = "sharded"  # a sharded checkpoint's folder of DCP shard files (trainfold.ckpt.sharded)
_FORMAT = "trainfold-checkpoint"
_FORMAT_VERSION = 5  # XXH3-64 hashes by chunks (tensor_file), the weights in their own files; 4 is read too
_OLDEST_READ = 4  # whole-file hashes
CHUNK = 16 << 20  # the bytes of a chunk hashed on its own (format 5): a multiple of every mmap granularity
_FILE_NAME = re.compile(rf"^(?:{SHARD_DIR}/)?[A-Za-z0-9_][A-Za-z0-9_.-]*$")
MAX_STEP = 2**53  # a step beyond it is not a count of optimizer steps


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the path, the field and what to do."""


class OldFormatError(CheckpointError):
    """A checkpoint of a format before 4: only the trainfold release that wrote it reads it."""


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
# every field of the format and its type, as new_sidecar makes it (``run`` may also be null)
_TYPES = {k: type(v) for k, v in new_sidecar(step=0, cursor=(0, 0), files={}, run={}).items()} | {"checksum": int}


def field_error(path: Path, field: str, problem: str, fix: str = _FIX) -> CheckpointError:
    """Return the ``CheckpointError`` saying that field ``field`` of the sidecar ``path`` has ``problem``."""
    return CheckpointError(f"{path}: field {field!r} {problem}; {fix}")


def _count(path: Path, field: str, value: Any, top: int = MAX_STEP) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
        raise field_error(path, field, f"must be an int in [0, {top}], got {value!r}")
    return value


def _strings(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def validate_sidecar(meta: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Return ``meta`` (a parsed ``trainfold.json``) if it fits the schema, else raise ``CheckpointError``.

    Formats 4 and 5 (``OldFormatError`` names the release that wrote an older one); every field present with
    its type; counts in ``[0, MAX_STEP]``; every tensor file listed with ``bytes`` and ``xxh3_64``; ``tensors``
    maps each weights file to ``{state key: file key}``, no key in two files; ``checksum`` the CRC-32 of the rest.
    """
    path = Path(path)
    _check_version(meta, path)
    missing, extra = sorted(set(_TYPES) - set(meta)), sorted(set(meta) - set(_TYPES))
    if missing or extra:
        raise field_error(
            path, (missing or extra)[0], "is missing" if missing else "is not a field of the checkpoint format"
        )
    for name, kind in _TYPES.items():
        value = meta[name]
        if type(value) is not kind and (name, value) != ("run", None):  # exactly: a bool is no count
            raise field_error(path, name, f"must be a {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    _count(path, "step", meta["step"])
    if sorted(meta["cursor"]) != ["epoch", "position"]:
        raise field_error(path, "cursor", f"must hold exactly 'epoch' and 'position', got {sorted(meta['cursor'])}")
    for name, value in meta["cursor"].items():
        _count(path, f"cursor.{name}", value)
    if meta["epoch"] != meta["cursor"]["epoch"]:
        raise field_error(path, "epoch", f"must equal cursor.epoch ({meta['cursor']['epoch']}), got {meta['epoch']}")
    _check_tensors(meta, path)
    run = meta["run"]
    if run is not None and (sorted(run) != ["fingerprint", "id"] or not _strings(run) or not all(run.values())):
        raise field_error(path, "run", f"must be null or {{'id': str, 'fingerprint': str}}, got {run!r:.80}")
    if meta["checksum"] != _checksum(meta):
        raise field_error(path, "checksum", "does not match the sidecar's content (it was altered or damaged)")
    return meta


def _check_version(meta: Any, path: Path) -> None:
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f'{path} is not a trainfold checkpoint sidecar (no "format": "{_FORMAT}")')
    version, release = _count(path, "format_version", meta.get("format_version")), meta.get("library_version")
    if version > _FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version}, written by trainfold {release}; "
            f"this trainfold reads format {_FORMAT_VERSION}: upgrade trainfold"
        )
    if version < _OLDEST_READ:
        raise OldFormatError(
            f"{path}: field 'format_version' is {version}: the checkpoint was written by trainfold {release}, and "
            f"this trainfold reads formats {_OLDEST_READ}-{_FORMAT_VERSION}; load it with trainfold {release} and save "
            f"it again, or start a new run from its weights (its {MODEL_FILE} loads with from_pretrained)"
        )


def _check_tensors(meta: dict[str, Any], path: Path) -> None:
    files, tensors = meta["files"], meta["tensors"]
    for name, entry in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name):
            raise field_error(path, "files", f"names {name!r}, which is not a plain file name")
        if not isinstance(entry, dict) or sorted(entry) != ["bytes", "xxh3_64"]:
            raise field_error(path, f"files.{name}", f"must be {{'bytes': int, 'xxh3_64': int}}, got {entry!r:.60}")
        _count(path, f"files.{name}.bytes", entry["bytes"], 2**62)
        _count(path, f"files.{name}.xxh3_64", entry["xxh3_64"], 2**64 - 1)
    needed = [*([] if is_weights_only(meta) else [STATE_FILE]), *tensors]
    if is_sharded_checkpoint(meta):  # trainfold.ckpt.sharded: the shards, model.safetensors on request
        needed = [MODEL_FILE] if is_weights_only(meta) else []
    for name in needed:
        if name not in files:
            problem = "is missing: every tensor file must be listed with its size and hash"
            raise field_error(path, f"files.{name}", problem)
    seen: set[str] = set()
    for name, keys in tensors.items():
        if not _strings(keys):
            raise field_error(path, f"tensors.{name}", f"must map state keys to file keys (strings), got {keys!r:.60}")
        if seen & set(keys):
            raise field_error(
                path, f"tensors.{name}", f"holds {sorted(seen & set(keys))[:3]}, which another file holds"
            )
        seen |= set(keys)
    if not _strings(meta["frozen"]):
        raise field_error(path, "frozen", f"must map state keys to fingerprints (strings), got {meta['frozen']!r:.60}")


def hash_chunk(meta: Mapping[str, Any]) -> int | None:
    """Return the chunk size of the file hashes of the sidecar ``meta`` (``tensor_file.digest_of``; format 4: whole)."""
    return None if meta["format_version"] == 4 else CHUNK


def is_sharded_checkpoint(meta: Mapping[str, Any]) -> bool:
    """Say whether the sidecar ``meta`` is a sharded checkpoint's (its files include ``sharded/`` ones)."""
    return any(name.startswith(f"{SHARD_DIR}/") for name in meta["files"])


def is_weights_only(meta: Mapping[str, Any]) -> bool:
    """Say whether the sidecar ``meta`` is a checkpoint of the weights alone (saved with ``save_only_model``: no
    optimizer state, step or data cursor to resume from)."""
    return bool(meta["save_only_model"])


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


def step_in_name(directory: Path) -> int | None:
    """Return the step ``n`` of a directory named ``checkpoint-{n}`` (else ``None``)."""
    named = re.fullmatch(r"checkpoint-(\d+)", directory.name)
    return int(named.group(1)) if named else None


def check_name(directory: Path, meta: Mapping[str, Any]) -> None:
    """Refuse a directory named ``checkpoint-{n}`` whose sidecar ``meta`` holds another step than ``n``."""
    named = step_in_name(directory)
    if named is not None and named != meta["step"]:
        raise field_error(
            directory / SIDECAR_FILE,
            "step",
            f"is {meta['step']}, but the directory's name says step {named}",
            "it was renamed or its files replaced; use it under its own name",
        )
