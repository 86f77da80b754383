"""A streaming source's rows read in DataLoader workers: the same rows, in the same order, as this process reads.

A ``files(...)`` source's order is cut into windows of ``shuffle_window`` rows, each a pure function of
``(seed, epoch, window)`` (``trainfold.data.filestream``), and a filter or a map acts on one row at a
time. So window ``(epoch, k)``, read, decoded, filtered and mapped, is a pure function of its key: with
``dataloader_num_workers > 0``, :func:`read_rows` hands the keys of the windows from a position on, in
order, to a ``torch.utils.data.DataLoader`` over them; its workers read and transform the windows, and
the loader gives them back in key order. This process only concatenates them (and skips the rows
before the position in the first). The rows, their positions, the cursor and every resume are those of
``num_workers=0``, for any number of workers; only the reading moves.

``source_stream`` (not packed) goes further with :func:`worker_steps`: this process forms each global
batch as ``(source, position)`` keys (:func:`read_positions`: a filter's workers send back positions only),
and a second DataLoader's workers read, map and collate each of this rank's micro-batches.

A filter's or map's function then runs in a worker: it must be a function of the row (as a resume needs
anyway). A worker seeds its global generators (torch's, ``np.random``, ``random``) before each window from
the source's seed, the epoch and the window, so a function drawing from them draws the same numbers
whatever the worker count or the resume point (not those of this process's generators, which it draws
from with no workers).

>>> import itertools, pyarrow as pa, pyarrow.parquet as pq, tempfile
>>> from trainfold.data.filestream import files
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"id": list(range(30))}), f"{d}/part.parquet", row_group_size=8)
>>> src = files(f"{d}/*.parquet", seed=0, shuffle_window=4).filter(lambda r: r["id"] % 3 == 0)
>>> here = list(itertools.islice(read_rows(src, 5, Workers()), 8))
>>> here == list(itertools.islice(read_rows(src, 5, Workers(num_workers=2)), 8))
True
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from trainfold.core.rng import derive_seed, seed_global_rng
from trainfold.core.state import Cursor
from trainfold.data.collate import KeyedCollate, sample_key
from trainfold.data.loaders import ignore_sigterm, loader_errors
from trainfold.data.transforms import Filtered, empty_epoch_error

__all__ = ["Workers", "collated", "read_positions", "read_rows", "worker_steps"]

_WINDOW_DRAWS = 0x3D0A5  # mixed into the seed of a worker's global generators before each window


@attrs.frozen
class Workers:
    """The DataLoader settings a source is read with (HF's ``dataloader_*`` names, without the prefix)."""

    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False

    def __attrs_post_init__(self) -> None:
        errors = loader_errors(self.num_workers, self.persistent_workers, self.prefetch_factor)
        if errors:
            raise ValueError("invalid DataLoader settings for a streaming source: " + "; ".join(errors))


@attrs.frozen
class _Windows(Dataset[list[tuple[int, Any]]]):
    """The source's windows by key ``(epoch, k)``: each one's rows, read and transformed, with their positions."""

    source: Any
    seed: int
    positions_only: bool = False

    def __getitem__(self, key: tuple[int, int]) -> list[tuple[int, Any]]:
        if get_worker_info() is not None:  # a function drawing from the global generators draws the same anywhere
            seed_global_rng(derive_seed(self.seed, _WINDOW_DRAWS, *key))
        rows = self.source.window_rows(*key)
        return [(pos, None) for pos, _ in rows] if self.positions_only else rows


@attrs.frozen
class _Keys:
    """The loader's sampler: the keys of every window from ``(epoch, k)`` on, forever."""

    epoch: int
    k: int
    per_epoch: int

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, k = self.epoch, self.k
        while True:
            yield epoch, k
            k += 1
            if k == self.per_epoch:
                epoch, k = epoch + 1, 0


def _unbatched(window: Any) -> Any:
    return window


def _filter_of(source: Any) -> Any:
    """The outermost filter function of a source's transforms (named when it keeps no row); ``None``: none."""
    while source is not None:
        if isinstance(source, Filtered):
            return source.fn
        source = getattr(source, "base", None)
    return None


def read_positions(source: Any, start: int, workers: Workers) -> Iterator[tuple[int, None]]:
    """Yield ``(position after, None)`` for each row ``read_rows`` yields: which rows a source keeps, not the rows.

    Without a filter every position is kept (nothing is read); with one, workers read and filter the
    windows and send back only the kept positions (the rows themselves are read by the workers that
    collate them, :func:`worker_steps`).
    """
    if _filter_of(source) is None:
        return ((p + 1, None) for p in itertools.count(start))
    return read_rows(source, start, workers, positions_only=True)


def read_rows(source: Any, start: int, workers: Workers, *, positions_only: bool = False) -> Iterator[tuple[int, Any]]:
    """Yield ``(position after, row)`` of ``source`` from ``start`` on, as ``source.rows(start)`` does.

    ``workers.num_workers == 0`` reads in this process (``source.rows``); more read whole windows in
    DataLoader workers (see the module docstring). A source that cannot be cut into windows (not made by
    ``files(...)``, ``.filter`` or ``.map``) is refused with workers.
    """
    if workers.num_workers == 0:
        yield from source.rows(start)
        return
    if not hasattr(source, "window_rows"):
        raise TypeError(
            f"dataloader_num_workers={workers.num_workers} reads a source's windows in workers, but a "
            f"{type(source).__name__} has none (window_rows): stream trainfold.data.files(...) sources, or set "
            "dataloader_num_workers=0"
        )
    n, w = int(source.num_rows), int(source.shuffle_window)
    epoch, k = start // n, start % n // w
    loader = DataLoader(
        _Windows(source, int(source.seed), positions_only),
        batch_size=None,
        sampler=_Keys(epoch, k, -(-n // w)),
        collate_fn=_unbatched,
        num_workers=workers.num_workers,
        prefetch_factor=workers.prefetch_factor,
        generator=torch.Generator().manual_seed(0),  # the base seed is drawn from it, never from the global one
        worker_init_fn=ignore_sigterm,
    )
    windows = iter(loader)
    clean_from = -(-start // n) * n  # the first epoch read from its first row: a filter keeping none of it is refused
    kept = False
    try:
        for window in windows:
            for pos, row in window:
                if pos > start:
                    kept = True
                    yield pos, row
            k = (k + 1) % (-(-n // w))
            if k == 0:
                if not kept and epoch * n >= clean_from:
                    raise empty_epoch_error(_filter_of(source), n, epoch)
                epoch, kept = epoch + 1, False
    finally:
        windows._shutdown_workers()  # type: ignore[attr-defined]


# -- collating in the workers -----------------------------------------------------------------------

_MICRO_DRAWS = 0xC011A7E  # as data.steps: mixed into the seed of a worker's generators before each micro-batch


def collated(collate: Callable[..., Any], seed: int, rows: list[Any], ordinals: list[int]) -> Any:
    """``collate(rows)``, or ``collate(rows, keys)`` for a keyed collator (``sample_key(seed, 0, ordinal)``)."""
    if isinstance(collate, KeyedCollate):
        return collate(rows, [sample_key(seed, 0, o) for o in ordinals])
    if rows and get_worker_info() is not None:  # a collator drawing from the global generators (MLM's masks):
        seed_global_rng(derive_seed(seed, _MICRO_DRAWS, 0, ordinals[0]))  # seeded by the micro-batch, as data.steps
    return collate(rows)


@attrs.frozen
class _Rows(Dataset[tuple[int, Any]]):
    """Rows by key ``(source, position after, ordinal)``: the ordinal, and the source's row at the position."""

    components: list[Any]

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[int, Any]:
        return key[2], self.components[key[0]].row_at(key[1] - 1)


@attrs.frozen
class _RowCollate:
    collate: Callable[..., Any]
    seed: int

    def __call__(self, items: list[tuple[int, Any]]) -> Any:
        return collated(self.collate, self.seed, [r for _, r in items], [o for o, _ in items])


@attrs.frozen
class _Once:
    """A batch sampler that is a generator (the DataLoader iterates it once)."""

    batches: Iterator[list[tuple[int, int, int]]]

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        return self.batches


def worker_steps(
    components: list[Any],
    keyed: Iterator[tuple[list[tuple[int, int]], Cursor]],
    mine: list[list[int]],
    steps: tuple[int, int | None],
    collate: Callable[..., Any],
    seed: int,
    workers: Workers,
) -> Iterator[tuple[list[Any], Cursor, list[list[int]]]]:
    """Yield this rank's collated micro-batches of each step, with the cursor after it and their ordinals.

    ``keyed`` yields each global batch as ``(source, position after)`` keys (``global_batches(..., keys=True)``)
    with the cursor after it; ``mine`` holds this rank's micro-batches as indices into the global batch;
    ``steps`` the first step and ``max_steps``. The keys are formed in this process, ahead of the workers
    (as the DataLoader asks for them); each worker reads its micro-batch's rows and collates them.
    """
    if not all(hasattr(c, "row_at") for c in components):
        names = sorted({type(c).__name__ for c in components if not hasattr(c, "row_at")})
        raise TypeError(
            f"dataloader_num_workers={workers.num_workers} reads a source's rows in workers, but a {names[0]} has "
            "no row_at: stream trainfold.data.files(...) sources, or set dataloader_num_workers=0"
        )
    done, max_steps = steps
    after_of: deque[tuple[Cursor, list[list[int]]]] = deque()

    def micro_batches() -> Iterator[list[tuple[int, int, int]]]:
        step = done
        while max_steps is None or step < max_steps:
            keys, after = next(keyed)
            ordinals = [[step * len(keys) + i for i in m] for m in mine]
            after_of.append((after, ordinals))
            for m, o in zip(mine, ordinals):
                yield [(*keys[i], ordinal) for i, ordinal in zip(m, o)]
            step += 1

    loader = DataLoader(
        _Rows(components),
        batch_sampler=_Once(micro_batches()),
        collate_fn=_RowCollate(collate, seed),
        num_workers=workers.num_workers,
        prefetch_factor=workers.prefetch_factor,
        generator=torch.Generator().manual_seed(0),  # the base seed is drawn from it, never from the global one
        worker_init_fn=ignore_sigterm,
    )
    loaded = iter(loader)
    try:
        while max_steps is None or done < max_steps:
            micro = [next(loaded) for _ in mine]
            after, ordinals = after_of.popleft()
            yield micro, after, ordinals
            done += 1
    finally:
        loaded._shutdown_workers()  # type: ignore[attr-defined]
