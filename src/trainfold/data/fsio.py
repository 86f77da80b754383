"""Where a streaming source's shards live: local paths, or any URL ``fsspec`` opens (``memory://``, ``s3://``...).

A local path (or a ``file://`` URL) is read with the standard library and memory-mapped where the
format allows; another URL goes through ``fsspec`` (an optional dependency, refused by name when
absent). Every function takes the path as :func:`~trainfold.data.files` recorded it.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> open(f"{d}/a.parquet", "wb").write(b"12345")
5
>>> size(f"file://{d}/a.parquet"), size(f"{d}/missing.parquet"), local(f"file://{d}/a.parquet") == f"{d}/a.parquet"
(5, -1, True)
"""

from __future__ import annotations

import glob as stdlib_glob
import os
from typing import IO, Any

__all__ = ["glob", "is_url", "local", "open_binary", "size"]


def is_url(path: str) -> bool:
    """Return whether ``path`` names a file through ``fsspec`` (a URL other than ``file://``)."""
    return "://" in path and not path.startswith("file://")


def local(path: str) -> str:
    """``path`` without a ``file://`` prefix."""
    return path[len("file://") :] if path.startswith("file://") else path


def _fs(path: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"reading {path!r} needs fsspec (pip install fsspec, and the package of its protocol); "
            "or copy the shards to a local folder"
        ) from None
    fs, inner = fsspec.core.url_to_fs(path)
    return fs, inner


def _url(fs: Any, inner: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return fs.unstrip_protocol(inner) if hasattr(fs, "unstrip_protocol") else f"{protocol}://{inner}"


def glob(pattern: str) -> list[str]:
    """The files a glob pattern matches, sorted (URLs keep their protocol)."""
    if not is_url(pattern):
        return sorted(stdlib_glob.glob(local(pattern)))
    fs, inner = _fs(pattern)
    return sorted(_url(fs, p) for p in fs.glob(inner) if fs.isfile(p))


def size(path: str) -> int:
    """The file's size in bytes; -1 when it does not exist (or is not a file)."""
    if not is_url(path):
        p = local(path)
        return os.path.getsize(p) if os.path.isfile(p) else -1
    fs, inner = _fs(path)
    return int(fs.size(inner)) if fs.isfile(inner) else -1


def open_binary(path: str) -> IO[bytes]:
    """Open the file for reading bytes (seekable)."""
    if not is_url(path):
        return open(local(path), "rb")
    fs, inner = _fs(path)
    return fs.open(inner, "rb")
