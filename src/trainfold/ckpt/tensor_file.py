"""Safetensors files written and read in one pass each, with the file's CRC-32 computed on the way.

A safetensors file is an 8-byte little-endian header length, a JSON header (``{name: {"dtype",
"shape", "data_offsets"}}``, optional ``"__metadata__"``; padded with spaces to 8 bytes) and the
tensors' bytes back to back. ``write`` streams each tensor's bytes to the file and into the CRC;
``read`` reads each tensor straight into its own tensor (no copy, no memory map) in 4 MB pieces,
read and CRC'd by threads on every core, the pieces' CRCs combined into the file's (``crc``), so a
checkpoint's integrity check costs no second pass over the file and no serial one. Files
are the format ``safetensors`` and ``transformers`` read; ``read`` takes any valid one.

>>> import tempfile, torch
>>> path = tempfile.mkdtemp() + "/t.safetensors"
>>> size, crc = write(path, {"w": torch.arange(3.0), "n": torch.tensor(7)})
>>> import zlib; crc == zlib.crc32(open(path, "rb").read())
True
>>> out = read(path, crc32=crc)
>>> out["w"].tolist(), out["n"].item()
([0.0, 1.0, 2.0], 7)
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from trainfold.ckpt.crc import combine_all
from trainfold.ckpt.crc import crc32 as checksum

__all__ = ["write", "read", "crc32_of", "TensorFileError", "DTYPES"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    **{
        name: getattr(torch, attr)
        for name, attr in [
            ("U64", "uint64"),
            ("U32", "uint32"),
            ("U16", "uint16"),
            ("F8_E4M3", "float8_e4m3fn"),
            ("F8_E5M2", "float8_e5m2"),
            ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
            ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ]
        if hasattr(torch, attr)
    },
}
_NAMES = {v: k for k, v in DTYPES.items()}
_CHUNK = 1 << 22  # bytes written (read) and CRC'd together, so the CRC reads them from the cache
_WORKERS = min(8, os.cpu_count() or 1)  # threads reading a file's pieces and CRC'ing them
_MAX_HEADER = 100_000_000  # safetensors' own limit


class TensorFileError(ValueError):
    """A file that is not a readable safetensors file, or whose CRC-32 is not the expected one."""


def _bytes_of(t: Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _write_all(fd: int, data: memoryview, crc: int) -> int:
    for start in range(0, len(data), _CHUNK):
        chunk = data[start : start + _CHUNK]
        done = 0
        while done < len(chunk):
            done += os.write(fd, chunk[done:])
        crc = checksum(chunk, crc)
    return crc


def write(
    path: str | os.PathLike,
    tensors: Mapping[str, Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    fsync: bool = True,
) -> tuple[int, int]:
    """Write ``tensors`` as a safetensors file at ``path``; return ``(bytes, crc32)`` of the file.

    Tensors are moved to the CPU and made contiguous one at a time; two names may share storage
    (each is written in full). ``fsync`` syncs the file before returning. Larger elements come
    first (as ``safetensors`` orders them), so every tensor stays aligned in the file.

    >>> import tempfile, torch
    >>> write(tempfile.mkdtemp() + "/t.safetensors", {"x": torch.zeros(2, dtype=torch.bfloat16)})[0]
    68
    """
    bad = sorted(k for k, v in tensors.items() if v.dtype not in _NAMES)
    if bad:
        raise TypeError(
            f"tensors {bad} have dtypes safetensors cannot store "
            f"({sorted({str(tensors[k].dtype) for k in bad})}); convert them to one of "
            f"{sorted(str(d) for d in _NAMES)}"
        )
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        crc = _write_all(fd, memoryview(head), 0)
        for key in order:
            crc = _write_all(fd, _bytes_of(tensors[key].detach().cpu().contiguous()), crc)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(head) + offset, crc


def _read_piece(path: str | os.PathLike, fd: int, offset: int, dest: memoryview, crc: bool = True) -> tuple[int, int]:
    """Fill ``dest`` from ``fd`` at ``offset``; return its ``(crc32, length)`` (the CRC 0 without ``crc``)."""
    got = 0
    while got < len(dest):
        k = os.preadv(fd, [dest[got:]], offset + got)
        if not k:
            raise TensorFileError(f"{path} is not a readable safetensors file (it ended early)")
        got += k
    return (checksum(dest) if crc else 0), len(dest)


def _read_pieces(path: str | os.PathLike, fd: int, pieces: list[tuple[int, memoryview]], crc: int | None) -> int | None:
    """Read every ``(offset, dest)`` piece, in threads when there are several; return ``crc`` extended by them.

    ``crc=None``: the pieces are only read (no CRC computed; ``None`` returned).

    ``os.preadv`` and ``crc.crc32`` (zlib's or ISA-L's) release the GIL, so the pieces are read and
    CRC'd on every core at once; their CRCs are combined in file order (``crc.combine_all``).
    """
    workers = min(len(pieces), _WORKERS)
    check = crc is not None
    if workers < 2 or sum(len(dest) for _, dest in pieces) < 2 * _CHUNK:  # threads cost more than they save
        done = [_read_piece(path, fd, at, dest, check) for at, dest in pieces]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="trainfold-read") as pool:  # per call: fork-safe
            done = list(pool.map(lambda piece: _read_piece(path, fd, *piece, check), pieces))
    return combine_all(done, crc) if check else None


def _crc_of(path: str | os.PathLike) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = checksum(chunk, crc)
    return crc


def crc32_of(path: str | os.PathLike) -> int:
    """Return the CRC-32 of the file ``path`` (any file), its pieces read and CRC'd in threads.

    >>> import tempfile, zlib
    >>> path = tempfile.mkdtemp() + "/f"
    >>> _ = open(path, "wb").write(b"x" * 10_000_000)
    >>> crc32_of(path) == zlib.crc32(b"x" * 10_000_000)
    True
    """
    size = os.path.getsize(path)
    scratch = [memoryview(bytearray(min(size, _CHUNK))) for _ in range(min(_WORKERS, -(-size // _CHUNK)))]
    free = list(scratch)
    lock = threading.Lock()

    def piece(fd: int, at: int) -> tuple[int, int]:
        with lock:
            buf = free.pop()
        try:
            return _read_piece(path, fd, at, buf[: min(_CHUNK, size - at)])
        finally:
            with lock:
                free.append(buf)

    with open(path, "rb", buffering=0) as f:
        if len(scratch) < 2:
            return _crc_of(path)
        with ThreadPoolExecutor(len(scratch), thread_name_prefix="trainfold-crc") as pool:
            done = list(pool.map(lambda at: piece(f.fileno(), at), range(0, size, _CHUNK)))
    return combine_all(done)


def _entries(path: str | os.PathLike, header: bytes, data_size: int) -> list[tuple[str, torch.dtype, list[int], int]]:
    """Return ``(name, dtype, shape, start)`` of each tensor in file order, the header checked against the data."""
    try:
        parsed = json.loads(header)
    except (ValueError, UnicodeDecodeError) as e:
        raise TensorFileError(f"{path} is not a readable safetensors file (its header is not JSON: {e})") from None
    if not isinstance(parsed, dict):
        raise TensorFileError(f"{path} is not a readable safetensors file (its header is not a JSON object)")
    out = []
    for name, entry in parsed.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        shape, span = (entry.get("shape"), entry.get("data_offsets")) if isinstance(entry, dict) else (None, None)
        ok = (
            dtype is not None
            and isinstance(shape, list)
            and all(type(n) is int and n >= 0 for n in shape)
            and isinstance(span, list)
            and len(span) == 2
            and all(type(n) is int for n in span)
        )
        if not ok:
            raise TensorFileError(f"{path} is not a readable safetensors file (its entry {name!r} is {entry!r:.80})")
        numel = 1
        for n in shape:
            numel *= n
        if span[1] - span[0] != numel * torch.empty((), dtype=dtype).element_size():
            raise TensorFileError(
                f"{path} is not a readable safetensors file ({name!r}: offsets {span} do not "
                f"hold a {shape} {dtype} tensor)"
            )
        out.append((name, dtype, shape, span[0]))
    out.sort(key=lambda e: e[3])
    end = 0
    for name, _dtype, _shape, start in out:
        if start != end:
            raise TensorFileError(f"{path} is not a readable safetensors file ({name!r} starts at {start}, not {end})")
        end = start + parsed[name]["data_offsets"][1] - parsed[name]["data_offsets"][0]
    if end != data_size:
        raise TensorFileError(
            f"{path} is not a readable safetensors file (the tensors hold {end} bytes, "
            f"the file {data_size} after its header)"
        )
    return out


def _fits(t: Tensor | None, shape: list[int], dtype: torch.dtype, taken: set[int]) -> bool:
    """Say whether ``t`` can take a tensor's bytes in place: a contiguous CPU tensor alone in its storage."""
    if t is None or t.device.type != "cpu" or t.dtype != dtype or list(t.shape) != shape or not t.numel():
        return False
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return whole and t.data_ptr() not in taken


def read(
    path: str | os.PathLike, *, crc32: int | None = None, into: Mapping[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """Return the tensors of the safetensors file ``path`` (CPU, each its own storage).

    With ``crc32``, the file's CRC-32 (computed from the bytes as they are read) must equal it;
    without, no CRC is computed (the bytes are only read).
    ``into`` maps names to tensors to read straight into (one pass, no fresh memory), where each is a
    contiguous CPU tensor of the entry's dtype and shape alone in its storage (others get fresh
    memory); those are overwritten even when the CRC then differs.
    Raises ``TensorFileError`` naming the path: "is corrupted" when the CRC differs, "is not a
    readable safetensors file" when the bytes are not one (and the CRC, if given, matches).

    >>> import tempfile, torch
    >>> path = tempfile.mkdtemp() + "/t.safetensors"
    >>> _ = write(path, {"x": torch.ones(2)})
    >>> read(path, crc32=1)
    Traceback (most recent call last):
    ...
    trainfold.ckpt.tensor_file.TensorFileError: ... is corrupted: its CRC-32 is ..., not 00000001
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        try:
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                raise TensorFileError(
                    f"{path} is not a readable safetensors file (header length {n}, file size {size})"
                )
            header = f.read(n)
            entries = _entries(path, header, size - 8 - n)
        except TensorFileError:
            crc = _crc_of(path)
            if crc32 is not None and crc != crc32:
                raise TensorFileError(f"{path} is corrupted: its CRC-32 is {crc:08x}, not {crc32:08x}") from None
            raise
        crc = checksum(header, checksum(head)) if crc32 is not None else None
        out: dict[str, Tensor] = {}
        pieces: list[tuple[int, memoryview]] = []  # (file offset, the bytes of a tensor it fills)
        at = 8 + n
        taken: set[int] = set()
        for name, dtype, shape, _ in entries:
            dest = into.get(name) if into is not None else None
            t = (
                dest.detach()
                if dest is not None and _fits(dest, shape, dtype, taken)
                else torch.empty(shape, dtype=dtype)
            )
            taken.add(t.data_ptr())
            data = _bytes_of(t)
            pieces += [(at + start, data[start : start + _CHUNK]) for start in range(0, len(data), _CHUNK)]
            at += len(data)
            out[name] = t
        crc = _read_pieces(path, f.fileno(), pieces, crc)
    if crc32 is not None and crc != crc32:
        raise TensorFileError(f"{path} is corrupted: its CRC-32 is {crc:08x}, not {crc32:08x}")
    return out
