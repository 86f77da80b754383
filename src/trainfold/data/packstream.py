"""Packing a streaming source (TRL's ``bfd``) before its global batches are dealt, resumable at any world size.

``packed(source, max_length, window=1000)`` reads the documents of ``source`` (a ``files(...)``
source, filtered, mapped or mixed) in windows of ``window`` rows, each window formed as a global batch
of the source is (a mixture draws its fixed rows per source in each), and packs each window on its
own by best-fit decreasing (:func:`~trainfold.data.packing.pack`, TRL's ``pack_dataset``). Every
optimizer step then takes the next ``global_batch`` packed rows, in order, and only then are they
cut into micro-batches and dealt to ranks. So the packed rows, and which step trains on which, depend
on the seed, the source's positions and ``(max_length, window)`` only: never on the world size,
the accumulation or the DataLoader's workers.

The cursor after a step records where the window that holds the next packed row starts (each
source's row position and the window's index) and how many of its packed rows were taken: a resume
re-reads and re-packs that one window, O(window) rows, and skips what was taken.

>>> import itertools
>>> class Docs:  # a stand-in source: document p has p % 4 + 1 tokens, all p
...     num_rows = 10**9
...     def rows(self, start):
...         return ((p + 1, {"input_ids": [p] * (p % 4 + 1)}) for p in itertools.count(start))
...     def fingerprint(self):
...         return 7
...     def sample_id(self, p):
...         return p
>>> from trainfold.data.mixture import global_batches
>>> from trainfold.data.transforms import Mapped
>>> stream = packed(Mapped(Docs(), dict), max_length=4, window=8)
>>> first = [[r["input_ids"] for r in rows] for rows, _ in itertools.islice(global_batches(stream, 2), 3)]
>>> first  # window 0 packs into five rows; step 3 takes its last and window 1's first
[[[3, 3, 3, 3], [7, 7, 7, 7]], [[2, 2, 2, 0], [6, 6, 6, 4]], [[1, 1, 5, 5], [11, 11, 11, 11]]]
>>> _, after = next(global_batches(stream, 3))  # three packed rows of the first window's five
>>> after.streams.tolist()[-3:-1]  # the window's index, then the packed rows taken of it
[[0, ...], [3, ...]]
>>> [r["input_ids"] for r in next(global_batches(stream, 2, after))[0]]  # resumed: the window re-packed
[[6, 6, 6, 4], [1, 1, 5, 5]]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import torch
import xxhash

from trainfold.core.rng import derive_seed
from trainfold.core.state import SAMPLES, Cursor, scalar
from trainfold.data.filestream import ShardChangedError
from trainfold.data.mixture import (
    BatchStream,
    global_batches,
    is_stream_source,
    roll,
    stream_cursor,
    without_certificate,
)
from trainfold.data.packing import PACKING_WINDOW, pack
from trainfold.data.readers import Workers

__all__ = ["Packed", "packed"]


@attrs.frozen(eq=False)
class Packed(BatchStream):
    """A source's documents packed in fixed windows; build it with :func:`packed`."""

    source: Any
    max_length: int
    window: int
    truncate: bool
    input_key: str

    @property
    def fingerprint(self) -> int:
        """The packing settings, recorded in the cursor: a resume with others is refused."""
        return derive_seed(self.max_length, self.window, int(self.truncate), len(self.input_key))

    def start_cursor(self) -> Cursor:
        """The source's first cursor, and three rows: window 0, no packed row taken, the sample certificate."""
        inner = stream_cursor(self.source)
        assert inner.streams is not None
        mine = torch.tensor([[0, self.fingerprint], [0, self.fingerprint], [0, SAMPLES]], dtype=torch.int64)
        return Cursor(scalar(0), scalar(0), torch.cat([inner.streams, mine]))

    def batches(
        self, global_batch: int, start: Cursor | None, workers: Workers | None = None
    ) -> Iterator[tuple[list[Any], Cursor]]:
        """Yield ``global_batch`` packed rows per step, with the cursor after each, from ``start`` on.

        ``workers`` read the source's rows (``trainfold.data.readers``); the packing runs in this process.
        """
        start, certificate = without_certificate(start or self.start_cursor())
        step, window_start, taken = self._resume(start)
        windows = global_batches(self.source, self.window, window_start, workers)
        batch, after = next(windows)
        queue = self._pack(batch)[taken:]
        while True:
            rows: list[Any] = []
            while len(rows) < global_batch:
                if not queue:  # the next window starts where this one ended
                    window_start, taken = after, 0
                    batch, after = next(windows)
                    queue = self._pack(batch)
                    continue
                n = min(global_batch - len(rows), len(queue))
                rows.extend(queue[:n])
                queue, taken = queue[n:], taken + n
            if not queue:  # the window is used up: the cursor names the next one
                window_start, taken = after, 0
                batch, after = next(windows)
                queue = self._pack(batch)
            step += 1
            certificate = roll(certificate, [_row_id(r[self.input_key]) for r in rows])
            yield rows, self._cursor(step, window_start, taken, certificate)

    def _pack(self, docs: list[Any]) -> list[Any]:
        return pack(docs, self.max_length, window=self.window, truncate=self.truncate, input_key=self.input_key)

    def _cursor(self, step: int, window_start: Cursor, taken: int, certificate: int) -> Cursor:
        assert window_start.streams is not None
        index = window_start.as_tuple()[1]
        rows = [[index, self.fingerprint], [taken, self.fingerprint], [certificate, SAMPLES]]
        mine = torch.tensor(rows, dtype=torch.int64)
        return Cursor(scalar(0), scalar(step), torch.cat([window_start.streams, mine]))

    def _resume(self, start: Cursor) -> tuple[int, Cursor, int]:
        """The step, the cursor of the window holding the next packed row, and how many of its rows were taken."""
        step = start.as_tuple()[1]
        streams = start.streams
        if streams is None or len(streams) < 3 or streams[-2:, 1].tolist() != [self.fingerprint] * 2:
            if streams is None and step == 0:
                return 0, self.start_cursor(), 0
            raise ShardChangedError(
                f"the cursor (step {step}) was not made by this packed stream (max_length={self.max_length}, "
                f"window={self.window}, truncate={self.truncate}): resume with the packing settings and the "
                "sources the checkpoint was trained on, or start a new run"
            )
        index, taken = (int(x) for x in streams[-2:, 0])
        return step, Cursor(scalar(0), scalar(index), streams[:-2].clone()), taken


def _row_id(tokens: Any) -> int:
    """A packed row's id: a hash of its tokens (its documents' identities are its contents)."""
    return xxhash.xxh3_64_intdigest(np.asarray(tokens, dtype=np.int64).tobytes()) & ((1 << 63) - 1)


def packed(
    source: Any,
    max_length: int,
    *,
    window: int = PACKING_WINDOW,
    truncate: bool = True,
    input_key: str = "input_ids",
) -> Packed:
    """Pack ``source``'s rows into rows of at most ``max_length`` tokens, in windows of ``window`` documents.

    ``truncate=False`` splits longer documents (TRL's ``bfd_split``). See the module docstring.
    """
    if not is_stream_source(source) or isinstance(source, BatchStream):
        raise TypeError(
            f"packed() takes a trainfold.data.files(...) source or a mix(...) of them, got {type(source).__name__}"
        )
    for name, value in (("max_length", max_length), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return Packed(source, max_length, window, truncate, input_key)
