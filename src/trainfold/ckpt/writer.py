"""Writing a checkpoint: its files into a hidden directory under a marker, fsynced, renamed into place.

Each file's hash is taken as it is written; nothing is pickled. Blocking (``syncs=None``, ``save``'s
default): every file and directory is fsynced before the ``os.replace``, so the checkpoint is durable
when ``save`` returns. Visible first (``syncs=atomic.Syncs()``, what ``train`` does): a thread fsyncs
after the rename, then calls ``on_durable`` (rotation); a killed process loses nothing, and a machine
crash before the fsyncs end leaves a torn checkpoint that its sizes and hashes catch on load (a resume
then sets it aside and takes the previous one).
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
from trainfold.ckpt.atomic import Syncs, fsync_dir, mark_durable, replace_dir, write_bytes
from trainfold.ckpt.faults import point
from trainfold.ckpt.layout import Layout, layout_of
from trainfold.ckpt.listing import checkpoint_path, latest_checkpoint, list_checkpoints
from trainfold.ckpt.sidecar import (
    INCOMPLETE_MARKER,
    SIDECAR_FILE,
    STATE_FILE,
    new_sidecar,
    read_metadata,
    sidecar_bytes,
)
from trainfold.core.fingerprint import fingerprints
from trainfold.core.state import TrainState
from trainfold.core.tree import flatten

__all__ = ["save", "jit_checkpoint", "mark_jit", "is_disk_full", "disk_full"]

_PT = {"format": "pt"}
_MARKER_TEXT = b"trainfold is writing this checkpoint; if this file remains, the write failed.\n"


def _json(value: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    value = dict(value or {})
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable (plain numbers, strings, lists, dicts): {e}") from None
    return value


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
    write_bytes(tmp, sidecar_bytes({**meta, "jit": True}))
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
    on_file: Callable[[Path], None] | None = None,
    tensors: Callable[[Path], Mapping[str, dict[str, int]]] | None = None,
    syncs: Syncs | None = None,
    on_durable: Callable[[Path], Any] | None = None,
    extra_files: Callable[[Path], Any] | None = None,
) -> Path:
    """Write ``state`` to ``directory`` atomically (see the module) and return the directory's path.

    Each tensor is written once: params and persistent buffers to ``model.safetensors`` under ``model``'s
    ``state_dict`` names, the rest to ``state.safetensors``; a ``peft`` model's adapter to
    ``adapter_model.safetensors``, its frozen base nowhere (fingerprints in the sidecar). ``config``
    (default ``model.config``) becomes ``config.json``; ``metadata``, ``settings`` and ``run`` go into the
    sidecar. ``save_only_model``: the weights only; ``jit``: never rotated; ``on_file(path)`` after each
    file; ``tensors(tmp)`` writes its own files and returns their entries (``sharded``); ``syncs``: fsync
    after the rename, then ``on_durable(path)``; ``extra_files(tmp)`` adds files the sidecar does not list
    (a tokenizer's ``save_pretrained``). A full disk raises ``OSError(ENOSPC)`` naming the bytes
    needed and free and the intact previous checkpoint. Call it on one rank only.

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> model = torch.nn.Linear(2, 1)
    >>> path = save(init_state(model, sgd(0.1)), tempfile.mkdtemp() + "/checkpoint-7", model=model, metadata={"n": 1})
    >>> sorted(p.name for p in path.iterdir()), read_metadata(path)["metadata"]
    (['checkpoint-is-durable.json', 'model.safetensors', 'state.safetensors', 'trainfold.json'], {'n': 1})
    """
    directory, run = Path(directory), _check_run(run)
    fields = dict[str, Any](metadata=_json(metadata, "save metadata"), settings=_json(settings, "save settings"))
    fields.update(run=run, save_only_model=save_only_model, jit=jit)
    layout = layout_of(state, model, config)
    flat = flatten(state)
    frozen = fingerprints({k: flat[k] for k in layout.frozen})

    def write(tmp: Path, fsync: bool) -> dict[str, Any]:
        files = _write_files(tmp, flat, layout, frozen, save_only_model, on_file, tensors, fsync, extra_files)
        where = dict[str, Any](tensors={layout.weights_file: layout.weights}, frozen=frozen) if tensors is None else {}
        cursor = (int(state.cursor.epoch), int(state.cursor.position))
        return new_sidecar(step=int(state.step), cursor=cursor, files=files, **where, **fields)

    if syncs is not None and tensors is not None:
        raise ValueError("syncs= is for a checkpoint written here; a sharded one (tensors=) is fsynced by its ranks")
    try:
        return _write_in_place(directory, write, syncs, on_durable)
    except Exception as e:
        if not is_disk_full(e):
            raise
        what = f"the {'JIT ' if jit else ''}checkpoint of step {int(state.step)} could not be written to {directory}"
        kept = (t for k, t in flat.items() if k in layout.weights or not (save_only_model or k in frozen))
        raise disk_full(e, directory, what, sum(t.numel() * t.element_size() for t in kept)) from e


def is_disk_full(e: BaseException) -> bool:
    """Say whether ``e`` is a full disk or quota: an ``OSError`` or safetensors' own error type.

    >>> is_disk_full(OSError(errno.ENOSPC, "No space left on device")), is_disk_full(OSError(errno.EIO, "I/O"))
    (True, False)
    """
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(e)
    return type(e).__name__ == "SafetensorError" and any(
        s in text for s in ("No space left", "StorageFull", "os error 28", "code: 28", "Disk quota")
    )


def disk_full(e: BaseException, path: str | os.PathLike, what: str, needed: int | None = None) -> OSError:
    """Return the ``OSError(ENOSPC)`` saying that ``what`` failed at ``path`` on a full disk: the bytes it needs
    (``needed``) and those free, and the newest intact checkpoint of the output_dir, to resume from.

    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> disk_full(OSError(errno.ENOSPC, "full"), out + "/checkpoint-4", "the save", 10).strerror.split(": the disk")[0]
    'the save'
    """
    path = Path(path)
    root = path.parent if path.name.startswith("checkpoint-") or path.suffix else path
    try:
        free = f"{shutil.disk_usage(root if root.exists() else root.parent).free:,} free"
    except OSError:
        free = "free space unknown"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = latest_checkpoint(root)
    if previous is not None and previous == path:
        previous = next(reversed([p for p in list_checkpoints(root) if p != path]), None)
    kept = (
        f"the previous checkpoint {previous} (step {previous.name.rsplit('-', 1)[-1]}) is intact; resume from it"
        if previous is not None
        else f"{root} holds no earlier checkpoint"
    )
    needs = f"it needs about {needed:,} bytes, " if needed is not None else ""
    return OSError(errno.ENOSPC, f"{what}: the disk is full ({needs}{free}); {kept} after freeing space", str(path))


def _write_in_place(
    directory: Path,
    write: Callable[[Path, bool], dict[str, Any]],
    syncs: Syncs | None = None,
    on_durable: Callable[[Path], Any] | None = None,
) -> Path:
    """Run ``write(tmp, fsync)`` in a hidden sibling under the marker, write the sidecar it returns, swap it in.

    Blocking (``syncs`` None): every file is fsynced as it is written, before the marker goes and the
    directory is renamed into place. Otherwise nothing is fsynced here: ``syncs`` does it after the rename.
    """
    blocking = syncs is None
    if syncs is not None:
        syncs.wait()  # one at a time: the previous checkpoint is durable (or its failure raised) first
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    point("save:started")
    try:
        marker = tmp / INCOMPLETE_MARKER
        write_bytes(marker, _MARKER_TEXT, fsync=blocking)
        write_bytes(tmp / SIDECAR_FILE, sidecar_bytes(write(tmp, blocking)), fsync=blocking)
        mode = (tmp / SIDECAR_FILE).stat().st_mode & 0o777  # open's: 0666 less the umask
        for path in tmp.rglob("*"):  # one mode for every file, whoever wrote it (DCP writes its shards 0600)
            if path.is_file() and path.stat().st_mode & 0o777 != mode:
                path.chmod(mode)
        point("save:wrote:sidecar")
        marker.unlink()
        if blocking:
            mark_durable(tmp)  # every file is fsynced already
            for sub in [tmp, *(p for p in tmp.iterdir() if p.is_dir())]:  # sharded/: DCP's files
                fsync_dir(sub)
        point("save:complete")
        replaced = replace_dir(tmp, directory, remove_old=blocking)  # the old one goes once the new is durable
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if syncs is not None:
        syncs.add(directory, replaced=replaced, then=on_durable)
        return directory
    fsync_dir(directory.parent)
    if on_durable is not None:
        on_durable(directory)
    return directory


def _write_files(
    tmp: Path,
    flat: Mapping[str, Tensor],
    layout: Layout,
    frozen: Mapping[str, str],
    save_only_model: bool,
    on_file: Callable[[Path], None] | None,
    tensors: Callable[[Path], Mapping[str, dict[str, int]]] | None,
    fsync: bool,
    extra_files: Callable[[Path], Any] | None = None,
) -> dict[str, dict[str, int]]:
    """Write the tensor files (or have ``tensors`` write them) and the config into ``tmp``; return their entries."""
    files: dict[str, dict[str, int]] = {}

    def record(name: str, entry: dict[str, int]) -> None:
        files[name] = entry
        if on_file is not None:
            on_file(tmp / name)
        point(f"save:wrote:{name}")

    if tensors is not None:  # a sharded state: every rank's shards and their index
        files.update(tensors(tmp))
    else:
        if not save_only_model:
            rest = {k: v for k, v in flat.items() if k not in layout.weights and k not in frozen}
            record(STATE_FILE, tensor_file.write(tmp / STATE_FILE, rest, metadata=_PT, fsync=fsync))
        weights = {name: flat[key] for key, name in layout.weights.items()}
        record(layout.weights_file, tensor_file.write(tmp / layout.weights_file, weights, metadata=_PT, fsync=fsync))
    if layout.config_file is not None and layout.config_text is not None:
        config = tensor_file.write_hashed(tmp / layout.config_file, layout.config_text.encode(), fsync=fsync)
        record(layout.config_file, config)
    if extra_files is not None:
        extra_files(tmp)
    return files


def jit_checkpoint(state: TrainState, output_dir: str | os.PathLike, **save_options: Any) -> Path:
    """Save ``state`` as ``output_dir/checkpoint-{step}`` marked JIT (never rotated away); return its path.

    ``save_options`` are ``writer.save``'s (model, config, metadata, settings).

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> path = jit_checkpoint(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp())
    >>> path.name, read_metadata(path)["jit"]
    ('checkpoint-0', True)

    A full disk raises ``OSError(ENOSPC)`` naming the checkpoint's path, the bytes it needs and the
    previous checkpoint, which is intact (the write goes to a temporary directory that is removed).
    """
    return save(state, checkpoint_path(output_dir, int(state.step)), jit=True, **save_options)
