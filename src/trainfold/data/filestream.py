"""A streaming source over sharded Parquet, Arrow IPC and JSON Lines files, a pure function of its position.

``files(paths_or_glob, seed=0, shuffle_window=1024)`` reads each shard's metadata (a Parquet footer, an
Arrow file's batch table) and never the data up front. The row at absolute position ``p`` (epoch
``p // num_rows``, index ``i = p % num_rows``) is a pure function of ``(seed, epoch, i)``:

1. the epoch's order of shards is a seeded permutation, and within each shard the order of its blocks
   (Parquet row groups, Arrow record batches, JSON Lines cut at line ends every 4 MiB);
2. the rows of that block order are cut into windows of ``shuffle_window`` rows, and each window is
   permuted by its own seeded permutation.

So the shuffle's state is ``(seed, epoch, window)``, a few integers, not a buffer: a resume at position
``p`` reads only the blocks under ``p``'s window. ``.filter(fn)`` keeps the rows ``fn`` accepts (its
decisions depend only on the row, which depends only on the position, so a resume never loses or
repeats one) and ``.map(fn)`` transforms each row; the position stays the unfiltered one.

>>> import itertools, pyarrow as pa, pyarrow.parquet as pq, tempfile
>>> d = tempfile.mkdtemp()
>>> for k in range(2):
...     pq.write_table(pa.table({"id": list(range(10 * k, 10 * k + 10))}), f"{d}/part-{k}.parquet", row_group_size=4)
>>> src = files(f"{d}/*.parquet", seed=0, shuffle_window=8)
>>> src.num_rows, sorted(r["id"] for _, r in itertools.islice(src.rows(0), 20)) == list(range(20))
(20, True)
>>> rest = [r["id"] for _, r in itertools.islice(src.rows(13), 3)]
>>> rest == [r["id"] for _, r in itertools.islice(src.rows(0), 20)][13:16]  # seek: the same rows
True
>>> evens = src.filter(lambda r: r["id"] % 2 == 0).map(lambda r: r["id"])
>>> sorted(x for _, x in itertools.islice(evens.rows(0), 10))
[0, 2, 4, 6, 8, 10, 12, 14, 16, 18]
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import xxhash

import trainfold.data.fsio as fsio
from trainfold.core.rng import derive_seed
from trainfold.data.transforms import Filtered, Mapped

__all__ = ["FileSource", "Shard", "ShardChangedError", "Source", "files", "is_source"]

_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".jsonl": "jsonl"}
_FORMATS[".json"] = "jsonl"
_EDGE = 1 << 16  # bytes hashed at each end of a shard: a Parquet footer, an Arrow file's footer
_JSON_BLOCK_BYTES = 1 << 22  # a JSON Lines file is cut into blocks of about this size, at line ends


class ShardChangedError(RuntimeError):
    """A shard of a streaming source changed, vanished or appeared since it was opened or checkpointed."""


@runtime_checkable
class Source(Protocol):
    """What a streaming source gives: its rows from an absolute position, each with the position after it."""

    num_rows: int

    def rows(self, start: int) -> Iterator[tuple[int, Any]]: ...

    def fingerprint(self) -> int: ...

    def sample_id(self, position: int) -> int: ...


def is_source(obj: Any) -> bool:
    """Return whether ``obj`` is a streaming source (``files(...)``, a filtered or mapped one).

    >>> is_source([1, 2]), is_source(Mapped(None, str))
    (False, True)
    """
    return isinstance(obj, (FileSource, Filtered, Mapped))


# -- shards -----------------------------------------------------------------------------------------


@attrs.frozen
class Shard:
    """One file: its path and format, its size and digest (the fingerprint), its rows per block."""

    path: str
    format: str
    size: int
    digest: int
    blocks: tuple[int, ...]
    offsets: tuple[int, ...] = ()  # JSON Lines: each block's first byte, then the end
    schema: Any = None  # JSON Lines: the schema every block is parsed with (inferred from the whole file)


def _digest(path: str, size: int) -> int:
    """Hash the size and the first and last 64 KiB (a Parquet or Arrow footer holds every block's metadata)."""
    h = xxhash.xxh3_64()
    h.update(str(size).encode())
    with fsio.open_binary(path) as f:
        h.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(_EDGE, size - _EDGE))
            h.update(f.read(_EDGE))
    return h.intdigest() & ((1 << 63) - 1)


def _expand(paths_or_glob: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    patterns = [paths_or_glob] if isinstance(paths_or_glob, (str, os.PathLike)) else list(paths_or_glob)
    out: list[str] = []
    for pattern in [str(os.fspath(p)) for p in patterns]:
        if any(c in pattern for c in "*?["):
            found = fsio.glob(pattern)
            if not found:
                raise FileNotFoundError(f"no file matches {pattern!r}; check the path and the pattern")
            out.extend(found)
        elif fsio.size(pattern) < 0:
            raise FileNotFoundError(f"shard {pattern!r} does not exist (or is not a file); pass existing files")
        else:
            out.append(pattern)
    if not out:
        raise ValueError("files() needs at least one path or glob pattern")
    return out


def _format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FORMATS:
        raise ValueError(
            f"cannot stream {path!r}: its extension {ext!r} is not one of {sorted(_FORMATS)} "
            "(Parquet, Arrow IPC, JSON Lines); convert it or rename it"
        )
    return _FORMATS[ext]


def _open_shard(path: str) -> tuple[Shard, Any]:
    """Read a shard's metadata (not its rows, except for JSON Lines): its blocks and schema."""
    fmt = _format(path)
    size = fsio.size(path)
    digest = _digest(path, size)
    if fmt == "parquet":
        meta = _parquet_file(path).metadata
        blocks = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        schema = meta.schema.to_arrow_schema()
    elif fmt == "arrow":
        batches = _arrow_batches(path)
        blocks, schema = tuple(b.num_rows for b in batches), batches.schema
    else:
        table = _read_json(path)
        schema = table.schema
        blocks, offsets = _json_blocks(path)
        if sum(blocks) != table.num_rows:  # lines that are not one row each: one block
            blocks, offsets = (table.num_rows,), (0, size)
        return Shard(path, fmt, size, digest, blocks, offsets, schema), schema
    return Shard(path, fmt, size, digest, blocks), schema


def _json_blocks(path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Cut a JSON Lines file at line ends about every ``_JSON_BLOCK_BYTES``: rows per block, byte offsets."""
    blocks, offsets = [], [0]
    with fsio.open_binary(path) as f:
        while chunk := f.read(_JSON_BLOCK_BYTES):
            chunk += f.readline()  # on to the end of the line
            blocks.append(sum(1 for line in chunk.split(b"\n") if line.strip()))
            offsets.append(offsets[-1] + len(chunk))
    return tuple(blocks), tuple(offsets)


class _Batches(list):  # type: ignore[type-arg]
    schema: Any


def _arrow_batches(path: str) -> _Batches:
    """The record batches of an Arrow IPC file or stream, memory-mapped (zero copy)."""
    import pyarrow as pa

    def opened() -> Any:  # a local file memory-mapped (zero copy), another read whole
        if fsio.is_url(path):
            with fsio.open_binary(path) as f:
                return pa.BufferReader(f.read())
        return pa.memory_map(fsio.local(path))

    try:
        reader: Any = pa.ipc.open_file(opened())
        out = _Batches(reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_stream(opened())
        out = _Batches(reader)
    out.schema = reader.schema
    return out


def _parquet_file(path: str) -> Any:
    """A Parquet file opened by pyarrow: a local one by its path (native reads), another through fsspec."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(fsio.open_binary(path) if fsio.is_url(path) else fsio.local(path))


def _read_json(path: str) -> Any:
    import pyarrow.json as pj

    with fsio.open_binary(path) as f:
        return pj.read_json(f)


def _check_schemas(shards: list[Shard], schemas: list[Any]) -> Any:
    first = schemas[0]
    for shard, schema in zip(shards[1:], schemas[1:]):
        if not schema.equals(first, check_metadata=False):
            mine = {f.name: str(f.type) for f in first}
            theirs = {f.name: str(f.type) for f in schema}
            diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            shown = ", ".join(f"{k}: {mine.get(k, 'absent')} vs {theirs.get(k, 'absent')}" for k in diff)
            raise ValueError(
                f"shard {shard.path!r} has another schema than {shards[0].path!r} ({shown or 'field order'}); "
                "every shard of a source must have the same columns and types: rewrite the odd shard, or "
                "stream the two kinds as two sources and mix() them"
            )
    return first


# -- the source -------------------------------------------------------------------------------------


def files(
    paths_or_glob: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    seed: int = 0,
    shuffle_window: int = 1024,
    shuffle: bool = True,
    columns: Sequence[str] | None = None,
) -> FileSource:
    """Return a streaming source over the shards ``paths_or_glob`` names (sorted, each glob expanded).

    ``shuffle=False`` reads shards, blocks and rows in file order. ``columns`` selects columns.
    Shards must share one schema; each is fingerprinted (size and a hash of its ends) so a resume
    refuses shards that changed. See the module docstring for the order.
    """
    if not isinstance(shuffle_window, int) or shuffle_window < 1:
        raise ValueError(f"shuffle_window={shuffle_window!r} must be an int >= 1 (rows permuted together)")
    paths = _expand(paths_or_glob)
    opened = [_open_shard(p) for p in paths]
    shards = [s for s, _ in opened]
    schema = _check_schemas(shards, [sc for _, sc in opened])
    if columns is not None:
        missing = sorted(set(columns) - set(schema.names))
        if missing:
            raise ValueError(f"columns {missing} are not in the shards' schema {schema.names}")
    total = sum(sum(s.blocks) for s in shards)
    if total == 0:
        raise ValueError(f"the {len(shards)} shard(s) {paths[:3]}... hold no row; a stream needs at least one")
    return FileSource(tuple(shards), seed, shuffle_window, shuffle, None if columns is None else tuple(columns))


@attrs.frozen(eq=False)
class FileSource:
    """Rows of sharded files in a seeded order; build it with :func:`files`."""

    shards: tuple[Shard, ...]
    seed: int
    shuffle_window: int
    shuffle: bool
    columns: tuple[str, ...] | None
    _blocks: OrderedDict[Any, Any] = attrs.field(factory=OrderedDict, init=False, repr=False)
    _num_rows: int = attrs.field(init=False, repr=False)

    @_num_rows.default
    def _count_rows(self) -> int:
        return sum(sum(s.blocks) for s in self.shards)

    @property
    def num_rows(self) -> int:
        """Rows in one epoch (one pass over every shard)."""
        return self._num_rows

    def fingerprint(self) -> int:
        """A 63-bit integer naming the shards' contents and the order's settings (seed, window, shuffle)."""
        return derive_seed(self.seed, self.shuffle_window, int(self.shuffle), *(s.digest for s in self.shards))

    def filter(self, fn: Callable[[Any], bool]) -> Filtered:
        """Keep the rows ``fn`` accepts; see :class:`Filtered`."""
        return Filtered(self, fn)

    def map(self, fn: Callable[[Any], Any]) -> Mapped:
        """Transform each row with ``fn``; see :class:`Mapped`."""
        return Mapped(self, fn)

    def rows(self, start: int) -> Iterator[tuple[int, Any]]:
        """Yield ``(position after, row)`` from absolute position ``start`` on, forever (epoch after epoch)."""
        if start < 0:
            raise ValueError(f"a stream position is >= 0, got {start}")
        n, w = self.num_rows, self.shuffle_window
        epoch, i = divmod(start, n)
        while True:
            k, j = divmod(i, w)
            yield from self.window_rows(epoch, k)[j:]
            i = (k + 1) * w
            if i >= n:
                epoch, i = epoch + 1, 0

    def window_rows(self, epoch: int, k: int) -> list[tuple[int, Any]]:
        """Window ``k`` of ``epoch``'s rows, each with the position after it: a pure function of ``(epoch, k)``,
        which DataLoader workers read (``trainfold.data.readers``)."""
        base = epoch * self.num_rows + k * self.shuffle_window
        return [(base + off + 1, row) for off, row in enumerate(self._window(epoch, k))]

    def row_at(self, position: int) -> Any:
        """The row at ``position`` (its window read once per process and kept: a worker reads a micro-batch's rows)."""
        epoch, i = divmod(position, self.num_rows)
        k, j = divmod(i, self.shuffle_window)
        return self._kept_window(epoch, k)[j]

    @functools.lru_cache(maxsize=2)  # noqa: B019 (the source lives as long as its run)
    def _kept_window(self, epoch: int, k: int) -> list[Any]:
        return self._window(epoch, k)

    def _window(self, epoch: int, k: int) -> list[Any]:
        """The rows of window ``k`` of ``epoch``, permuted: the blocks under it are read, nothing else."""
        import pyarrow as pa

        order, offsets = self._order(epoch)
        lo, hi = k * self.shuffle_window, min(self.num_rows, (k + 1) * self.shuffle_window)
        first = int(np.searchsorted(offsets, lo, side="right")) - 1
        parts = []
        for b in range(first, len(order)):
            if offsets[b] >= hi:
                break
            table = self._block(*order[b])
            start = max(lo - offsets[b], 0)
            parts.append(table.slice(start, min(hi - offsets[b], table.num_rows) - start))
        rows = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        if self.shuffle:
            rows = rows.take(self._permutation(epoch, k))
        return rows.to_pylist()

    @functools.lru_cache(maxsize=4)  # noqa: B019 (the source lives as long as its run)
    def _permutation(self, epoch: int, k: int) -> np.ndarray:
        """Window ``k`` of ``epoch``'s order: its row ``j`` is row ``perm[j]`` of the window in block order."""
        return np.random.default_rng([self.seed, epoch, 2, k]).permutation(self._window_size(k))

    def sample_id(self, position: int) -> int:
        """The identity of the row at ``position``: a hash of its shard's digest and its row within the shard.

        It names the row itself, not where the order put it, so two runs that read a changed shard
        differ in the ids of exactly the rows they read from it.
        """
        epoch, i = divmod(position, self.num_rows)
        k, j = divmod(i, self.shuffle_window)
        return int(self._window_ids(epoch, k)[j])

    @functools.lru_cache(maxsize=4)  # noqa: B019 (the source lives as long as its run)
    def _window_ids(self, epoch: int, k: int) -> np.ndarray:
        """The ids of window ``k``'s rows in their order (see :meth:`sample_id`), computed at once."""
        lo = k * self.shuffle_window
        index = lo + (self._permutation(epoch, k) if self.shuffle else np.arange(self._window_size(k)))
        _, offsets = self._order(epoch)
        b = np.searchsorted(offsets, index, side="right") - 1
        shard, first_row = self._block_table(epoch)
        digests = np.array([s.digest for s in self.shards], dtype=np.uint64)[shard[b]]
        return _mix(digests, (first_row[b] + index - offsets[b]).astype(np.uint64))

    @functools.lru_cache(maxsize=2)  # noqa: B019 (the source lives as long as its run)
    def _block_table(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """For each block of the epoch's order: its shard, and the row of its shard it starts at."""
        order, _ = self._order(epoch)
        starts = [np.concatenate([[0], np.cumsum(s.blocks)[:-1]]).astype(np.int64) for s in self.shards]
        return np.array([s for s, _ in order], dtype=np.int64), np.array([starts[s][b] for s, b in order], np.int64)

    def _window_size(self, k: int) -> int:
        return min(self.num_rows, (k + 1) * self.shuffle_window) - k * self.shuffle_window

    @functools.lru_cache(maxsize=2)  # noqa: B019 (the source lives as long as its run)
    def _order(self, epoch: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        """The epoch's blocks ``(shard, block)`` in order, and each one's first row within the epoch."""
        shard_order = list(range(len(self.shards)))
        if self.shuffle:
            shard_order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.shards)).tolist()
        order: list[tuple[int, int]] = []
        for s in shard_order:
            nb = len(self.shards[s].blocks)
            blocks = range(nb)
            if self.shuffle:
                blocks = np.random.default_rng([self.seed, epoch, 1, s]).permutation(nb).tolist()
            order.extend((s, b) for b in blocks if self.shards[s].blocks[b])
        sizes = [self.shards[s].blocks[b] for s, b in order]
        return order, np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def _block(self, s: int, b: int) -> Any:
        key = (s, b)
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return self._blocks[key]
        table = _read_block(self.shards[s], b, self.columns)
        self._blocks[key] = table
        while len(self._blocks) > 4:
            self._blocks.popitem(last=False)
        return table


def _mix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hash pairs of uint64 into 63-bit ints (splitmix64's finalizer over ``a ^ (b * golden ratio)``)."""
    with np.errstate(over="ignore"):
        x = a ^ (b * np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x & np.uint64((1 << 63) - 1)).astype(np.int64)


def _read_block(shard: Shard, b: int, columns: tuple[str, ...] | None) -> Any:
    """Read one block of a shard, after checking the shard is still the one that was opened."""
    size = fsio.size(shard.path)
    if size != shard.size:
        raise ShardChangedError(
            f"shard {shard.path!r} changed while the stream reads it: it was {shard.size} bytes, now "
            f"{'gone' if size < 0 else f'{size} bytes'}; shards must not change during a run (write new shards "
            "and start a new run)"
        )
    cols = None if columns is None else list(columns)
    if shard.format == "parquet":
        return _parquet_file(shard.path).read_row_group(b, columns=cols)
    import pyarrow as pa

    if shard.format == "arrow":
        table = pa.Table.from_batches([_arrow_batches(shard.path)[b]])
    else:
        import pyarrow.json as pj

        with fsio.open_binary(shard.path) as f:
            f.seek(shard.offsets[b])
            data = f.read(shard.offsets[b + 1] - shard.offsets[b])
        table = pj.read_json(pa.BufferReader(data), parse_options=pj.ParseOptions(explicit_schema=shard.schema))
    return table if cols is None else table.select(cols)
