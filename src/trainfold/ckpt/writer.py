"""Writing a checkpoint: a state's files into a hidden directory, renamed atomically into place, fsynced.

The directory holds ``checkpoint-is-incomplete.txt`` while files are written; the marker is
removed and the directory is renamed into place (swapped in atomically with
``renameat2(RENAME_EXCHANGE)`` when one is already there, so some complete checkpoint is always
visible). Nothing is pickled. When the files reach the disk is the caller's choice:

- blocking (``syncs=None``, the default of ``save``): every file and directory is fsynced before
  the rename (each tensor file in a background thread while the next is written), so the
  checkpoint is durable when ``save`` returns;
- visible first, durable after (``syncs=atomic.Syncs()``, what ``train`` does): the files are
  written without waiting for the disk, the directory is renamed into place, and a thread of
  ``syncs`` fsyncs files, directory and parent, then calls ``on_durable`` (rotation). A killed
  process loses nothing (the page cache outlives it); a machine crash before the fsyncs end may
  leave the newest checkpoint truncated or corrupt, which its sizes and CRCs catch on load.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from trainfold.ckpt import tensor_file
from trainfold.ckpt.atomic import BackgroundSync, Syncs, fsync_dir, mark_durable, replace_dir, write_bytes
from trainfold.ckpt.faults import point
from trainfold.ckpt.layout import Layout, fingerprints, layout_of
from trainfold.ckpt.sidecar import (
    INCOMPLETE_MARKER,
    SIDECAR_FILE,
    STATE_FILE,
    new_sidecar,
    read_metadata,
    sidecar_bytes,
)
from trainfold.core.state import TrainState
from trainfold.core.tree import flatten

__all__ = ["save", "mark_jit"]

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

    Each tensor is written once: params and persistent buffers to ``model.safetensors`` under
    ``model``'s ``state_dict`` names (the state's own without ``model``), the rest to
    ``state.safetensors``; for a ``peft`` model the adapter to ``adapter_model.safetensors`` (+
    ``adapter_config.json``), its frozen base weights nowhere (their fingerprints to the sidecar).
    ``config`` (default: ``model.config``; a dict, or an object with ``to_dict``/``to_json_string``)
    becomes ``config.json``. ``metadata`` (best metric, log history, ...), ``settings`` (checked on
    resume by ``check_compatible``) and ``run`` (``{"id", "fingerprint"}``, ``trainfold.ckpt.run_dir``)
    go into the sidecar. ``save_only_model`` writes the weights but not the record; ``jit`` marks an
    emergency checkpoint that ``rotate`` never deletes; ``on_file(path)`` is called after each file
    (progress; tests crash there). ``tensors(tmp)`` writes its own tensor files into ``tmp`` and
    returns their ``{name: {"bytes", "crc32"}}`` (``trainfold.ckpt.sharded``). ``syncs``: fsync after the
    rename, in its thread (see the module); ``on_durable(path)`` runs once durable; ``extra_files(tmp)`` adds
    files that the sidecar does not list (a tokenizer's ``save_pretrained``). Call it on one rank only.

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> model = torch.nn.Linear(2, 1)
    >>> path = save(init_state(model, sgd(0.1)), tempfile.mkdtemp() + "/checkpoint-7", model=model, metadata={"n": 1})
    >>> sorted(p.name for p in path.iterdir()), read_metadata(path)["metadata"]
    (['checkpoint-is-durable.json', 'model.safetensors', 'state.safetensors', 'trainfold.json'], {'n': 1})
    """
    fields = {
        "metadata": _json(metadata, "save metadata"),
        "settings": _json(settings, "save settings"),
        "run": _check_run(run),
        "save_only_model": save_only_model,
        "jit": jit,
    }
    layout, flat = layout_of(state, model, config), flatten(state)
    frozen = fingerprints({k: flat[k] for k in layout.frozen})

    def write(tmp: Path, sync: BackgroundSync | None) -> dict[str, Any]:
        files = _write_files(tmp, flat, layout, frozen, save_only_model, on_file, tensors, sync, extra_files)
        where = {"tensors": {layout.weights_file: layout.weights}, "frozen": frozen} if tensors is None else {}
        cursor = (int(state.cursor.epoch), int(state.cursor.position))
        return new_sidecar(step=int(state.step), cursor=cursor, files=files, **where, **fields)

    if syncs is not None and tensors is not None:
        raise ValueError("syncs= is for a checkpoint written here; a sharded one (tensors=) is fsynced by its ranks")
    return _write_in_place(Path(directory), write, syncs, on_durable)


def _write_in_place(
    directory: Path,
    write: Callable[[Path, BackgroundSync | None], dict[str, Any]],
    syncs: Syncs | None = None,
    on_durable: Callable[[Path], Any] | None = None,
) -> Path:
    """Run ``write(tmp, sync)`` in a hidden sibling under the marker, write the sidecar it returns, swap it in.

    Blocking (``syncs`` None): the files ``write`` hands to ``sync`` are fsynced while it writes the
    next, all of them before the marker goes and the directory is renamed into place. Otherwise
    nothing is fsynced here (``sync`` is None): ``syncs`` does it after the rename.
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
        with BackgroundSync() as sync:
            write_bytes(tmp / SIDECAR_FILE, sidecar_bytes(write(tmp, sync if blocking else None)), fsync=blocking)
            sync.wait()
        point("save:wrote:sidecar")
        marker.unlink()
        if blocking:
            mark_durable(tmp)  # every file is fsynced already
            fsync_dir(tmp)
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
    sync: BackgroundSync | None,
    extra_files: Callable[[Path], Any] | None = None,
) -> dict[str, dict[str, int]]:
    """Write the tensor files (or have ``tensors`` write them) and the config into ``tmp``; return their entries.

    Each tensor file is handed to ``sync`` to be fsynced while the next one is written (``None``: not fsynced here).
    """
    files: dict[str, dict[str, int]] = {}

    def record(name: str, size: int, crc: int, durable: bool = True) -> None:
        files[name] = {"bytes": size, "crc32": crc}
        if not durable and sync is not None:
            sync.add(tmp / name)
        if on_file is not None:
            on_file(tmp / name)
        point(f"save:wrote:{name}")

    if tensors is not None:  # a sharded state: every rank's shards and their index
        files.update(tensors(tmp))
    else:
        if not save_only_model:
            rest = {k: v for k, v in flat.items() if k not in layout.weights and k not in frozen}
            record(STATE_FILE, *tensor_file.write(tmp / STATE_FILE, rest, metadata=_PT, fsync=False), durable=False)
        weights = {name: flat[key] for key, name in layout.weights.items()}
        size, crc = tensor_file.write(tmp / layout.weights_file, weights, metadata=_PT, fsync=False)
        record(layout.weights_file, size, crc, durable=False)
    if layout.config_text is not None:
        data = layout.config_text.encode()
        write_bytes(tmp / layout.config_file, data, fsync=sync is not None)
        record(layout.config_file, len(data), zlib.crc32(data))
    if extra_files is not None:
        extra_files(tmp)
    return files
