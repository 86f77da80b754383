"""The resumable training stream: optimizer steps as StepBatches, each carrying the cursor after it.

``stream(dataset, sampler, collate, start=state.cursor)`` yields one optimizer step at a time: a
:class:`StepBatch`, the tuple of the step's collated micro-batches, carrying the
:class:`~trainfold.core.state.Cursor` *after* the step. The step stores that cursor in the state, so
rebuilding the stream from a loaded state's cursor continues exactly where the run stopped.

Micro-batches are loaded by a ``torch.utils.data.DataLoader`` driven by the sampler's micro-batches
as its batch sampler, so workers load in parallel while the order stays the sampler's, for any
``num_workers``.

Per-sample randomness in a collator: wrap it with :func:`~trainfold.data.collate.keyed`; it is then
called as ``collate(items, keys)`` with one integer key per item, ``sample_key(seed, epoch, index)``.
Build a ``torch.Generator().manual_seed(key)`` from it; the same sample in the same epoch always
draws the same numbers, whatever the worker, batch or resume point. A collator that draws from the global
generators (torch's, ``np.random``, ``random``: ``DataCollatorForLanguageModeling``) draws, in this process, where
the process's generators are (``train`` saves them with each checkpoint and restores them on resume); in a
DataLoader worker (``dataloader_num_workers > 0``), from generators seeded before each micro-batch from the
sampler's seed, the epoch and the micro-batch's first sample.

HF's loop collates ahead: accelerate's ``DataLoaderShard`` (what ``transformers.Trainer`` iterates) collates the
epoch's next micro-batch before it yields one, never across the epoch's end. ``stream(..., collate_ahead=True)``
does the same (also past ``max_steps``, within its epoch), so a collator drawing from the global generators draws
at the moments of HF's loop and an evaluation or save between steps finds them where HF's does. A callable
``collate_ahead`` is called right before that collation with ``True``, or with ``False`` for a step that closes its
epoch (nothing collated ahead): ``trainfold.train`` keeps the generators' states there for its checkpoints; and
``after_first`` right after the stream's first collation (where a resume sets the states of the save).

>>> from trainfold.data import Sampler, pad_collate
>>> data = [{"input_ids": [1] * n} for n in (1, 2, 3, 4, 5)]
>>> s = Sampler("sequential", 5, per_device_train_batch_size=2)
>>> steps = list(stream(data, s, pad_collate(), num_epochs=1))
>>> [tuple(mb["input_ids"].shape) for step in steps for mb in step]
[(2, 2), (2, 4), (1, 5)]
>>> [step.cursor.as_tuple() for step in steps]
[(0, 1), (0, 2), (1, 0)]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from trainfold.core.rng import derive_seed, seed_global_rng
from trainfold.core.state import Cursor, scalar
from trainfold.data.collate import KeyedCollate, sample_key
from trainfold.data.loaders import ignore_sigterm, loader_errors
from trainfold.data.samplers import Sampler

__all__ = ["StateStream", "StepBatch", "stream"]

_WORKER_DRAWS = 0xC011A7E  # mixed into the seed of a worker's global generators before each micro-batch


class StepBatch(tuple):
    """One optimizer step: a tuple of micro-batches, with the cursor after the step.

    ``indices`` holds each micro-batch's dataset indices (empty for datasets without length).

    >>> b = StepBatch([{"x": 1}], Cursor(scalar(0), scalar(1)), ((4,),))
    >>> len(b), b.cursor.as_tuple(), b.indices
    (1, (0, 1), ((4,),))
    """

    cursor: Cursor
    indices: tuple[tuple[int, ...], ...]

    def __new__(cls, micro_batches: Iterable[Any], cursor: Cursor, indices: Sequence[Sequence[int]] = ()) -> StepBatch:
        self = super().__new__(cls, micro_batches)
        object.__setattr__(self, "cursor", cursor)
        object.__setattr__(self, "indices", tuple(tuple(m) for m in indices))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"StepBatch is immutable; make a new one instead of setting {name!r}")

    def __repr__(self) -> str:
        return f"StepBatch({len(self)} micro-batches, cursor={self.cursor.as_tuple()})"

    def __reduce__(self) -> tuple[Any, ...]:
        return StepBatch, (tuple(self), self.cursor, self.indices)


@attrs.frozen
class _Keyed(Dataset[tuple[int, int, Any]]):
    """Dataset view indexed by ``(epoch, index)``: returns ``(epoch, index, item)``."""

    dataset: Any

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int, Any]:
        return key[0], key[1], self.dataset[key[1]]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[tuple[int, int, Any]]:
        fetch = getattr(self.dataset, "__getitems__", None)
        items = fetch([k[1] for k in keys]) if fetch else [self.dataset[k[1]] for k in keys]
        return [(e, i, item) for (e, i), item in zip(keys, items)]

    def __len__(self) -> int:
        return len(self.dataset)


@attrs.frozen
class _Collate:
    """The DataLoader's collate_fn: strips the keys, or hands them to a keyed collator."""

    collate: Callable[..., Any]
    seed: int

    def __call__(self, triples: list[tuple[int, int, Any]]) -> Any:
        items = [t[2] for t in triples]
        if isinstance(self.collate, KeyedCollate):
            return self.collate(items, [sample_key(self.seed, e, i) for e, i, _ in triples])
        if triples and get_worker_info() is not None:  # a worker collates ahead, and a resume restarts the workers:
            # its global generators are seeded from the micro-batch (its epoch and first sample), so a collator
            # drawing from them (DataCollatorForLanguageModeling) draws the same whatever the resume point
            seed_global_rng(derive_seed(self.seed, _WORKER_DRAWS, triples[0][0], triples[0][1]))
        return self.collate(items)


# -- the stream -----------------------------------------------------------------------------


@attrs.frozen
class _Planned:
    epoch: int
    after: tuple[int, int]
    micro: list[list[int]]
    opens_epoch: bool = False  # the epoch's first step
    ahead: list[int] | None = None  # the epoch's next micro-batch (None: the step closes the epoch)


def _plan(
    sampler: Sampler,
    epoch_batches: Callable[[int], list[list[list[int]]]],
    start: tuple[int, int],
    num_epochs: int | None,
    max_steps: int | None,
) -> Iterator[_Planned]:
    """Yield the steps to run from ``start``, each with the cursor after it."""
    spe = sampler.steps_per_epoch()
    epoch, pos = start
    if pos == spe:
        epoch, pos = epoch + 1, 0
    while num_epochs is None or epoch < num_epochs:
        batches = epoch_batches(epoch)
        for p in range(pos, spe):
            if max_steps is not None and epoch * spe + p >= max_steps:
                return
            after = (epoch, p + 1) if p + 1 < spe else (epoch + 1, 0)
            ahead = batches[p + 1][0] if p + 1 < spe else None
            yield _Planned(epoch, after, batches[p], opens_epoch=p == 0, ahead=ahead)
        epoch, pos = epoch + 1, 0


@attrs.frozen
class _MicroBatches:
    """The DataLoader's batch sampler: every micro-batch of the plan, as ``(epoch, index)`` keys."""

    plan: Callable[[], Iterator[_Planned]]
    collate_ahead: bool = False  # and the micro-batch after the plan's last step, in its epoch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        last = None
        for last in self.plan():
            for micro in last.micro:
                yield [(last.epoch, i) for i in micro]
        if self.collate_ahead and last is not None and last.ahead is not None:  # a plan stopped by max_steps
            yield [(last.epoch, i) for i in last.ahead]


def _cursor(epoch: int, position: int) -> Cursor:
    return Cursor(scalar(epoch), scalar(position))


def stream(
    dataset: Any,
    sampler: Sampler,
    collate: Callable[..., Any],
    *,
    start: Cursor | tuple[int, int] | None = None,
    num_epochs: int | None = None,
    max_steps: int | None = None,
    dataloader_num_workers: int = 0,
    dataloader_persistent_workers: bool = False,
    dataloader_prefetch_factor: int | None = None,
    dataloader_pin_memory: bool = False,
    dataloader_drop_last: bool | None = None,
    epoch_draws: bool = False,
    collate_ahead: bool | Callable[[bool], None] = False,
    after_first: Callable[[], None] | None = None,
) -> Iterator[StepBatch]:
    """Yield the run's optimizer steps from ``start`` (a cursor; default: the beginning) as StepBatches.

    Stops before epoch ``num_epochs`` and before global step ``max_steps`` (counted from the
    start of epoch 0, so a resumed stream stops at the same place); with neither it runs forever
    (let ``fit``'s stop predicate end it). ``dataloader_drop_last``, when given, overrides the
    sampler's ``drop_last``. The ``dataloader_*`` options go to ``torch.utils.data.DataLoader``;
    the order never depends on them. ``dataloader_pin_memory`` defaults to False (pinning only
    helps when batches then go to a GPU). The stream leaves torch's global generator as it was, unless
    ``epoch_draws``: then each epoch starts with one draw from it, as HF's loop does (:func:`epoch_draw`;
    ``trainfold.train`` sets it).

    ``collate_ahead`` and ``after_first`` (map-style datasets): HF's look-ahead collation (the module's docstring).

    A dataset without ``__len__`` (sampler ``num_samples=None``) is read in its own order, an
    epoch being one pass over it; micro-batches are dealt round-robin to ranks, the collator
    runs in this process, ``max_steps`` counts the steps this stream yields, and with workers
    the dataset must shard itself (``torch.utils.data.get_worker_info``) or items repeat.

    >>> from trainfold.data import Sampler, pad_collate
    >>> s = Sampler("sequential", 6, per_device_train_batch_size=2)
    >>> resumed = stream([{"x": i} for i in range(6)], s, pad_collate(), start=(0, 1), max_steps=3)
    >>> [(step[0]["x"].tolist(), step.cursor.as_tuple()) for step in resumed]  # the cursor after each step
    [([2, 3], (0, 2)), ([4, 5], (1, 0))]
    """
    _check_options(
        dataloader_num_workers, dataloader_persistent_workers, dataloader_prefetch_factor, num_epochs, max_steps
    )
    if dataloader_drop_last is not None and dataloader_drop_last != sampler.drop_last:
        sampler = attrs.evolve(sampler, drop_last=dataloader_drop_last)
    begin = (0, 0) if start is None else start.as_tuple() if isinstance(start, Cursor) else (start[0], start[1])
    if begin[0] < 0 or begin[1] < 0:
        raise ValueError(f"start cursor {begin} must have epoch >= 0 and position >= 0")
    workers = (dataloader_num_workers, dataloader_persistent_workers, dataloader_prefetch_factor)
    loader_options = _loader_options(sampler.seed, *workers, dataloader_pin_memory)
    reading = _Reading(
        dataset, sampler, collate, begin, num_epochs, max_steps, loader_options, epoch_draws, collate_ahead, after_first
    )
    if sampler.num_samples is None:
        return _iterable_stream(reading)
    _check_start(sampler, len(dataset), begin)
    return _map_stream(reading)


def _check_options(
    num_workers: int,
    persistent_workers: bool,
    prefetch_factor: int | None,
    num_epochs: int | None,
    max_steps: int | None,
) -> None:
    errors = loader_errors(num_workers, persistent_workers, prefetch_factor)
    for name, value in (("num_epochs", num_epochs), ("max_steps", max_steps)):
        if value is not None and (not isinstance(value, int) or value < 0):
            errors.append(f"{name}={value!r} must be an int >= 0 or None")
    if errors:
        raise ValueError("invalid stream options: " + "; ".join(errors))


def _loader_options(
    seed: int, num_workers: int, persistent_workers: bool, prefetch_factor: int | None, pin_memory: bool
) -> dict[str, Any]:
    return {
        "num_workers": num_workers,
        "persistent_workers": persistent_workers,
        "prefetch_factor": prefetch_factor,
        "pin_memory": pin_memory,
        # DataLoader draws its worker base seed; a private generator keeps global RNG untouched
        "generator": torch.Generator().manual_seed(derive_seed(seed, 0x5EED)),
        # Orchestrators (Slurm) signal every process of a job; the main process decides when to stop.
        "worker_init_fn": ignore_sigterm if num_workers > 0 else None,
    }


def _check_start(sampler: Sampler, num_samples: int, begin: tuple[int, int]) -> None:
    """Refuse a map-style start the sampler cannot serve: another dataset, no step, a cursor past the epoch."""
    if sampler.num_samples != num_samples:
        raise ValueError(
            f"sampler was made for {sampler.num_samples} samples but the dataset has {num_samples}; "
            "make the sampler from this dataset"
        )
    spe = sampler.steps_per_epoch()
    if spe == 0:
        raise ValueError(
            f"an epoch of {sampler.num_samples} samples gives no optimizer step (global batch "
            f"{sampler.global_batch_size}, drop_last={sampler.drop_last}); use smaller batches or drop_last=False"
        )
    if begin[1] > spe:
        raise ValueError(
            f"start cursor {begin} is past the {spe} steps of an epoch: was the dataset, batch size, "
            "accumulation or world size changed since the checkpoint? Resume with the same settings"
        )


@attrs.frozen
class _Reading:
    """What a stream reads and where it starts and stops: ``_map_stream`` steps a map-style dataset,
    ``_iterable_stream`` one without a length."""

    dataset: Any
    sampler: Sampler
    collate: Callable[..., Any]
    begin: tuple[int, int]
    num_epochs: int | None
    max_steps: int | None
    loader_options: dict[str, Any]
    epoch_draws: bool = False
    collate_ahead: bool | Callable[[bool], None] = False
    after_first: Callable[[], None] | None = None


def _map_stream(reading: _Reading) -> Iterator[StepBatch]:
    dataset, sampler, collate, begin = reading.dataset, reading.sampler, reading.collate, reading.begin
    num_epochs, max_steps, loader_options = reading.num_epochs, reading.max_steps, reading.loader_options
    epoch_batches = functools.lru_cache(maxsize=2)(sampler.epoch_batches)  # shared by loader and steps

    def plan() -> Iterator[_Planned]:
        return _plan(sampler, epoch_batches, begin, num_epochs, max_steps)

    ahead = reading.collate_ahead
    batches = _MicroBatches(plan, collate_ahead=bool(ahead))
    loader = DataLoader(
        _Keyed(dataset), batch_sampler=batches, collate_fn=_Collate(collate, sampler.seed), **loader_options
    )
    loaded = _FirstNoted(iter(loader), reading.after_first)
    pending: list[Any] = []  # the micro-batch collated ahead
    for planned in plan():
        if planned.opens_epoch and reading.epoch_draws:
            epoch_draw()
        micro = [pending.pop() if pending else next(loaded) for _ in planned.micro]
        if ahead:
            if callable(ahead):
                ahead(planned.ahead is not None)
            if planned.ahead is not None:
                pending.append(next(loaded))
        yield StepBatch(micro, _cursor(*planned.after), planned.micro)


class _FirstNoted:
    """An iterator that calls ``noted`` (when given) right after yielding its first item."""

    def __init__(self, items: Iterator[Any], noted: Callable[[], None] | None) -> None:
        self.items, self.noted = items, noted

    def __next__(self) -> Any:
        item = next(self.items)
        if self.noted is not None:
            noted, self.noted = self.noted, None
            noted()
        return item


def epoch_draw() -> None:
    """Draw one number from torch's global generator, as ``iter(DataLoader)`` does at each epoch of HF's loop.

    torch's ``DataLoader`` draws its workers' base seed from the global generator whenever it starts iterating,
    so a collator that draws from it (``DataCollatorForLanguageModeling``) sees one draw less per epoch unless the
    stream draws it too. The stream's own loader draws from a private generator (it is iterated once, resumed or
    not); this draw, at the start of each epoch before its first collation, keeps the global generator where HF's
    run has it: the masks of every step are HF's. Nothing of trainfold's reads the number. ``trainfold.train`` (the
    HF run) draws it; a bare ``stream`` does not (``epoch_draws=False``).
    """
    torch.empty((), dtype=torch.int64).random_()


def _as_list(items: list[Any]) -> list[Any]:
    return items


def _iterable_stream(reading: _Reading) -> Iterator[StepBatch]:
    """Steps of a dataset without length: micro-batches in its own order, dealt round-robin to ranks.

    The collator runs in this process (keys need each sample's position in the epoch). The last
    round of micro-batches that not every rank would get is dropped; ``max_steps`` counts the
    steps this stream yields.
    """
    dataset, sampler, collate, max_steps = reading.dataset, reading.sampler, reading.collate, reading.max_steps
    num_epochs, loader_options = reading.num_epochs, reading.loader_options
    b, a, w = sampler.per_device_train_batch_size, sampler.gradient_accumulation_steps, sampler.world_size
    epoch, skip = reading.begin
    done = 0
    while num_epochs is None or epoch < num_epochs:
        loader = DataLoader(dataset, batch_size=b, drop_last=sampler.drop_last, collate_fn=_as_list, **loader_options)
        rounds = _chunks(_chunks(iter(loader), w), a)  # steps -> rounds -> micro-batches (all ranks)
        steps = ((pos, [r for r in step if len(r) == w]) for pos, step in enumerate(rounds))
        steps = ((pos, step) for pos, step in steps if step)
        current = next(steps, None)
        if current is None:
            raise ValueError(
                f"epoch {epoch} of {type(dataset).__name__} gives no optimizer step "
                "(too few samples for the batch sizes)"
            )
        while current is not None:
            pos, step = current
            current = next(steps, None)
            if pos < skip:
                continue
            if max_steps is not None and done >= max_steps:
                return
            if pos == 0 and reading.epoch_draws:
                epoch_draw()
            after = (epoch, pos + 1) if current is not None else (epoch + 1, 0)
            mine = [r[sampler.rank] for r in step]
            offsets = [(pos * a + j) * w * b + sampler.rank * b for j in range(len(mine))]
            micro = [_collate_here(collate, sampler.seed, epoch, off, items) for off, items in zip(offsets, mine)]
            yield StepBatch(micro, _cursor(*after))
            done += 1
        epoch, skip = epoch + 1, 0


def _collate_here(collate: Callable[..., Any], seed: int, epoch: int, offset: int, items: list[Any]) -> Any:
    return _Collate(collate, seed)([(epoch, offset + i, item) for i, item in enumerate(items)])


def _chunks(it: Iterator[Any], size: int) -> Iterator[list[Any]]:
    while chunk := list(itertools.islice(it, size)):
        yield chunk


@attrs.frozen
class StateStream:
    """A training stream whose steps are made from the state they start from (GRPO's generations).

    ``steps(cursor)`` yields one item per optimizer step from a data cursor, forever (the run's
    stop predicates end it); ``prepare(state, item) -> (state, batch)`` turns an item into the
    step's micro-batches (a ``StepBatch`` carrying the cursor after the step) with the latest
    state, and may return that state with new ``metrics``/``extras`` (a buffer the checkpoint must
    hold). ``extras`` are the entries the run's first state needs (the template a checkpoint loads
    into); ``steps_per_epoch`` and ``samples_per_step`` (``None``: unknown) do what the sampler's do;
    ``evaluate(state) -> metrics`` (optional) replaces the run's evaluation. ``train(...,
    train_stream=...)`` runs it.

    >>> from trainfold.core.state import TrainState
    >>> s = StateStream(steps=lambda cursor: iter([1, 2]), prepare=lambda state, item: (state, [item]),
    ...                 steps_per_epoch=2, samples_per_step=1)
    >>> list(s.steps(Cursor())), s.prepare(None, 1)
    ([1, 2], (None, [1]))
    """

    steps: Callable[[Cursor], Iterable[Any]]
    prepare: Callable[[Any, Any], tuple[Any, Any]]
    steps_per_epoch: int | None
    samples_per_step: int | None
    extras: Mapping[str, Any] = attrs.field(factory=dict)
    evaluate: Callable[[Any], Mapping[str, float]] | None = None
