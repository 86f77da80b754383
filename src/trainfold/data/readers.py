"""A streaming source's rows read in DataLoader workers: the same rows, in the same order, as this process reads.

A ``files(...)`` source's order is cut into windows of ``shuffle_window`` rows, each a pure function of
``(seed, epoch, window)`` (``trainfold.data.filestream``), and a filter or a map acts on one row at a
time. So window ``(epoch, k)``, read, decoded, filtered and mapped, is a pure function of its key: with
``dataloader_num_workers > 0``, :func:`read_rows` hands the keys of the windows from a position on, in
order, to a ``torch.utils.data.DataLoader`` over them; its workers read and transform the windows, and
the loader gives them back in key order. This process only concatenates them (and skips the rows
before the position in the first). The rows, their positions, the cursor and every resume are those of
``num_workers=0``, for any number of workers; only the reading moves.

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

from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from trainfold.core.rng import derive_seed, seed_global_rng
from trainfold.data.loaders import ignore_sigterm, loader_errors
from trainfold.data.transforms import empty_epoch_error

__all__ = ["Workers", "read_rows"]

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

    def __getitem__(self, key: tuple[int, int]) -> list[tuple[int, Any]]:
        if get_worker_info() is not None:  # a function drawing from the global generators draws the same anywhere
            seed_global_rng(derive_seed(self.seed, _WINDOW_DRAWS, *key))
        return self.source.window_rows(*key)


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
        if type(source).__name__ == "Filtered":
            return source.fn
        source = getattr(source, "base", None)
    return None


def read_rows(source: Any, start: int, workers: Workers) -> Iterator[tuple[int, Any]]:
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
        _Windows(source, int(source.seed)),
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
