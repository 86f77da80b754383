"""Writing a checkpoint: its files into a hidden directory under a marker, fsynced, renamed into place.

Each file's hash is taken as it is written; nothing is pickled. Every file, then every directory, is
fsynced before the ``os.replace`` that puts the checkpoint into place, and the parent directory after:
when ``save`` returns, the checkpoint is on the disk (a killed process or a machine crash leaves the
previous one, or this one, whole).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from trainfold.ckpt import tensor_file
from trainfold.ckpt.faults import point
from trainfold.ckpt.layout import layout_of
from trainfold.ckpt.listing import list_checkpoints
from trainfold.ckpt.sidecar import (
    INCOMPLETE_MARKER,
    SIDECAR_FILE,
    STATE_FILE,
    new_sidecar,
    read_metadata,
    sidecar_bytes,
    validate_sidecar,
)
from trainfold.core.fingerprint import fingerprints
from trainfold.core.state import TrainState
from trainfold.core.tree import flatten

__all__ = ["save", "mark_jit", "is_disk_full", "disk_full"]

_PT = {"format": "pt"}
_MARKER_TEXT = b"trainfold is writing this checkpoint; if this file remains, the write failed.\n"


def _json(value: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    value = dict(value or {})
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable (plain numbers, strings, lists, dicts): {e}") from None
    return value


def mark_jit(directory: str | os.PathLike) -> Path:
    """Mark the complete checkpoint ``directory`` as the JIT one, in place; return its path.

    Only the sidecar changes (``"jit": true``), replaced atomically: the tensors are not written
    again, and ``directory`` is a complete checkpoint at every moment.

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> from trainfold.ckpt import is_complete
    >>> path = save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp() + "/checkpoint-0")
    >>> read_metadata(mark_jit(path))["jit"], is_complete(path)
    (True, True)
    """
    directory = Path(directory)
    meta = read_metadata(directory)
    if meta.get("jit"):
        return directory
    tmp = directory / f".{SIDECAR_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_bytes(sidecar_bytes({**meta, "jit": True}))
    fsync_dir(tmp)
    point("mark_jit:wrote")
    os.replace(tmp, directory / SIDECAR_FILE)
    point("mark_jit:replaced")
    fsync_dir(directory)
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
    tensors: Callable[[Path], Mapping[str, dict[str, int]]] | None = None,
    extra_files: Callable[[Path], Any] | None = None,
) -> Path:
    """Write ``state`` to ``directory`` atomically (see the module) and return the directory's path.

    Each tensor once (``layout``): the weights under ``model``'s ``state_dict`` names (a ``peft`` model: its
    adapter), the rest to ``state.safetensors``. ``config`` (default ``model.config``) becomes ``config.json``;
    ``metadata``, ``settings``, ``run`` go into the sidecar. ``save_only_model``: the weights only; ``jit``: marks
    the preemption checkpoint; ``tensors(tmp)`` writes its own files (``sharded``); ``extra_files(tmp)``: unlisted
    files (a tokenizer's). A full disk raises ``OSError(ENOSPC)`` naming the bytes needed and free and the previous one.

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> model = torch.nn.Linear(2, 1)
    >>> path = save(init_state(model, sgd(0.1)), tempfile.mkdtemp() + "/checkpoint-7", model=model, metadata={"n": 1})
    >>> sorted(p.name for p in path.iterdir()), read_metadata(path)["metadata"]
    (['model.safetensors', 'state.safetensors', 'trainfold.json'], {'n': 1})
    """
    layout, flat = layout_of(state, model, config), flatten(state)
    frozen = fingerprints({k: flat[k] for k in layout.frozen})
    parts = {layout.weights_file: {name: flat[key] for key, name in layout.weights.items()}}
    if not save_only_model:
        parts = {STATE_FILE: {k: v for k, v in flat.items() if k not in layout.weights and k not in frozen}, **parts}
    fields = dict[str, Any](metadata=_json(metadata, "save metadata"), settings=_json(settings, "save settings"))
    fields.update(run=run and dict(run), save_only_model=save_only_model, jit=jit, step=int(state.step))
    fields.update(cursor=(int(state.cursor.epoch), int(state.cursor.position)))
    if tensors is None:  # a sharded state's sidecar lists its shard files only
        fields.update(tensors={layout.weights_file: layout.weights}, frozen=frozen)

    def fill(tmp: Path) -> dict[str, Any]:
        files = dict(tensors(tmp)) if tensors is not None else _write_parts(tmp, parts)
        if layout.config_file is not None and layout.config_text is not None:
            (tmp / layout.config_file).write_bytes(layout.config_text.encode())
            files[layout.config_file] = tensor_file.entry_of(layout.config_text.encode())
        if extra_files is not None:
            extra_files(tmp)
        return new_sidecar(files=files, **fields)

    try:
        return _commit(Path(directory), fill)
    except Exception as e:
        if not is_disk_full(e):
            raise
        what = f"the {'JIT ' if jit else ''}checkpoint of step {int(state.step)} could not be written to {directory}"
        needed = sum(t.numel() * t.element_size() for part in parts.values() for t in part.values())
        raise disk_full(e, directory, what, needed) from e


def _write_parts(tmp: Path, parts: Mapping[str, Mapping[str, Tensor]]) -> dict[str, dict[str, int]]:
    """Write each tensor file of ``parts`` into ``tmp`` (fsynced later, with the rest); return their entries."""
    files = {}
    for name, part in parts.items():
        files[name] = tensor_file.write(tmp / name, part, metadata=_PT)
        point(f"save:wrote:{name}")
    return files


def fsync_dir(path: Path) -> None:
    """Flush a file, or a directory's entries, to the disk; a failure names the path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # os.fsync's error names no file
        raise OSError(e.errno, f"fsync failed ({e.strerror}); check the disk, then save again", str(path)) from e
    finally:
        os.close(fd)


def _commit(directory: Path, fill: Callable[[Path], dict[str, Any]]) -> Path:
    """Run ``fill(tmp)`` in a hidden sibling under the marker, write the sidecar it returns, fsync, swap it in."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (
        directory.parent / f".{directory.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}" for kind in ("tmp", "old")
    )
    tmp.mkdir()
    point("save:started")
    try:
        (tmp / INCOMPLETE_MARKER).write_bytes(_MARKER_TEXT)
        body = sidecar_bytes(fill(tmp))
        validate_sidecar(json.loads(body), tmp / SIDECAR_FILE)  # what is written can be read (a bad run= is refused)
        (tmp / SIDECAR_FILE).write_bytes(body)
        point("save:wrote:sidecar")
        mode = (tmp / SIDECAR_FILE).stat().st_mode & 0o777  # open's: 0666 less the umask
        for path in sorted(tmp.rglob("*")):  # one mode for every file, whoever wrote it (DCP writes its shards 0600)
            if path.is_file() and path.name != INCOMPLETE_MARKER:
                path.chmod(mode)
                fsync_dir(path)
        (tmp / INCOMPLETE_MARKER).unlink()
        for sub in [*(p for p in tmp.rglob("*") if p.is_dir()), tmp]:  # sharded/: DCP's files
            fsync_dir(sub)
        point("save:complete")
        if directory.exists():  # moved aside first: a crash between the renames leaves it there, run_lock puts it back
            os.replace(directory, old)
            point("replace:moved-aside")
        os.replace(tmp, directory)
        point("replace:renamed")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(directory.parent)  # the rename is durable before the replaced checkpoint goes
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
        point("replace:removed")
    return directory


def is_disk_full(e: BaseException) -> bool:
    """Say whether ``e`` is a full disk or quota (safetensors' own errors are ``OSError``s: ``tensor_file.write``)."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full(e: BaseException, path: str | os.PathLike, what: str, needed: int | None = None) -> OSError:
    """Return the ``OSError(ENOSPC)`` saying that ``what`` failed at ``path`` on a full disk: the bytes it needs
    (``needed``) and those free, and the newest intact checkpoint of the output_dir, to resume from."""
    path = Path(path)
    root = path.parent if path.name.startswith("checkpoint-") or path.suffix else path
    try:
        free = f"{shutil.disk_usage(root if root.exists() else root.parent).free:,} free"
    except OSError:
        free = "free space unknown"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = [p for p in list_checkpoints(root) if p != path]
    kept = f"{root} holds no earlier checkpoint"
    if previous:
        kept = f"the previous checkpoint {previous[-1]} (step {previous[-1].name[11:]}) is intact; resume from it"
    needs = f"it needs about {needed:,} bytes, " if needed is not None else ""
    return OSError(errno.ENOSPC, f"{what}: the disk is full ({needs}{free}); {kept} after freeing space", str(path))
