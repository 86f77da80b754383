"""Mixtures of streaming sources, and the resumable step stream over a source: global batches dealt to ranks.

``mix({name: source}, weights={name: w})`` draws a fixed number of rows from each source in every
global batch (levanter's "stable mixtures"): the counts are the weights' shares of the batch, rounded
by largest remainder, so which rows form a batch depends only on the sources' positions, never on
how many rows another source's filter dropped.

``source_stream(source, ...)`` forms each optimizer step's global batch first, then cuts it into
micro-batches of ``per_device_train_batch_size`` and deals them round-robin to the ranks (as
``Sampler`` does), so the rows of a step do not depend on the world size. Each :class:`StepBatch`
carries the cursor after it: ``position`` counts steps, ``streams`` holds each source's row position
and fingerprint; resuming from it continues exactly, at any world size keeping the global batch.

>>> from trainfold.data.transforms import Mapped
>>> class Count:  # a stand-in source: row i is i
...     num_rows = 10**9
...     def rows(self, start):
...         return ((p + 1, p) for p in itertools.count(start))
...     def fingerprint(self):
...         return 7
...     def sample_id(self, p):
...         return p
>>> m = mix({"a": Mapped(Count(), lambda r: ("a", r)), "b": Mapped(Count(), lambda r: ("b", r))},
...         weights={"a": 3, "b": 1})
>>> m.counts(4)
{'a': 3, 'b': 1}
>>> steps = list(source_stream(m, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2))
>>> sorted(steps[1][0] + steps[1][1]), steps[1].cursor.streams[:2, 0].tolist()  # each source's row position
([('a', 3), ('a', 4), ('a', 5), ('b', 1)], [6, 2])
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import torch
import xxhash

from trainfold.core.rng import derive_seed
from trainfold.core.state import SAMPLES, Cursor, sample_certificate, scalar
from trainfold.data.dealing import cut, deal
from trainfold.data.filestream import ShardChangedError, is_source
from trainfold.data.readers import Workers, collated, read_positions, read_rows, worker_steps
from trainfold.data.samplers import Sampler
from trainfold.data.shardlog import describe, records, shards_of, split
from trainfold.data.steps import StepBatch

__all__ = [
    "BatchStream",
    "Mixture",
    "global_batches",
    "is_stream_source",
    "mix",
    "SourceData",
    "source_data",
    "source_steps",
    "source_stream",
    "stream_cursor",
    "without_certificate",
]


class BatchStream:
    """A stream that forms its global batches itself (packing, ``trainfold.data.packstream``) over a source.

    Subclasses give :meth:`start_cursor` (the cursor of a run's first state) and :meth:`batches` (each
    global batch's rows with the cursor after it, from a cursor on), both pure functions of the cursor.
    """

    def start_cursor(self) -> Cursor:
        """The cursor a run over this stream starts from."""
        raise NotImplementedError

    def batches(
        self, global_batch: int, start: Cursor | None, workers: Workers | None = None
    ) -> Iterator[tuple[list[Any], Cursor]]:
        """Yield each global batch's rows, with the cursor after it, from ``start`` on (its sources' rows read
        by ``workers``' DataLoader workers)."""
        raise NotImplementedError


@attrs.frozen(eq=False)
class Mixture:
    """Named sources and their weights; build it with :func:`mix`."""

    sources: dict[str, Any]
    weights: dict[str, float]
    seed: int = 0

    def filter(self, fn: Callable[[Any], bool]) -> Mixture:
        """Filter each source (before mixing: the rows per source per batch stay fixed)."""
        return attrs.evolve(self, sources={k: s.filter(fn) for k, s in self.sources.items()})

    def map(self, fn: Callable[[Any], Any]) -> Mixture:
        """Transform each source's rows."""
        return attrs.evolve(self, sources={k: s.map(fn) for k, s in self.sources.items()})

    def counts(self, global_batch: int) -> dict[str, int]:
        """Rows of each source in a global batch of ``global_batch`` rows (largest remainder rounding).

        >>> Mixture({"a": None, "b": None, "c": None}, {"a": 1, "b": 1, "c": 1}).counts(4)
        {'a': 2, 'b': 1, 'c': 1}
        """
        total = sum(self.weights.values())
        exact = {k: global_batch * w / total for k, w in self.weights.items()}
        out = {k: int(v) for k, v in exact.items()}
        by_remainder = sorted(exact, key=lambda k: (-(exact[k] - out[k]), list(exact).index(k)))
        for k in by_remainder[: global_batch - sum(out.values())]:
            out[k] += 1
        starved = [k for k, n in out.items() if n == 0 and self.weights[k] > 0]
        if starved:
            raise ValueError(
                f"a global batch of {global_batch} rows gives sources {starved} no row (weights {self.weights}); "
                "a stable mixture draws whole rows per batch: raise the global batch or those weights"
            )
        return out


def mix(sources: Mapping[str, Any], *, weights: Mapping[str, float], seed: int = 0) -> Mixture:
    """Mix named streaming sources: every global batch holds a fixed number of rows of each.

    The rows of a batch are shuffled by a permutation seeded by ``(seed, step)``.
    """
    if set(sources) != set(weights):
        raise ValueError(
            f"mix() needs one weight per source: sources {sorted(sources)}, weights {sorted(weights)}; "
            "name the same sources in both"
        )
    bad = {k: w for k, w in weights.items() if not isinstance(w, (int, float)) or w < 0 or w != w}
    if bad or not any(weights.values()):
        raise ValueError(f"mixture weights must be numbers >= 0, not all zero; got {dict(weights)}")
    for name, source in sources.items():
        if not is_source(source):
            raise TypeError(
                f"source {name!r} is a {type(source).__name__}; mix() takes trainfold.data.files(...) sources"
            )
    return Mixture(dict(sources), {k: float(weights[k]) for k in sources}, seed)


def is_stream_source(obj: Any) -> bool:
    """Return whether ``obj`` is a streaming source or a mixture of them (what ``source_stream`` reads).

    >>> is_stream_source([1]), is_stream_source(Mixture({}, {}))
    (False, True)
    """
    return is_source(obj) or isinstance(obj, (Mixture, BatchStream))


def stream_cursor(source: Any) -> Cursor:
    """Return the cursor a run over ``source`` starts from: step 0, each source at row 0 with its fingerprint.

    A run's first state holds it, so its checkpoints (and the template a resume loads them into) have
    the same structure from the first step on.
    """
    if isinstance(source, BatchStream):
        return source.start_cursor()
    components, _, _, fingerprints = _components(source)
    rows = [[0, f] for f in fingerprints] + records(components) + [[0, SAMPLES]]
    streams = torch.tensor(rows, dtype=torch.int64)
    return Cursor(scalar(0), scalar(0), streams)


def roll(previous: int, ids: list[int]) -> int:
    """Fold one step's sample ids (in batch order) into the rolling certificate.

    >>> roll(0, [1, 2]) == roll(0, [1, 2]), roll(0, [1, 2]) == roll(0, [2, 1])
    (True, False)
    """
    return derive_seed(previous, xxhash.xxh3_64_intdigest(np.asarray(ids, dtype=np.int64).tobytes()))


def without_certificate(cursor: Cursor) -> tuple[Cursor, int]:
    """Return ``cursor`` without its certificate row, and the certificate (0 when it holds none)."""
    value = sample_certificate(cursor)
    if value is None:
        return cursor, 0
    assert cursor.streams is not None
    return attrs.evolve(cursor, streams=cursor.streams[:-1]), value


def _components(source: Any) -> tuple[list[Any], Callable[[int], list[int]], int | None, list[int]]:
    """The sources a stream reads, the rows each gives per global batch, the batch shuffle's seed, and the
    fingerprint recorded for each (a mixture's weights and seed folded in: changing them changes the batches)."""
    if isinstance(source, Mixture):
        names = list(source.sources)
        settings = xxhash.xxh3_64_intdigest(repr((source.seed, sorted(source.weights.items()))).encode())
        fingerprints = [derive_seed(int(source.sources[k].fingerprint()), settings) for k in names]
        counts_of = functools.partial(_counts, source, names)
        return [source.sources[k] for k in names], counts_of, source.seed, fingerprints
    return [source], lambda g: [g], None, [int(source.fingerprint())]


def _counts(mixture: Mixture, names: list[str], global_batch: int) -> list[int]:
    counts = mixture.counts(global_batch)
    return [counts[k] for k in names]


def _start_positions(components: list[Any], fingerprints: list[int], start: Cursor | None) -> tuple[int, list[int]]:
    """The step and each source's row position a stream starts from, after checking the fingerprints."""
    if start is None:
        return 0, [0] * len(fingerprints)
    start, _ = without_certificate(start)
    epoch, step = start.as_tuple()
    if start.streams is None:
        if (epoch, step) != (0, 0):
            raise ValueError(
                f"cursor {(epoch, step)} has no stream positions: it was made by a dataset with a length, not a "
                "streaming source; resume with the data the checkpoint was trained on"
            )
        return 0, [0] * len(fingerprints)
    recorded, shards = split(start.streams.tolist())
    if len(recorded) != len(fingerprints):
        raise ValueError(
            f"the cursor holds positions of {len(recorded)} source(s) but the stream reads {len(fingerprints)}; "
            "resume with the same sources (and mixture) the checkpoint was trained on"
        )
    for i, (now, (_, fp)) in enumerate(zip(fingerprints, recorded)):
        if now != fp:
            found = "" if shards is None else describe(shards, [s for c in components for s in shards_of(c)])
            why = found or "shards changed, vanished or were added, or seed, shuffle_window or mixture weights changed"
            raise ShardChangedError(
                f"source {i}'s shards or order settings are not those the checkpoint was trained on (fingerprint "
                f"{fp} recorded, {now} now): {why}; restore them, or start a new run"
            )
    return step, [p for p, _ in recorded]


def global_batches(
    source: Any, global_batch: int, start: Cursor | None = None, workers: Workers | None = None, keys: bool = False
) -> Iterator[tuple[list[Any], Cursor]]:
    """Yield each global batch's rows, with the cursor after it, from ``start`` on.

    With ``workers`` (``num_workers > 0``) each source's windows are read in DataLoader workers
    (``trainfold.data.readers``); the rows and cursors are the same. ``keys`` yields each row as its
    key ``(source, position after)`` instead (the rows are not read unless a filter must see them).

    >>> from trainfold.data.transforms import Mapped
    >>> class Count:
    ...     num_rows = 100
    ...     def rows(self, start):
    ...         return ((p + 1, p) for p in itertools.count(start))
    ...     def fingerprint(self):
    ...         return 1
    ...     def sample_id(self, p):
    ...         return p
    >>> rows, after = next(global_batches(Count(), 3))
    >>> rows, after.as_tuple(), after.streams.tolist()[0]  # then the sample certificate's row
    ([0, 1, 2], (0, 1), [3, 1])
    """
    if isinstance(source, BatchStream):
        yield from source.batches(global_batch, start, workers)
        return
    components, counts_of, mix_seed, fingerprints = _components(source)
    counts = counts_of(global_batch)
    step, positions = _start_positions(components, fingerprints, start)
    shard_rows = records(components)
    certificate = 0 if start is None else without_certificate(start)[1]
    read = read_positions if keys else read_rows
    readers = [read(c, p, workers or Workers()) for c, p in zip(components, positions)]
    while True:
        rows: list[Any] = []
        ids: list[int] = []
        for i, (reader, n) in enumerate(zip(readers, counts)):
            for pos, row in itertools.islice(reader, n):
                positions[i] = pos
                rows.append((i, pos) if keys else row)
                ids.append(components[i].sample_id(pos - 1) ^ i)  # a source's ids differ from another's
        if mix_seed is not None:
            order = np.random.default_rng([mix_seed, 3, step]).permutation(len(rows))
            rows, ids = [rows[j] for j in order], [ids[j] for j in order]
        step += 1
        certificate = roll(certificate, ids)
        rows_of = [[p, f] for p, f in zip(positions, fingerprints)] + shard_rows + [[certificate, SAMPLES]]
        yield rows, Cursor(scalar(0), scalar(step), torch.tensor(rows_of, dtype=torch.int64))


def source_stream(
    source: Any,
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int = 1,
    world_size: int = 1,
    rank: int = 0,
    collate: Callable[..., Any] | None = None,
    start: Cursor | None = None,
    seed: int = 0,
    max_steps: int | None = None,
    dataloader_num_workers: int = 0,
    dataloader_prefetch_factor: int | None = None,
    dataloader_persistent_workers: bool = False,
) -> Iterator[StepBatch]:
    """Yield this rank's optimizer steps over a streaming source (or mixture) from ``start`` (a cursor).

    The global batch is ``per_device_train_batch_size × gradient_accumulation_steps × world_size`` rows;
    rank ``r`` gets micro-batches ``r, r + world_size, ...`` of it, each passed to ``collate`` (default:
    the list of rows; a :func:`~trainfold.data.keyed` collator also gets each row's key
    ``sample_key(seed, 0, ordinal)``). ``max_steps`` counts from the start of the run (a resumed stream
    stops at the same step). ``StepBatch.indices`` holds each micro-batch's row ordinals in the run
    (``step × global + i``). ``dataloader_num_workers > 0`` reads and transforms the sources' rows in that many
    DataLoader workers per source (``trainfold.data.readers``: the same rows and cursors as 0); packing and the
    collator run in this process. A source's loader is iterated once, for the whole stream, so its workers
    persist whatever ``dataloader_persistent_workers`` says.
    """
    workers = Workers(dataloader_num_workers, dataloader_prefetch_factor, dataloader_persistent_workers)
    sizes = {
        "per_device_train_batch_size": per_device_train_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "world_size": world_size,
    }
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad or not 0 <= rank < world_size:
        raise ValueError(f"invalid stream sizes {bad or sizes} / rank {rank}: sizes are ints >= 1, 0 <= rank < world")
    if not is_stream_source(source):
        raise TypeError(
            f"source_stream takes a trainfold.data.files(...) source or mix(...), got {type(source).__name__}"
        )
    g = per_device_train_batch_size * gradient_accumulation_steps * world_size
    mine = deal(cut(list(range(g)), per_device_train_batch_size), world_size)[rank]
    collate = collate or _as_list
    done = 0 if start is None else start.as_tuple()[1]
    if workers.num_workers and not isinstance(source, BatchStream):  # the workers read and collate the rows
        keyed = global_batches(source, g, start, workers, keys=True)
        run = worker_steps(_components(source)[0], keyed, mine, (done, max_steps), collate, seed, workers)
        yield from (StepBatch(micro, after, ordinals) for micro, after, ordinals in run)
        return
    batches = global_batches(source, g, start, workers)
    while max_steps is None or done < max_steps:
        rows, after = next(batches)
        ordinals = [[done * g + i for i in m] for m in mine]
        micro = [collated(collate, seed, [rows[i] for i in m], o) for m, o in zip(mine, ordinals)]
        yield StepBatch(micro, after, ordinals)
        done += 1


def _as_list(rows: list[Any]) -> list[Any]:
    return rows


def source_steps(
    source: Any,
    sampler: Sampler,
    collate: Callable[..., Any],
    *,
    start: Cursor | None = None,
    num_epochs: int | None = None,
    max_steps: int | None = None,
    dataloader_num_workers: int = 0,
    dataloader_persistent_workers: bool = False,
    dataloader_prefetch_factor: int | None = None,
    dataloader_pin_memory: bool = False,
) -> Iterator[StepBatch]:
    """:func:`~trainfold.data.stream`'s call over a streaming source: ``source_stream`` with the sampler's sizes.

    A source is one endless stream (``num_epochs`` must be ``None``: give ``max_steps``). Its rows are read
    in ``dataloader_num_workers`` DataLoader workers (0: in this process); the order never depends on them.
    The micro-batches are collated in this process (``dataloader_pin_memory`` pins nothing here).
    """
    if num_epochs is not None:
        raise ValueError(
            f"num_epochs={num_epochs} over a streaming source: its epochs run on into each other; give max_steps"
        )
    return source_stream(
        source,
        per_device_train_batch_size=sampler.per_device_train_batch_size,
        gradient_accumulation_steps=sampler.gradient_accumulation_steps,
        world_size=sampler.world_size,
        rank=sampler.rank,
        collate=collate,
        start=start,
        seed=sampler.seed,
        max_steps=max_steps,
        dataloader_num_workers=dataloader_num_workers,
        dataloader_prefetch_factor=dataloader_prefetch_factor,
        dataloader_persistent_workers=dataloader_persistent_workers,
    )


@attrs.frozen(eq=False)
class SourceData:
    """``loop.run``'s data over a streaming source: ``state -> source_stream(..., start=state.cursor)``.

    ``first_cursor()`` is the cursor a run's first state holds (:func:`stream_cursor`); ``loop.run`` gives it
    to a fresh state, so the checkpoints and the template a resume loads them into have one structure.
    """

    source: Any
    options: dict[str, Any]

    def __call__(self, state: Any) -> Iterator[StepBatch]:
        """The steps from ``state``'s cursor on."""
        return source_stream(self.source, start=state.cursor, **self.options)

    def first_cursor(self) -> Cursor:
        """The cursor of a run's first state: step 0, each source at row 0 with its fingerprint."""
        return stream_cursor(self.source)


def source_data(source: Any, *, per_device_train_batch_size: int, **options: Any) -> SourceData:
    """Return ``loop.run``'s ``data`` over ``source`` (a ``files(...)`` source, a mixture, ``packed``).

    ``options`` are :func:`source_stream`'s (``gradient_accumulation_steps``, ``world_size``, ``rank``,
    ``collate``, ``seed``, ``max_steps``); a resumed run continues at its checkpoint's cursor.
    """
    if not is_stream_source(source):
        kind = type(source).__name__
        raise TypeError(f"source_data takes a trainfold.data.files(...) source or mix(...), got {kind}")
    if "start" in options:
        raise TypeError("source_data takes no start=: loop.run starts the stream at its state's cursor")
    options = {"per_device_train_batch_size": per_device_train_batch_size, **options}
    return SourceData(source, options)
