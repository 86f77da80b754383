"""DCP storage for sharded checkpoints: one safetensors file per rank and a JSON index, never a pickle.

``ShardWriter`` is a ``torch.distributed.checkpoint`` ``StorageWriter``: DCP's planner decides which
rank writes which slab (a replicated tensor once), each rank writes its slabs into
``state-{rank}-of-{world}.safetensors`` (fsynced; the slab offsets also in DCP's
``DCP_SHARDING_INFO`` header field) and the coordinator writes ``state.index.json``: per tensor its
dtype, global shape and chunks (file, offsets, sizes). ``ShardReader`` reads that index back into
DCP's ``Metadata``, so DCP's load planner reshards onto any mesh, or onto plain tensors in one
process. ``trainfold.ckpt.sharded`` builds checkpoints on them; this module is imported
only when one is written or read (DCP costs seconds to import).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from trainfold.ckpt.faults import point
from trainfold.ckpt.sidecar import INDEX_FILE, CheckpointError
from trainfold.core.tree import Tree

__all__ = [
    "INDEX_FORMAT",
    "ShardWriter",
    "ShardReader",
    "shard_file",
    "crc32_of",
    "write_shards",
    "read_shards",
]

INDEX_FORMAT = "trainfold-sharded-state"


def shard_file(rank: int, world: int) -> str:
    """Return the name of rank ``rank``'s shard file in a checkpoint of ``world`` ranks.

    >>> shard_file(1, 4)
    'state-00001-of-00004.safetensors'
    """
    return f"state-{rank:05d}-of-{world:05d}.safetensors"


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_json(path: Path, value: Any) -> dict[str, int]:
    data = (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


# -- DCP storage: safetensors per rank, a JSON index ------------------------------------------------


class ShardWriter(StorageWriter):
    """Write each rank's planned items into one safetensors file; the coordinator writes the JSON index."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory, self.rank = directory, 0
        self.files: dict[str, dict[str, int]] = {}  # the coordinator's, after finish: every file of the checkpoint
        self.index: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank", 0)

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [dataclasses.replace(p, storage_data=shard_file(r, len(plans))) for r, p in enumerate(plans)]

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        name, tensors, offsets, seen = plan.storage_data, {}, {}, set()
        for item in plan.items:
            key = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                raise TypeError(f"the state's {key!r} is not a tensor; a sharded checkpoint holds tensors only")
            if key in tensors:
                raise ValueError(
                    f"rank {self.rank} holds two shards of {key!r}; sharded checkpoints take one shard "
                    "per rank (Shard(0) over a 1-D DeviceMesh)"
                )
            t = planner.resolve_data(item).detach().cpu().contiguous()
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()  # safetensors refuses two names on one storage
            seen.add(t.untyped_storage().data_ptr())
            tensors[key] = t
            offsets[key] = list(item.index.offset or [0] * t.dim())
        entry: dict[str, Any] = {}
        if tensors:
            path = self.directory / name
            meta = {
                "format": "pt",
                "DCP_VERSION": "1.0",
                "DCP_SHARDING_INFO": json.dumps({k: {"saved_offsets": v} for k, v in offsets.items()}),
            }
            safetensors.torch.save_file(tensors, path, metadata=meta)
            point(f"sharded:wrote:{name}")
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            entry = {"file": name, "bytes": path.stat().st_size, "crc32": crc32_of(path)}
        results = [
            WriteResult(
                index=item.index,
                size_in_bytes=tensors[item.index.fqn].nbytes,
                storage_data={**entry, "sizes": list(tensors[item.index.fqn].shape)},
            )
            for item in plan.items
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tensors: dict[str, Any] = {}
        for fqn, md in sorted(metadata.state_dict_metadata.items()):
            if not isinstance(md, TensorStorageMetadata):
                raise TypeError(f"the state's {fqn!r} is not a tensor; a sharded checkpoint holds tensors only")
            tensors[fqn] = {
                "dtype": str(md.properties.dtype).removeprefix("torch."),
                "shape": list(md.size),
                "chunks": [],
            }
        for per_rank in results:
            for wr in per_rank:
                data = wr.storage_data
                self.files[data["file"]] = {"bytes": data["bytes"], "crc32": data["crc32"]}
                tensors[wr.index.fqn]["chunks"].append(
                    {"file": data["file"], "offsets": list(wr.index.offset or []), "sizes": data["sizes"]}
                )
        for entry in tensors.values():
            entry["chunks"].sort(key=lambda c: c["offsets"])
        self.index = {"format": INDEX_FORMAT, "version": 1, "world_size": len(results), "tensors": tensors}
        self.files[INDEX_FILE] = _write_json(self.directory / INDEX_FILE, self.index)
        point("sharded:wrote:index")


class ShardReader(StorageReader):
    """Read chunks named by the JSON index from the shard files (DCP's planner decides which slices)."""

    def __init__(self, directory: Path, index: Mapping[str, Any], keys: Any = None) -> None:
        super().__init__()
        self.directory, self.index, self.keys = directory, index, keys

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, str] = {}
        for fqn, entry in self.index["tensors"].items():
            chunks = [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in entry["chunks"]]
            state[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, entry["dtype"])), torch.Size(entry["shape"]), chunks
            )
            storage.update({MetadataIndex(fqn, c["offsets"]): c["file"] for c in entry["chunks"]})
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage[item.storage_index], []).append(item)
        for name, items in sorted(per_file.items()):
            with safetensors.safe_open(str(self.directory / name), framework="pt") as f:
                for item in items:
                    key = item.storage_index.fqn
                    if item.lengths:
                        part = f.get_slice(key)[
                            tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                        ]
                    else:
                        part = f.get_tensor(key)
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(part)
                    planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future


# -- saving ----------------------------------------------------------------------------------------


def _failed(e: CheckpointException, what: str) -> BaseException:
    """Return the error to raise for DCP's ``CheckpointException`` (a ``BaseException``): per rank, by name."""
    failures = sorted(e.failures.items())
    text = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in failures)
    first = failures[0][1][0] if failures else None
    if isinstance(first, OSError):  # a full disk stays an OSError (preempt names the bytes it needs)
        return OSError(first.errno, f"{what} failed on {text}")
    return CheckpointError(f"{what} failed on {text}; the checkpoint was not written (the previous one is intact)")


def write_shards(tmp: Path, flat: Tree, group: Any) -> ShardWriter:
    """Write ``flat`` (dotted keys -> tensors, DTensors) into ``tmp`` from every rank of ``group``; return the writer.

    A failure on any rank raises on every rank, naming the rank (DCP's ``CheckpointException``
    is a ``BaseException``: it becomes an ``OSError`` or a ``CheckpointError``).
    """
    writer = ShardWriter(tmp)
    try:
        dcp.save(dict(flat), storage_writer=writer, process_group=group, no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise _failed(e, f"writing the shards of {tmp}") from None
    return writer


def read_shards(targets: Tree, directory: Path, index: Mapping[str, Any]) -> None:
    """Read ``targets`` in place from the shard files; no collectives (``no_dist``), whatever the world."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(targets, storage_reader=ShardReader(directory, index), no_dist=True)
