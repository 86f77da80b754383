"""Checkpoints: atomic snapshots of the ``TrainState`` record (the policy is in ``checkpoint_policy``).

A checkpoint is a directory ``output_dir/checkpoint-{step}/`` holding

- ``state.safetensors``: the whole record flattened to dotted keys (``trainfold.tree.flatten``);
- ``model.safetensors`` (+ ``config.json``): the weights under the model's ``state_dict`` names,
  tied weights once, so ``transformers`` ``from_pretrained`` loads the directory directly;
- ``trainfold.json``: a sidecar with the library version, step, cursor, caller metadata (best
  metric, log history), the run settings that define the trajectory, and each file's size and
  CRC-32.

It is written into a hidden sibling directory that holds ``checkpoint-is-incomplete.txt`` while
files are written; files and directories are fsynced, the marker is removed, and the directory is
renamed into place. Nothing is pickled and loading never runs code.

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
]

STATE_FILE = "state.safetensors"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SIDECAR_FILE = "trainfold.json"
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
_FORMAT = "trainfold-checkpoint"
_FORMAT_VERSION = 1
_NAME = re.compile(r"^checkpoint-(\d+)$")

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


def _replace_dir(tmp: Path, directory: Path) -> None:
    if not directory.exists():
        os.rename(tmp, directory)
        return
    old = directory.parent / f".{directory.name}.old-{secrets.token_hex(4)}"
    os.rename(directory, old)
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


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
    on_file: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``state`` to ``directory`` atomically and return the directory's path.

    ``model`` gives ``model.safetensors`` its ``state_dict`` names (and its ``config`` when
    ``config`` is not given); ``config`` (dict, or object with ``to_dict``/``to_json_string``)
    becomes ``config.json``. ``metadata`` (best metric, log history, ...) and ``settings`` (the
    run settings, checked on resume by ``check_compatible``) go into the JSON sidecar.
    ``save_only_model`` writes the weights but not the record. ``jit`` marks an emergency
    checkpoint that ``rotate`` never deletes. ``on_file(path)`` is called after each file is
    written (progress reports; tests use it to crash mid-save). An existing ``directory`` is
    replaced: it is renamed aside, the new one renamed in, the old one deleted (a crash between
    the two renames leaves ``checkpoint-{step}`` absent, so ``latest_checkpoint`` picks the one
    before). Call it on one rank only.

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
    if config is None and model is not None:
        config = getattr(model, "config", None)
    config_text = _config_text(config)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
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

        def write_tensors(name: str, tensors: Tree) -> None:
            safetensors.torch.save_file(tensors, tmp / name, metadata={"format": "pt"})
            record(name, _crc32_written(tmp / name, tensors))

        if not save_only_model:
            write_tensors(STATE_FILE, _storable(flatten(state)))
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
            "files": files,
        }
        _write_bytes(tmp / SIDECAR_FILE, (json.dumps(sidecar, indent=2) + "\n").encode())
        marker.unlink()
        _fsync_dir(tmp)
        _replace_dir(tmp, directory)
        _fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# -- reading --------------------------------------------------------------------------------------


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Return the checkpoint's JSON sidecar (step, cursor, metadata, settings, files) as a dict.

    Raises ``FileNotFoundError`` or ``ValueError`` naming the path when it is missing or unreadable.

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
        raise ValueError(
            f"{directory} is an incomplete checkpoint ({INCOMPLETE_MARKER} is present: its write was "
            "interrupted); resume from latest_checkpoint(output_dir) instead"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {directory} is not a complete trainfold checkpoint; "
            "resume from latest_checkpoint(output_dir) instead"
        )
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is corrupted (not valid JSON: {e}); resume from an earlier checkpoint") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a trainfold checkpoint sidecar (no \"format\": \"{_FORMAT}\")")
    if meta.get("format_version", 0) > _FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format {meta['format_version']}, written by trainfold "
            f"{meta.get('library_version')}; this trainfold reads format {_FORMAT_VERSION}: upgrade trainfold"
        )
    return meta


def _read_tensors(directory: Path, name: str, meta: Mapping[str, Any]) -> Tree:
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; the checkpoint is incomplete or was altered; "
            "resume from latest_checkpoint(output_dir) instead"
        )
    size = path.stat().st_size
    expected = meta.get("files", {}).get(name)
    if expected is not None and size != expected["bytes"]:
        raise ValueError(
            f"{path} is truncated or altered: it has {size} bytes, {SIDECAR_FILE} records "
            f"{expected['bytes']}; resume from an earlier checkpoint"
        )
    if expected is not None and _crc32(path) != expected["crc32"]:
        raise ValueError(
            f"{path} is corrupted: its CRC-32 differs from the one {SIDECAR_FILE} records; "
            "resume from an earlier checkpoint"
        )
    try:
        return safetensors.torch.load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None


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
    flat = _read_tensors(directory, STATE_FILE, meta)
    metrics = {k.removeprefix("metrics."): v for k, v in flat.items() if k.startswith("metrics.")}
    rest = {k: v for k, v in flat.items() if not k.startswith("metrics.")}
    state = _fit(rest, attrs.evolve(like, metrics={}), directory / STATE_FILE)
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
    path = directory / MODEL_FILE
    flat = _read_tensors(directory, MODEL_FILE, read_metadata(directory))
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


def is_complete(directory: str | os.PathLike) -> bool:
    """Say whether ``directory`` is a finished checkpoint: no marker, a sidecar, every file at its size.

    >>> is_complete("no/such/dir")
    False
    """
    directory = Path(directory)
    try:
        meta = read_metadata(directory)
        files = meta["files"]
        return all((directory / n).stat().st_size == f["bytes"] for n, f in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _step_of(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Return the complete ``checkpoint-{step}`` directories in ``output_dir``, oldest step first.

    >>> list_checkpoints("no/such/dir")
    []
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None and p.is_dir()]
    return [p for _, p in sorted(found) if is_complete(p)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """Return the complete checkpoint with the highest step in ``output_dir``, or ``None``.

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
    (an error if there is none); a path: that checkpoint, which must be complete.

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
    if not is_complete(path):
        raise ValueError(
            f"{path} is incomplete (a file is missing or has the wrong size); "
            f"resume from latest_checkpoint({str(path.parent)!r}) instead"
        )
    return path
