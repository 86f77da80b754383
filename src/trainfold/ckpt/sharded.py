"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP): every rank writes its DTensor shards as safetensors.

DCP's ``HuggingFaceStorageWriter`` writes ``sharded/``, a file per rank; its reader and load planner reshard them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from trainfold.ckpt import tensor_file, writer
from trainfold.ckpt.faults import point
from trainfold.ckpt.layout import model_weights
from trainfold.ckpt.sidecar import MODEL_FILE, SHARD_DIR, CheckpointError, hash_chunk, read_metadata
from trainfold.core.adapters import is_peft_model
from trainfold.core.state import TrainState
from trainfold.core.tree import flatten, map_tensors
from trainfold.distributed.distributed import named_failures

__all__ = ["Saver", "is_sharded", "save_sharded", "read_sharded"]


def is_sharded(state: Any) -> bool:
    """Say whether any tensor of ``state`` is a ``DTensor`` (then every rank takes part in its checkpoint)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # not loaded: none is one
    return dtensor is not None and any(isinstance(t, dtensor) for t in flatten(state).values())


@functools.cache
def _writer_type() -> type:
    """DCP's safetensors writer, each shard file hashed by the rank that wrote it (imported late: DCP loads slowly)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.futures import Future

    class Writer(HuggingFaceStorageWriter):
        files: dict[str, dict[str, int]] = {}

        def write_data(self, plan: Any, planner: Any) -> Any:
            results, entries = super().write_data(plan, planner).wait(), {}
            for name in sorted({r.storage_data.relative_path for r in results}):
                entries[name] = tensor_file.digest_of(Path(self.path) / name)
                point(f"sharded:wrote:{name}")
            out: Future[list[Any]] = Future()  # each entry travels to the coordinator with DCP's results
            named = [(r, r.storage_data.relative_path) for r in results]
            out.set_result([dataclasses.replace(r, storage_data={n: entries[n]}) for r, n in named])
            return out

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            self.files = {f"{SHARD_DIR}/{n}": e for rs in results for r in rs for n, e in r.storage_data.items()}

    return Writer


def _write_shards(tmp: Path, flat: dict[str, Tensor], group: Any) -> dict[str, dict[str, int]]:
    """Write ``flat`` into ``tmp/sharded`` from every rank of ``group`` (``dcp.save``); return the files' entries."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    storage = _writer_type()(str(tmp / SHARD_DIR), save_distributed=True)
    try:
        dcp.save(dict(flat), storage_writer=storage, process_group=group, no_dist=not dist.is_initialized())
    except CheckpointException as e:  # a BaseException: re-raised on every rank, naming each that failed
        failures = sorted(e.failures.items())
        text = f"writing the shards of {tmp} failed on " + "; ".join(
            f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in failures
        )
        if failures and isinstance(failures[0][1][0], OSError):  # a full disk stays one (the run names the bytes)
            raise OSError(failures[0][1][0].errno, text) from None
        raise CheckpointError(f"{text}; the checkpoint was not written (the previous one is intact)") from None
    return storage.files


def _read(directory: Path, like: Mapping[str, Tensor], whole: tuple[str, ...]) -> dict[str, Tensor]:
    """Every saved key: ``like``'s (same shape, dtype) read into its layout, those under ``whole`` as saved, any
    other a zero-stride view of its shape and dtype (no memory), for the template check to refuse by name."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    storage, targets, out = HuggingFaceStorageReader(str(directory / SHARD_DIR)), {}, {}
    try:
        saved: dict[str, Any] = storage.read_metadata().state_dict_metadata
    except Exception as e:  # a header that hashes right but is not safetensors: written so, never loadable
        raise CheckpointError(f"{directory / SHARD_DIR} holds unreadable shards ({e}); resume from another") from None
    for k, m in saved.items():
        size, dtype, t = torch.Size(m.size), m.properties.dtype, like.get(k)
        if t is not None and (t.shape, t.dtype) == (size, dtype):
            targets[k] = torch.empty_like(t)
        elif t is None and k.startswith(whole):
            targets[k] = torch.empty(size, dtype=dtype)
        out[k] = targets.get(k, torch.zeros((), dtype=dtype).expand(size))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load(targets, storage_reader=storage, no_dist=True)
    return out


def _consolidate(tmp: Path, model: Any) -> dict[str, dict[str, int]]:
    """Write ``model.safetensors`` from the shard files just written (rank 0, one process); return its entry."""
    full = _read(tmp, {}, ("params.", "buffers."))
    part = lambda p: {k.removeprefix(p): v for k, v in full.items() if k.startswith(p)}
    weights = model_weights(TrainState(params=part("params."), buffers=part("buffers."), opt_state=None), model)
    entry = tensor_file.write(tmp / MODEL_FILE, weights, metadata={"format": "pt"})
    point("sharded:wrote:model")
    return {MODEL_FILE: entry}


def save_sharded(
    state: TrainState,
    directory: str | os.PathLike,
    *,
    group: Any = None,
    model: Any = None,
    consolidate: bool = False,
    save_only_model: bool = False,
    **options: Any,
) -> Path:
    """Write the sharded ``state`` to ``directory`` from every rank at once (call it on all of them).

    Rank 0's ``writer.save`` (with ``options``) renames it into place once DCP has every rank's hashed shard file;
    every rank returns once it is there, or raises for a failure on any rank, naming it. ``consolidate`` (implied
    by ``save_only_model``): also ``model.safetensors``. ``group``: the collectives' (default: the world)."""
    directory, flat = Path(directory), flatten(state)
    if save_only_model:
        consolidate, flat = True, {k: v for k, v in flat.items() if k.startswith(("params.", "buffers."))}
    many = dist.is_initialized() and dist.get_world_size(group) > 1

    def announce(name: str) -> str:  # rank 0's name (the temporary directory; "done"; empty: it failed) to all
        box = [name]
        with named_failures(dist.get_rank(group), dist.get_world_size(group)):  # a killed rank named, not gloo's
            dist.broadcast_object_list(box, group=group, group_src=0)
        return str(box[0])

    if many and dist.get_rank(group) != 0:
        if not (name := announce("")):
            raise CheckpointError(f"rank 0 could not start the checkpoint {directory}; its error says why")
        _write_shards(directory.parent / name, flat, group)
        if announce("") != "done":  # rank 0 renames it into place: returning means it is there
            raise CheckpointError(f"rank 0 could not complete the checkpoint {directory}; its error says why")
        return directory
    writing = False  # while DCP writes, a failure raises on every rank by itself

    def tensors(tmp: Path) -> dict[str, dict[str, int]]:
        nonlocal writing
        if many:
            announce(tmp.name)
        writing = True
        files = _write_shards(tmp, flat, group)
        writing = False
        return files | (_consolidate(tmp, model) if consolidate else {})

    try:
        path = writer.save(state, directory, model=model, tensors=tensors, save_only_model=save_only_model, **options)
    except BaseException:
        if many and not writing:
            announce("")  # the other ranks stop waiting and raise
        raise
    if many:
        announce("done")
    return path


def _cpu_copy(t: Any) -> Tensor:
    """A CPU copy of ``t`` (of a DTensor: of its local shard, on the same mesh)."""
    if not is_sharded(t):
        return t.detach().to("cpu", copy=True)
    local = t.to_local().detach().to("cpu", copy=True)
    return type(t).from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


@attrs.define(eq=False)
class Saver:
    """Write a run's checkpoints: sharded ones from every rank, replicated ones from the caller; sync or async.

    ``async_save``: a daemon thread writes a CPU copy (the step stalls for the copy only). One save runs at a
    time: the next ``save`` and ``wait`` wait for it and raise its error. ``on_commit(path)`` runs on the rank
    that renamed it into place. Sharded saves get a gloo group of their own (made on the first, by every rank),
    so the writer thread's collectives never meet the step's.

    >>> import tempfile, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> saver = Saver(async_save=True)
    >>> path = saver.save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp() + "/checkpoint-0")
    >>> saver.wait() == path, path.exists()
    (True, True)
    """

    async_save: bool = False
    consolidate: bool = False
    _group: Any = attrs.field(default=None, init=False)
    _job: Future[Path] | None = attrs.field(default=None, init=False)

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
        ``wait=True`` returns once it is complete, also with ``async_save`` (a JIT save at preemption)."""
        self.wait()
        directory, later, job = Path(directory), self.async_save and not wait, Future[Path]()
        if later and not is_peft_model(options.get("model")):  # a peft one: its own layout
            options["model"] = held_structure(options.get("model"))  # read here, not in the writer thread
        sharded = is_sharded(state)
        if sharded and dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        write = functools.partial(save_sharded, group=self._group, consolidate=self.consolidate)
        commits = not sharded or not dist.is_initialized() or dist.get_rank() == 0

        def run(staged: TrainState) -> None:
            try:
                path = (write if sharded else writer.save)(staged, directory, **options)
                if on_commit is not None and commits:
                    on_commit(path)
                job.set_result(path)
            except BaseException as e:  # raised by wait (or below), in the caller's thread
                job.set_exception(e)

        if not later:
            run(state)
            return job.result()
        self._job = job
        # a daemon, not an executor's worker: a process whose peers died exits without waiting for its collectives
        threading.Thread(
            target=run, args=(map_tensors(_cpu_copy, state),), name=f"trainfold-save-{directory.name}", daemon=True
        ).start()
        return directory

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any); return its path, or raise its error."""
        job, self._job = self._job, None
        return None if job is None else job.result()


def read_sharded(directory: str | os.PathLike, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return the checkpoint's tensors by flattened key (``_read``), each listed file (and no other) checked first.

    A DTensor of ``like`` gets this rank's slab (resharded to its mesh), a plain tensor the whole: any number of
    ranks loads it."""
    directory = Path(directory)
    meta = read_metadata(directory)
    files = meta["files"]
    listed = sorted(n for n in files if n.startswith(f"{SHARD_DIR}/"))
    present = sorted(f"{SHARD_DIR}/{p.name}" for p in (directory / SHARD_DIR).glob("*"))
    if present != listed:
        raise CheckpointError(
            f"{directory / SHARD_DIR} holds {present}, but {directory / 'trainfold.json'} lists {listed}: the "
            "checkpoint was altered; resume from an earlier checkpoint"
        )
    for name in listed:
        tensor_file.read(directory / name, files[name], hash_chunk(meta))  # checked, then left to DCP's reader
    return _read(directory, like, ("metrics.",))


def held_structure(model: Any) -> Any:
    """Return what a checkpoint reads of ``model`` (names, config, ``state_dict``), taken now for an FSDP2
    module (``model`` itself otherwise): an async save must not call FSDP2's resharding hooks from its thread.

    >>> lin = torch.nn.Linear(2, 1)
    >>> held_structure(lin) is lin
    True
    """
    return _Structure(model) if any(c.__name__ == "FSDPModule" for c in type(model).__mro__) else model


class _Structure:
    """What a checkpoint reads of a ``fully_shard`` module (its names, its config), taken on the caller's thread.

    FSDP2's ``state_dict`` pre-hook reshards the module: called from an async save's writer thread, it
    would reshard the module under the next step's forward.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._state = model.state_dict(keep_vars=True)  # first: its pre-hook puts a gathered root back on shards
        self._params, self._buffers = list(model.named_parameters()), list(model.named_buffers())

    def named_parameters(self) -> Any:
        return iter(self._params)

    def named_buffers(self) -> Any:
        return iter(self._buffers)

    def state_dict(self, keep_vars: bool = False) -> dict[str, Any]:
        return dict(self._state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
