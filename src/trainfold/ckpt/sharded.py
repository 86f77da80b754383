"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP): every rank writes its DTensor shards as safetensors.

A state of ``DTensor`` shards (``fsdp="full_shard"``) is saved by all ranks at once with ``dcp.save``
and DCP's ``HuggingFaceStorageWriter`` into ``sharded/`` (one safetensors file per rank, the slab
offsets in its header), with ``model.safetensors`` on request (``consolidate``); rank 0's ``writer.save``
puts the directory into place once every rank's file and hash are in. ``load`` checks every hash, then
DCP's reader and load planner reshard onto the template's mesh (2 ranks -> 1, 3, 4).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from trainfold.ckpt import tensor_file, writer
from trainfold.ckpt.faults import point
from trainfold.ckpt.layout import is_peft_model, model_weights
from trainfold.ckpt.sidecar import MODEL_FILE, SHARD_DIR, CheckpointError, read_metadata
from trainfold.core.state import TrainState
from trainfold.core.tree import flatten, map_tensors, unflatten
from trainfold.step.fsdp import held_structure

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["Saver", "is_sharded", "save_sharded", "load_sharded"]


def _dtensor_type() -> type[DTensor] | None:
    """Return ``DTensor`` if its module is loaded (else no tensor can be one, and DCP need not load)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(state: Any) -> bool:
    """Say whether any tensor of ``state`` is a ``DTensor`` (then every rank takes part in its checkpoint)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in flatten(state).values())


@functools.cache
def _writer_type() -> type:
    """DCP's safetensors writer, each shard file hashed by the rank that wrote it (imported late: DCP loads slowly)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.futures import Future

    class Writer(HuggingFaceStorageWriter):
        files: dict[str, dict[str, int]]

        def write_data(self, plan: Any, planner: Any) -> Any:
            results = super().write_data(plan, planner).wait()
            entries = {}
            for name in sorted({r.storage_data.relative_path for r in results}):
                entries[name] = tensor_file.digest_of(Path(self.path) / name)
                point(f"sharded:wrote:{name}")
            out: Future[list[Any]] = Future()  # the entry travels to the coordinator with DCP's results
            named = [(r, r.storage_data.relative_path) for r in results]
            out.set_result([dataclasses.replace(r, storage_data=(n, entries[n])) for r, n in named])
            return out

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            self.files = {f"{SHARD_DIR}/{r.storage_data[0]}": r.storage_data[1] for rs in results for r in rs}

    return Writer


def _failed(e: BaseException, what: str) -> BaseException:
    """Return the error to raise for DCP's ``CheckpointException`` (a ``BaseException``): per rank, by name."""
    failures = sorted(e.failures.items())  # type: ignore[attr-defined]
    text = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in failures)
    first = failures[0][1][0] if failures else None
    if isinstance(first, OSError):  # a full disk stays an OSError (the run names the bytes it needs)
        return OSError(first.errno, f"{what} failed on {text}")
    return CheckpointError(f"{what} failed on {text}; the checkpoint was not written (the previous one is intact)")


def _write_shards(tmp: Path, flat: dict[str, Tensor], group: Any) -> dict[str, dict[str, int]]:
    """Write ``flat`` into ``tmp/sharded`` from every rank of ``group`` (``dcp.save``); return the files' entries."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    storage = _writer_type()(str(tmp / SHARD_DIR), save_distributed=True)
    try:
        dcp.save(dict(flat), storage_writer=storage, process_group=group, no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise _failed(e, f"writing the shards of {tmp}") from None
    return getattr(storage, "files", {})


def _read_shards(targets: dict[str, Tensor], directory: Path) -> None:
    """Fill ``targets`` in place from the shard files (``dcp.load``, no collectives: each rank reads its part)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(targets, storage_reader=dcp.HuggingFaceStorageReader(str(directory / SHARD_DIR)), no_dist=True)


def _consolidate(tmp: Path, model: Any) -> dict[str, dict[str, int]]:
    """Write ``model.safetensors`` from the shard files just written (rank 0, one process); return its entry."""
    full = _empty(_metadata(tmp), ("params.", "buffers."))
    _read_shards(full, tmp)
    split = TrainState(
        params={k.removeprefix("params."): v for k, v in full.items() if k.startswith("params.")},
        buffers={k.removeprefix("buffers."): v for k, v in full.items() if k.startswith("buffers.")},
        opt_state=None,
    )
    entry = tensor_file.write(tmp / MODEL_FILE, model_weights(split, model), metadata={"format": "pt"})
    point("sharded:wrote:model")
    return {MODEL_FILE: entry}


def _announce(name: str, group: Any) -> str:
    """Send rank 0's ``name`` (the temporary directory; empty: it failed) to every rank; return it."""
    box = [name]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return str(box[0])


def save_sharded(
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
        _write_shards(directory.parent / name, flat, group)
        if _announce("", group) != "done":  # rank 0 renames it into place: returning means it is there
            raise CheckpointError(f"rank 0 could not complete the checkpoint {directory}; its error says why")
        return directory
    phase = "starting"  # then "writing" (DCP raises on every rank), then "written" (rank 0 alone may fail)

    def tensors(tmp: Path) -> dict[str, dict[str, int]]:
        nonlocal phase
        if many:
            _announce(tmp.name, group)
        phase = "writing"
        files = _write_shards(tmp, flat, group)
        phase = "written"
        if consolidate or only_model:
            files.update(_consolidate(tmp, model))
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


@attrs.define(eq=False)
class Saver:
    """Write a run's checkpoints: sharded ones from every rank, replicated ones from the caller; sync or async.

    With ``async_save`` the state is copied to the CPU (the step stalls for that copy only) and a
    worker thread writes it; the directory appears, complete and fsynced, when every rank has
    finished (the rename is the last act). One save runs at a time: the next ``save`` and ``wait``
    wait for it and raise its error. ``on_commit(path)`` runs on the rank that renamed it, once it
    is in place (rotation, best bookkeeping). Sharded saves get a gloo process group of their own
    (made on the first, by every rank), so the writer thread's collectives never meet the step's.

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

        ``wait=True`` returns when it is complete, also with ``async_save`` (a JIT save at preemption).
        """
        self.wait()
        directory, later = Path(directory), self.async_save and not wait
        if later and not is_peft_model(options.get("model")):  # a peft one: its own layout
            options["model"] = held_structure(options.get("model"))  # read here, not in the writer thread
        write: Callable[..., Path] = functools.partial(writer.save, **options)
        commits = True
        if is_sharded(state):
            if dist.is_initialized() and self._group is None:
                self._group = dist.new_group(backend="gloo")
            write = functools.partial(save_sharded, group=self._group, consolidate=self.consolidate, **options)
            commits = not dist.is_initialized() or dist.get_rank() == 0

        def job(staged: TrainState) -> Path:
            path = write(staged, directory)
            if on_commit is not None and commits:
                on_commit(path)
            return path

        if not later:
            return job(state)
        staged, self._job = map_tensors(_cpu_copy, state), Future()

        def run(future: Future[Path]) -> None:
            try:
                future.set_result(job(staged))
            except BaseException as e:  # raised by wait, in the caller's thread
                future.set_exception(e)

        # a daemon, not an executor's worker: a process whose peers died exits without waiting for its collectives
        threading.Thread(target=run, args=(self._job,), name=f"trainfold-save-{directory.name}", daemon=True).start()
        return directory

    def pending(self) -> bool:
        """Say whether a save is still being written."""
        return self._job is not None and not self._job.done()

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any); return its path, or raise its error."""
        job, self._job = self._job, None
        return None if job is None else job.result()


def _metadata(directory: Path) -> Any:
    """DCP's metadata of the shard files in ``directory``, from their headers: per key its size and dtype, chunks."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(directory / SHARD_DIR)).read_metadata()


def _checked(directory: Path) -> Any:
    """Return DCP's metadata of the shards (read from their headers), every shard file checked first.

    Each shard file's size and hash must be those the sidecar records, and ``sharded/`` must hold no
    other file (DCP's reader reads every safetensors file there).
    """
    meta = read_metadata(directory)
    listed = sorted(n for n in meta["files"] if n.startswith(f"{SHARD_DIR}/"))
    present = sorted(f"{SHARD_DIR}/{p.name}" for p in (directory / SHARD_DIR).glob("*")) if listed else []
    if present != listed:
        raise CheckpointError(
            f"{directory / SHARD_DIR} holds {present}, but {directory / 'trainfold.json'} lists {listed}: the "
            "checkpoint was altered; resume from an earlier checkpoint"
        )
    for name in listed:
        try:
            tensor_file.check(directory / name, meta["files"][name])
        except tensor_file.TensorFileError as e:
            raise CheckpointError(f"{e} (as trainfold.json records); resume from an earlier checkpoint") from None
    try:
        return _metadata(directory)
    except Exception as e:  # a header that hashes right but is not safetensors: written so, never loadable
        raise CheckpointError(f"{directory / SHARD_DIR} holds unreadable shards ({e}); resume from another") from None


def _empty(md: Any, prefixes: tuple[str, ...]) -> dict[str, Tensor]:
    """Return an empty tensor of each saved key under ``prefixes`` (DCP's metadata ``md``), to read it into."""
    items = md.state_dict_metadata.items()
    return {k: torch.empty(list(m.size), dtype=m.properties.dtype) for k, m in items if k.startswith(prefixes)}


def load_sharded(directory: str | os.PathLike, like: TrainState, *, weights_only: bool = False) -> TrainState:
    """Return the sharded checkpoint in ``directory`` laid out like ``like``, on any number of ranks.

    ``like``'s DTensors get this rank's slab of each tensor (resharded by DCP's planner to the
    mesh ``like`` is on); its plain tensors get the whole tensor, so one process loads a
    checkpoint of many ranks. No collectives: each rank reads what it needs. ``weights_only``
    loads params and buffers only (``reader.load_weights``). ``metrics`` load as saved.
    """
    directory = Path(directory)
    md, where, step = _checked(directory), directory / SHARD_DIR, read_metadata(directory)["step"]
    saved = {k: (list(m.size), str(m.properties.dtype)[6:]) for k, m in md.state_dict_metadata.items()}
    base = attrs.evolve(like, metrics={})
    wanted = {k: v for k, v in flatten(base).items() if not weights_only or k.startswith(("params.", "buffers."))}
    missing = sorted(k for k in wanted if k not in saved and not (weights_only and k.startswith("buffers.")))
    unexpected = [] if weights_only else sorted(k for k in saved if k not in wanted and not k.startswith("metrics."))
    if missing or unexpected:
        raise KeyError(
            f"{where} does not fit the template state; was it saved from a different "
            f"model or optimizer? missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    bad = [
        f"{k}: saved {saved[k][0]} {saved[k][1]}, expected {list(v.shape)} {str(v.dtype)[6:]}"
        for k, v in wanted.items()
        if saved.get(k, (list(v.shape), str(v.dtype)[6:])) != (list(v.shape), str(v.dtype)[6:])
    ]
    if bad:
        raise ValueError(f"{where} does not fit the template state (a different model size?): " + "; ".join(bad[:8]))
    targets = {k: torch.empty_like(v) for k, v in wanted.items() if k in saved}
    targets |= {} if weights_only else _empty(md, ("metrics.",))
    _read_shards(targets, directory)
    if weights_only:
        buffers = {k: targets.get(f"buffers.{k}", v) for k, v in like.buffers.items()}
        return attrs.evolve(like, params={k: targets[f"params.{k}"] for k in like.params}, buffers=buffers)
    metrics = {k.removeprefix("metrics."): v for k, v in targets.items() if k.startswith("metrics.")}
    state = unflatten({k: v for k, v in targets.items() if not k.startswith("metrics.")}, like=base)
    if int(state.step) != step:
        raise CheckpointError(
            f"{directory / 'trainfold.json'}: field 'step' is {step} but the "
            f"shards hold {int(state.step)}; resume from another checkpoint"
        )
    return attrs.evolve(state, metrics=metrics)
