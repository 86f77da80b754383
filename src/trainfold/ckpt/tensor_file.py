"""Safetensors files through ``safetensors``, each hashed (XXH3-64) as written and checked before use.

``write``: ``save_file``; ``read``: ``safe_open`` maps the file. Both hash it alike: over the bytes ``safe_open``
returns, its header then each tensor in file order (safetensors lays them end to end). So a write proves the
file readable while its pages are in the page cache, and the copy after a read (``lend``, ``load_state_dict``)
finds them mapped; no tensor is returned before size and hash match. A file's hash (format 5) is the XXH3-64
of its 16 MiB chunks' XXH3-64s, hashed in threads (xxhash releases the GIL); a file of one chunk, as every
file of format 4, hashes as itself. (XXH3-64: ~14 GB/s on one core here.)

>>> import tempfile, torch
>>> path = tempfile.mkdtemp() + "/t.safetensors"
>>> entry = write(path, {"w": torch.arange(3.0), "n": torch.tensor(7)})
>>> sorted(entry), entry == digest_of(path)
(['bytes', 'xxh3_64'], True)
>>> read(path, entry)["w"].tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import safetensors
import safetensors.torch
import torch
import xxhash
from torch import Tensor

from trainfold.ckpt.sidecar import CHUNK, CheckpointError

__all__ = ["write", "read", "check", "digest_of", "entry_of", "TensorFileError"]


class TensorFileError(CheckpointError):
    """A file that is not a readable safetensors file, or whose size or hash is not the recorded one."""


_FIX = "resume from an earlier checkpoint"


def write(
    path: str | os.PathLike,
    tensors: Mapping[str, Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Write ``tensors`` (on the CPU, contiguous, each name its own storage) to ``path``; return its entry.

    The file is not fsynced: the checkpoint writer fsyncs every file of a checkpoint in one pass.
    """
    seen: set[int | None] = set()
    plain = {}
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        plain[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    try:
        safetensors.torch.save_file(plain, path, metadata=dict(metadata) if metadata else None)
    except (ValueError, RuntimeError, safetensors.SafetensorError) as e:
        if failed := re.search(r"(?:os error|code:) (\d+)", str(e)):  # an I/O error (a full disk, ...) stays one
            raise OSError(int(failed.group(1)), f"{path}: {e}", str(path)) from e
        raise TypeError(f"{path}: safetensors cannot store these tensors: {e}") from None
    return digest_of(path)


def digest_of(path: str | os.PathLike, chunk: int | None = CHUNK) -> dict[str, int]:
    """Return the entry ``{"bytes", "xxh3_64"}`` of the safetensors file ``path``, hashed as ``read`` checks it."""
    return {"bytes": os.path.getsize(path), "xxh3_64": _mapped(path, chunk)[1]}


def entry_of(data: bytes) -> dict[str, int]:
    """Return the entry of a file holding ``data`` (a ``config.json``), hashed as the module says."""
    return {"bytes": len(data), "xxh3_64": _hash([memoryview(data)], CHUNK)}


def _mapped(path: str | os.PathLike, chunk: int | None) -> tuple[dict[str, Tensor], int]:
    """Return the tensors of the safetensors file ``path`` as ``safe_open`` maps them, and the hash of the file taken
    over them: its header, then each tensor in file order (safetensors lays them end to end)."""
    with safetensors.safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.offset_keys()}
    data = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors.values()]
    with open(path, "rb") as f:
        header = f.read(os.fstat(f.fileno()).st_size - sum(len(d) for d in data))
    return tensors, _hash([memoryview(header), *data], chunk)


def _hash(pieces: list[memoryview], chunk: int | None) -> int:
    """Return the hash of the bytes of ``pieces`` laid end to end (``digest_of`` says which)."""
    starts = list(itertools.accumulate((len(p) for p in pieces), initial=0))
    size = starts.pop()
    span = size if chunk is None or size <= chunk else chunk

    def part(lo: int) -> int:  # the XXH3-64 of the bytes [lo, lo + span)
        h = xxhash.xxh3_64()
        for i in range(max(bisect.bisect_right(starts, lo) - 1, 0), len(pieces)):
            if starts[i] >= lo + span:
                break
            h.update(pieces[i][max(lo - starts[i], 0) : lo + span - starts[i]])
        return h.intdigest()

    if span == size:
        return part(0)
    with ThreadPoolExecutor(min(-(-size // span), os.cpu_count() or 1)) as pool:
        return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in pool.map(part, range(0, size, span))))


def read(path: str | os.PathLike, entry: Mapping[str, int], chunk: int | None = CHUNK) -> dict[str, Tensor]:
    """Return the tensors of the safetensors file ``path`` (CPU, mapped from it) once its size and hash are ``entry``'s;
    else raise ``TensorFileError`` naming it."""
    if (size := os.path.getsize(path)) != entry["bytes"]:
        raise TensorFileError(f"{path} is truncated or altered: it has {size} bytes, not {entry['bytes']}; {_FIX}")
    try:
        tensors, got = _mapped(path, chunk)
    except (safetensors.SafetensorError, ValueError) as e:
        raise TensorFileError(f"{path} is corrupted: safetensors cannot read it ({e}); {_FIX}") from None
    if got != entry["xxh3_64"]:
        raise TensorFileError(f"{path} is corrupted: its xxh3_64 is {got:016x}, not {entry['xxh3_64']:016x}; {_FIX}")
    return tensors


def check(path: str | os.PathLike, entry: Mapping[str, int], chunk: int | None = CHUNK) -> None:
    """Raise ``TensorFileError`` unless the file ``path`` has ``entry``'s size and hash: a safetensors file as ``read``
    hashes it (its tensors are dropped), any other (``config.json``) over its bytes as ``entry_of``.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = path.write_text('{"a": 1}')
    >>> entry = entry_of(b'{"a": 1}')
    >>> check(path, entry)
    >>> _ = path.write_text('{"a": 2}')
    >>> try:
    ...     check(path, entry)
    ... except TensorFileError as err:
    ...     print(str(err).split(": ")[0].endswith("config.json is corrupted"))
    True
    """
    if str(path).endswith(".safetensors"):
        read(path, entry, chunk)
        return
    if (size := os.path.getsize(path)) != entry["bytes"]:
        raise TensorFileError(f"{path} is truncated or altered: it has {size} bytes, not {entry['bytes']}; {_FIX}")
    with open(path, "rb") as f:
        got = _hash([memoryview(f.read())], chunk)
    if got != entry["xxh3_64"]:
        raise TensorFileError(f"{path} is corrupted: its xxh3_64 is {got:016x}, not {entry['xxh3_64']:016x}; {_FIX}")
