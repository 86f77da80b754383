"""Sharded checkpoints: every rank writes its DTensor shards as safetensors, indexed in JSON, on DCP's planner.

A state whose params and optimizer state are ``DTensor`` shards (``fsdp="full_shard"``) is saved by
all ranks at once with ``torch.distributed.checkpoint`` (DCP) and a storage writer of its own, so
the directory holds only safetensors and JSON, never DCP's pickled ``.metadata``:

- ``state-{rank}-of-{world}.safetensors``: rank ``rank``'s slab of every tensor, under the state's
  dotted names (``trainfold.core.tree.flatten``); replicated tensors (buffers, counters) once, on one rank;
  each file's header also carries DCP's ``DCP_SHARDING_INFO`` (the slab offsets);
- ``state.index.json``: the sharding: per tensor its dtype, global shape and chunks (file, offsets, sizes);
- ``model.safetensors`` (+ ``config.json``) on request (``consolidate``): the full weights under the
  model's ``state_dict`` names, for ``from_pretrained``;
- ``trainfold.json``: the sidecar of ``trainfold.ckpt.sidecar`` (every file's size and CRC-32).

The directory is built by ``writer.save`` (temporary directory, marker, fsync, atomic rename):
rank 0 renames it only after DCP has gathered every rank's finished writes. Loading goes through
DCP's planner too, so a checkpoint of 2 ranks loads into 1, 3 or 4 (``reader.load`` calls
``load`` here); nothing is pickled and loading never runs code.

``Saver`` writes a run's checkpoints, sharded or not, synchronously or in a background thread
(``async_save``): the step stalls only for the copy of the state to the CPU.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import safetensors.torch
import torch
import torch.distributed as dist
from torch import Tensor

from trainfold.ckpt import writer
from trainfold.ckpt.atomic import FSYNC_MODES, Syncs
from trainfold.ckpt.faults import point
from trainfold.ckpt.layout import model_weights
from trainfold.ckpt.sidecar import INDEX_FILE, MODEL_FILE, SIDECAR_FILE, CheckpointError, read_metadata
from trainfold.core.state import TrainState
from trainfold.core.tree import flatten, map_tensors, unflatten

__all__ = ["Saver", "is_sharded", "save", "load", "read_index"]

_NAME_BYTES = 256  # the temporary directory's name, sent from rank 0 to the others


def _storage() -> types.ModuleType:
    from trainfold.ckpt import sharded_storage

    return sharded_storage


def _dtensor_type() -> type | None:
    """Return ``DTensor`` if its module is loaded (else no tensor can be one, and DCP need not load)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(state: Any) -> bool:
    """Say whether any tensor of ``state`` is a ``DTensor`` (then every rank takes part in its checkpoint).

    >>> import torch
    >>> is_sharded({"w": torch.zeros(2)})
    False
    """
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in flatten(state).values())


def _consolidate(tmp: Path, index: Mapping[str, Any], model: Any) -> dict[str, dict[str, int]]:
    """Write ``model.safetensors`` from the shard files just written (rank 0, one process); return its entry."""
    full = {
        k: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
        for k, e in index["tensors"].items()
        if k.startswith(("params.", "buffers."))
    }
    _storage().read_shards(full, tmp, index)
    split = types.SimpleNamespace(
        params={k.removeprefix("params."): v for k, v in full.items() if k[0] == "p"},
        buffers={k.removeprefix("buffers."): v for k, v in full.items() if k[0] == "b"},
    )
    path = tmp / MODEL_FILE
    safetensors.torch.save_file(model_weights(split, model), path, metadata={"format": "pt"})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    point("sharded:wrote:model")
    return {MODEL_FILE: {"bytes": path.stat().st_size, "crc32": _storage().crc32_of(path)}}


def _announce(name: str, group: Any) -> str:
    """Send rank 0's ``name`` (the temporary directory; empty: it failed) to every rank; return it."""
    buf = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    data = name.encode()
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    dist.broadcast(buf, group=group, group_src=0)
    return bytes(buf.tolist()).rstrip(b"\0").decode()


def save(
    state: TrainState,
    directory: str | os.PathLike,
    *,
    group: Any = None,
    model: Any = None,
    consolidate: bool = False,
    **options: Any,
) -> Path:
    """Write the sharded ``state`` to ``directory`` from every rank at once (call it on all of them).

    Rank 0 builds the directory with ``writer.save`` (``options``: its metadata, settings,
    run, jit, save_only_model, config) and renames it into place only after DCP has gathered every
    rank's finished, fsynced shard file; every rank returns once it is there. ``consolidate``
    (implied by ``save_only_model``) also writes ``model.safetensors`` with ``model``'s
    ``state_dict`` names. ``group``: the process group of the collectives (default: the world). A
    failure on any rank raises on every rank, naming the rank.
    """
    directory = Path(directory)
    flat = flatten(state)
    only_model = bool(options.get("save_only_model"))
    if only_model:
        flat = {k: v for k, v in flat.items() if k.startswith(("params.", "buffers."))}
    many = dist.is_initialized() and dist.get_world_size(group) > 1
    if many and dist.get_rank(group) != 0:
        name = _announce("", group)
        if not name:
            raise CheckpointError(f"rank 0 could not start the checkpoint {directory}; its error says why")
        _storage().write_shards(directory.parent / name, flat, group)
        if _announce("", group) != "done":  # rank 0 renames it into place: returning means it is there
            raise CheckpointError(f"rank 0 could not complete the checkpoint {directory}; its error says why")
        return directory
    phase = "starting"  # then "writing" (DCP raises on every rank), then "written" (rank 0 alone may fail)

    def tensors(tmp: Path) -> dict[str, dict[str, int]]:
        nonlocal phase
        if many:
            _announce(tmp.name, group)
        phase = "writing"
        writer = _storage().write_shards(tmp, flat, group)
        phase = "written"
        files = dict(writer.files)
        if consolidate or only_model:
            files.update(_consolidate(tmp, writer.index, model))
        return files

    try:
        path = writer.save(state, directory, model=model, tensors=tensors, **options)
    except BaseException:
        if many and phase != "writing":
            _announce("", group)  # the other ranks stop waiting and raise
        raise
    if many:
        _announce("done", group)
    return path


def _cpu_copy(t: Tensor) -> Tensor:
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        local = t.to_local().detach().to("cpu", copy=True)
        return dtensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def _fully_sharded(model: Any) -> bool:
    """Say whether ``model`` is an FSDP2 module (a peft one keeps its own class: its layout asks for it)."""
    from trainfold.ckpt.adapters import is_peft_model

    fsdp = model is not None and any(c.__name__ == "FSDPModule" for c in type(model).__mro__)
    return fsdp and not is_peft_model(model)


class _Structure:
    """What a checkpoint reads of a ``fully_shard`` module (its names, its config), taken on the caller's thread.

    FSDP2's ``state_dict`` pre-hook reshards the module: called from an async save's writer thread, it
    would reshard the module under the next step's forward.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._params, self._buffers = list(model.named_parameters()), list(model.named_buffers())
        self._state = model.state_dict(keep_vars=True)

    def named_parameters(self) -> Any:
        return iter(self._params)

    def named_buffers(self) -> Any:
        return iter(self._buffers)

    def state_dict(self, keep_vars: bool = False) -> dict[str, Any]:
        return dict(self._state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@attrs.define(eq=False)
class Saver:
    """Write a run's checkpoints: sharded ones from every rank, replicated ones from the caller; sync or async.

    With ``async_save`` the state is copied to the CPU (the step stalls for that copy only) and a
    thread writes it; the directory appears, complete, when every rank has finished (the rename
    is the last act). ``fsync="background"`` (the default) makes a replicated checkpoint visible
    first and durable after (``writer``: renamed into place, then fsynced in a thread);
    ``"blocking"`` fsyncs before the rename (sharded checkpoints always). One save runs at a
    time: the next ``save`` and ``wait`` wait for it and its fsyncs, and raise their error
    (``atomic.NotDurableError`` naming the checkpoint). ``on_commit(path)`` runs on the rank that
    renamed it once it is durable (rotation, best bookkeeping). Sharded saves get a gloo process
    group of their own (made on the first, by every rank), so the writer thread's collectives never meet the step's.

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> saver = Saver(async_save=True)
    >>> path = saver.save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp() + "/checkpoint-0")
    >>> from trainfold.ckpt import is_complete
    >>> saver.wait() == path, is_complete(path)
    (True, True)
    """

    async_save: bool = False
    consolidate: bool = False
    fsync: str = attrs.field(default="background", validator=attrs.validators.in_(FSYNC_MODES))
    _group: Any = attrs.field(default=None, init=False)
    _job: Any = attrs.field(default=None, init=False)
    _syncs: Syncs = attrs.field(factory=Syncs, init=False)

    def save(
        self,
        state: TrainState,
        directory: str | os.PathLike,
        *,
        on_commit: Callable[[Path], Any] | None = None,
        wait: bool = False,
        **options: Any,
    ) -> Path:
        """Save ``state`` to ``directory`` (``writer.save``'s ``options``); return its path (async: to be).

        ``wait=True`` returns when it is complete, also with ``async_save`` (a JIT save at preemption).
        """
        self.wait()
        directory = Path(directory)
        if self.async_save and not wait and _fully_sharded(options.get("model")):
            options["model"] = _Structure(options["model"])  # read here, not in the writer thread
        if is_sharded(state):
            if dist.is_initialized() and self._group is None:
                self._group = dist.new_group(backend="gloo")
            write = functools.partial(save, group=self._group, consolidate=self.consolidate, **options)
            commits = not dist.is_initialized() or dist.get_rank() == 0
        elif self.fsync == "background":  # on_commit once durable, from the fsync thread
            write = functools.partial(writer.save, syncs=self._syncs, on_durable=on_commit, **options)
            commits, on_commit = False, None
        else:
            write, commits = functools.partial(writer.save, **options), True

        def job(staged: TrainState) -> Path:
            path = write(staged, directory)
            if on_commit is not None and commits:
                on_commit(path)
            return path

        if not self.async_save or wait:
            return job(state)
        staged, outcome = map_tensors(_cpu_copy, state), {}

        def run() -> None:
            try:
                outcome["path"] = job(staged)
            except BaseException as e:
                outcome["error"] = e

        thread = threading.Thread(target=run, name=f"trainfold-save-{directory.name}", daemon=True)
        thread.start()
        self._job = (thread, outcome)
        return directory

    def pending(self) -> bool:
        """Say whether a save is still being written or made durable."""
        return (self._job is not None and self._job[0].is_alive()) or self._syncs.pending()

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any) and its fsyncs; return its path, or raise its error."""
        path = None
        if self._job is not None:
            thread, outcome = self._job
            self._job = None
            thread.join()
            if "error" in outcome:
                self._syncs.wait()
                raise outcome["error"]
            path = outcome["path"]
        durable = self._syncs.wait()
        return path if path is not None or not durable else durable[-1]


# -- loading ---------------------------------------------------------------------------------------


def _check_file(directory: Path, name: str, meta: Mapping[str, Any]) -> Path:
    path = directory / name
    expected = meta["files"].get(name)
    if expected is None:
        raise CheckpointError(
            f"{directory / SIDECAR_FILE} does not list {name}, which {INDEX_FILE} "
            "names: the checkpoint cannot be checked; resume from an earlier checkpoint"
        )
    if path.is_symlink() or not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; the checkpoint is incomplete or was altered; "
            "resume from latest_checkpoint(output_dir) instead"
        )
    if path.stat().st_size != expected["bytes"]:
        raise CheckpointError(
            f"{path} is truncated or altered: it has {path.stat().st_size} bytes, "
            f"{SIDECAR_FILE} records {expected['bytes']}; resume from an earlier checkpoint"
        )
    if _storage().crc32_of(path) != expected["crc32"]:
        raise CheckpointError(
            f"{path} is corrupted: its CRC-32 differs from the one {SIDECAR_FILE} "
            "records; resume from an earlier checkpoint"
        )
    return path


def read_index(directory: str | os.PathLike) -> dict[str, Any]:
    """Return the checked JSON index of a sharded checkpoint (sizes and CRCs of it and every shard file)."""
    directory = Path(directory)
    meta = read_metadata(directory)
    path = _check_file(directory, INDEX_FILE, meta)
    index = json.loads(path.read_bytes())
    fmt = _storage().INDEX_FORMAT
    if not isinstance(index, dict) or index.get("format") != fmt or not isinstance(index.get("tensors"), dict):
        raise CheckpointError(
            f'{path} is not a trainfold sharded-state index (no "format": "{fmt}"); resume from another checkpoint'
        )
    for name in sorted({c["file"] for e in index["tensors"].values() for c in e["chunks"]}):
        _check_file(directory, name, meta)
    return index


def load(directory: str | os.PathLike, like: TrainState, *, weights_only: bool = False) -> TrainState:
    """Return the sharded checkpoint in ``directory`` laid out like ``like``, on any number of ranks.

    ``like``'s DTensors get this rank's slab of each tensor (resharded by DCP's planner to the
    mesh ``like`` is on); its plain tensors get the whole tensor, so one process loads a
    checkpoint of many ranks. No collectives: each rank reads what it needs. ``weights_only``
    loads params and buffers only (``reader.load_weights``). ``metrics`` load as saved.
    """
    directory = Path(directory)
    index, meta = read_index(directory), read_metadata(directory)
    saved = index["tensors"]
    base = attrs.evolve(like, metrics={})
    wanted = {k: v for k, v in flatten(base).items() if not weights_only or k.startswith(("params.", "buffers."))}
    missing = sorted(k for k in wanted if k not in saved and not (weights_only and k.startswith("buffers.")))
    unexpected = [] if weights_only else sorted(k for k in saved if k not in wanted and not k.startswith("metrics."))
    if missing or unexpected:
        raise KeyError(
            f"{directory / INDEX_FILE} does not fit the template state; was it saved from a different "
            f"model or optimizer? missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    bad = [
        f"{k}: saved {saved[k]['shape']} {saved[k]['dtype']}, expected {list(v.shape)} "
        f"{str(v.dtype).removeprefix('torch.')}"
        for k, v in wanted.items()
        if k in saved and (saved[k]["shape"] != list(v.shape) or saved[k]["dtype"] != str(v.dtype)[6:])
    ]
    if bad:
        raise ValueError(
            f"{directory / INDEX_FILE} does not fit the template state (a different model size?): " + "; ".join(bad[:8])
        )
    targets = {k: torch.empty_like(v) for k, v in wanted.items() if k in saved}
    if not weights_only:
        targets |= {
            k: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
            for k, e in saved.items()
            if k.startswith("metrics.")
        }
    _storage().read_shards(targets, directory, index)
    if weights_only:
        return attrs.evolve(
            like,
            params={k: targets[f"params.{k}"] for k in like.params},
            buffers={k: targets.get(f"buffers.{k}", v) for k, v in like.buffers.items()},
        )
    metrics = {k.removeprefix("metrics."): v for k, v in targets.items() if k.startswith("metrics.")}
    state = unflatten({k: v for k, v in targets.items() if not k.startswith("metrics.")}, like=base)
    if int(state.step) != meta["step"]:
        raise CheckpointError(
            f"{directory / SIDECAR_FILE}: field 'step' is {meta['step']} but the "
            f"shards hold {int(state.step)}; resume from another checkpoint"
        )
    return attrs.evolve(state, metrics=metrics)
