"""Collation, the resumable step stream, and generation batching.

``stream(dataset, sampler, collate, start=state.cursor)`` yields one optimizer step at a time: a
:class:`StepBatch`, the tuple of the step's collated micro-batches, carrying the
:class:`~trainfold.core.state.Cursor` *after* the step. The step stores that cursor in the state, so
rebuilding the stream from a loaded state's cursor continues exactly where the run stopped.

Micro-batches are loaded by a ``torch.utils.data.DataLoader`` driven by the sampler's micro-batches
as its batch sampler, so workers load in parallel while the order stays the sampler's, for any
``num_workers``.

Per-sample randomness in a collator: wrap it with :func:`keyed`; it is then called as
``collate(items, keys)`` with one integer key per item, ``sample_key(seed, epoch, index)``. Build a
``torch.Generator().manual_seed(key)`` from it; the same sample in the same epoch always draws
the same numbers, whatever the worker, batch or resume point.

>>> from trainfold.data.samplers import Sampler
>>> data = [{"input_ids": [1] * n} for n in (1, 2, 3, 4, 5)]
>>> s = Sampler("sequential", 5, per_device_train_batch_size=2)
>>> steps = list(stream(data, s, pad_collate(), num_epochs=1))
>>> [tuple(mb["input_ids"].shape) for step in steps for mb in step]
[(2, 2), (2, 4), (1, 5)]
>>> [step.cursor.as_tuple() for step in steps]
[(0, 1), (0, 2), (1, 0)]
"""

from __future__ import annotations

import copy
import functools
import itertools
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from trainfold.core.rng import derive_seed
from trainfold.core.state import Cursor, scalar
from trainfold.data.samplers import Sampler

__all__ = [
    "KeyedCollate",
    "PadCollate",
    "StateStream",
    "StepBatch",
    "close_loader",
    "eval_loader",
    "generation_batches",
    "keyed",
    "pad_collate",
    "sample_key",
    "stream",
]

DEFAULT_PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1}


class StepBatch(tuple):
    """One optimizer step: a tuple of micro-batches, with the cursor after the step.

    ``indices`` holds each micro-batch's dataset indices (empty for datasets without length).

    >>> b = StepBatch([{"x": 1}], Cursor(scalar(0), scalar(1)), ((4,),))
    >>> len(b), b.cursor.as_tuple(), b.indices
    (1, (0, 1), ((4,),))
    """

    cursor: Cursor
    indices: tuple[tuple[int, ...], ...]

    def __new__(cls, micro_batches: Iterable[Any], cursor: Cursor, indices: Sequence[Sequence[int]] = ()) -> StepBatch:  # noqa: PYI034
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


# -- collation ------------------------------------------------------------------------------


def _as_tensor(value: Any, key: str) -> Tensor:
    if isinstance(value, Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(
            f"cannot make a tensor of item key {key!r} (value {value!r:.60}); leave it out with keys=[...]"
        ) from exc


@attrs.frozen
class PadCollate:
    """Collate items (mappings) into a dict of tensors, right-padding 1-d sequences per key.

    Each 1-d key is padded to the longest in the micro-batch (rounded up to a multiple of
    ``pad_to_multiple_of``): ``labels`` with ``label_pad_token_id``, ``attention_mask`` and
    ``token_type_ids`` with 0, anything else with ``pad_token_id`` (``pad_values`` overrides per
    key). A missing ``attention_mask`` is made from the ``input_ids`` lengths. Scalars are stacked.
    Use :func:`pad_collate` to make one.

    >>> c = PadCollate(pad_token_id=9)
    >>> out = c([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    >>> out["input_ids"].tolist(), out["labels"].tolist(), out["attention_mask"].tolist()
    ([[1, 2, 3], [4, 9, 9]], [[1, 2, 3], [4, -100, -100]], [[1, 1, 1], [1, 0, 0]])
    """

    pad_token_id: int = 0
    label_pad_token_id: int = -100
    pad_to_multiple_of: int | None = None
    keys: tuple[str, ...] | None = None
    pad_values: tuple[tuple[str, int], ...] = ()

    def pad_value(self, key: str) -> int:
        """Return the value ``key`` is padded with."""
        overrides = dict(self.pad_values)
        if key in overrides:
            return overrides[key]
        if key == "labels":
            return self.label_pad_token_id
        return DEFAULT_PAD_VALUES.get(key, self.pad_token_id)

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        if not items:
            raise ValueError("cannot collate an empty micro-batch")
        keys = list(self.keys) if self.keys is not None else list(items[0].keys())
        for i, item in enumerate(items):
            missing = [k for k in keys if k not in item]
            if missing:
                raise KeyError(f"item {i} of the micro-batch lacks keys {missing} (has {sorted(item.keys())})")
        out = {k: self._column(k, [_as_tensor(item[k], k) for item in items]) for k in keys}
        if "attention_mask" not in out and "input_ids" in out and out["input_ids"].dim() == 2:
            lens = [len(item["input_ids"]) for item in items]  # items may hold lists
            width = out["input_ids"].shape[1]
            if all(n == width for n in lens):
                out["attention_mask"] = torch.ones(len(lens), width, dtype=torch.long)
            else:
                out["attention_mask"] = (torch.arange(width) < torch.tensor(lens)[:, None]).long()
        return out

    def _column(self, key: str, values: list[Tensor]) -> Tensor:
        if any(v.dim() != 1 for v in values):
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(
                    f"key {key!r} has items of different shapes {sorted(shapes)}; only 1-d sequences are padded"
                )
            return torch.stack(values)
        lengths = [v.shape[0] for v in values]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        dtype = values[0].dtype
        values = [v if v.dtype == dtype else v.to(dtype) for v in values]
        if all(n == width for n in lengths):  # nothing to pad
            return torch.stack(values)
        fill = self.pad_value(key)
        out = pad_sequence(values, batch_first=True, padding_value=fill)
        return F.pad(out, (0, width - out.shape[1]), value=fill) if out.shape[1] < width else out


def pad_collate(
    pad_token_id: int = 0,
    label_pad_token_id: int = -100,
    pad_to_multiple_of: int | None = None,
    keys: Sequence[str] | None = None,
    pad_values: Mapping[str, int] | None = None,
) -> PadCollate:
    """Return a collator that right-pads ``input_ids``/``attention_mask``/``labels`` (see PadCollate).

    >>> c = pad_collate(pad_to_multiple_of=4)
    >>> out = c([{"input_ids": [5, 6], "labels": [5, 6]}, {"input_ids": [7], "labels": [7]}])
    >>> out["input_ids"].tolist(), out["labels"].tolist(), out["attention_mask"].tolist()
    ([[5, 6, 0, 0], [7, 0, 0, 0]], [[5, 6, -100, -100], [7, -100, -100, -100]], [[1, 1, 0, 0], [1, 0, 0, 0]])
    """
    if pad_to_multiple_of is not None and pad_to_multiple_of <= 0:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be a positive int or None")
    return PadCollate(
        pad_token_id=pad_token_id,
        label_pad_token_id=label_pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        keys=None if keys is None else tuple(keys),
        pad_values=tuple(sorted((pad_values or {}).items())),
    )


def sample_key(seed: int, epoch: int, index: int) -> int:
    """Return the random key of dataset sample ``index`` in ``epoch`` of a run seeded ``seed``.

    >>> sample_key(0, 1, 5) == sample_key(0, 1, 5), sample_key(0, 1, 5) == sample_key(0, 2, 5)
    (True, False)
    """
    return derive_seed(seed, epoch, index)


@attrs.frozen
class KeyedCollate:
    """A collator called as ``fn(items, keys)``, one :func:`sample_key` per item. Make with :func:`keyed`.

    >>> from trainfold.data.samplers import Sampler
    >>> s = Sampler("sequential", 4, per_device_train_batch_size=2, seed=5)
    >>> check = KeyedCollate(lambda items, keys: [k == sample_key(5, 0, i) for i, k in zip(items, keys)])
    >>> [step[0] for step in stream(list(range(4)), s, check, num_epochs=1)]
    [[True, True], [True, True]]
    """

    fn: Callable[[Sequence[Any], Sequence[int]], Any]

    def __call__(self, items: Sequence[Any], keys: Sequence[int]) -> Any:
        return self.fn(items, keys)


def keyed(fn: Callable[[Sequence[Any], Sequence[int]], Any]) -> KeyedCollate:
    """Mark ``fn(items, keys)`` as a collator that draws per-sample randomness from ``keys``.

    >>> import torch
    >>> def noisy(items, keys):
    ...     return torch.stack([torch.rand(1, generator=torch.Generator().manual_seed(k)) for k in keys])
    >>> c = keyed(noisy)
    >>> c([None], [7]).tolist() == c([None], [7]).tolist()
    True
    """
    return KeyedCollate(fn)


@attrs.frozen
class _Keyed:
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
        return self.collate(items)


# -- the stream -----------------------------------------------------------------------------


@attrs.frozen
class _Planned:
    epoch: int
    after: tuple[int, int]
    micro: list[list[int]]


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
            yield _Planned(epoch, after, batches[p])
        epoch, pos = epoch + 1, 0


@attrs.frozen
class _MicroBatches:
    """The DataLoader's batch sampler: every micro-batch of the plan, as ``(epoch, index)`` keys."""

    plan: Callable[[], Iterator[_Planned]]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for planned in self.plan():
            for micro in planned.micro:
                yield [(planned.epoch, i) for i in micro]


def _loader_errors(num_workers: int, persistent_workers: bool, prefetch_factor: int | None) -> list[str]:
    errors = []
    if not isinstance(num_workers, int) or num_workers < 0:
        errors.append(f"dataloader_num_workers={num_workers!r} must be an int >= 0")
    elif num_workers == 0:
        if persistent_workers:
            errors.append(
                "dataloader_persistent_workers=True needs dataloader_num_workers > 0 (it keeps worker processes alive)"
            )
        if prefetch_factor is not None:
            errors.append(
                f"dataloader_prefetch_factor needs dataloader_num_workers > 0: dataloader_prefetch_factor="
                f"{prefetch_factor} needs worker processes to prefetch (set dataloader_num_workers, or leave it None)"
            )
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor <= 0):
        errors.append(f"dataloader_prefetch_factor={prefetch_factor!r} must be a positive int or None")
    return errors


loader_errors = _loader_errors  # public: TrainingArguments checks the same DataLoader options (one owner)


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
) -> Iterator[StepBatch]:
    """Yield the run's optimizer steps from ``start`` (a cursor; default: the beginning) as StepBatches.

    Stops before epoch ``num_epochs`` and before global step ``max_steps`` (counted from the
    start of epoch 0, so a resumed stream stops at the same place); with neither it runs forever
    (let ``fit``'s stop predicate end it). ``dataloader_drop_last``, when given, overrides the
    sampler's ``drop_last``. The ``dataloader_*`` options go to ``torch.utils.data.DataLoader``;
    the order never depends on them. ``dataloader_pin_memory`` defaults to False (pinning only
    helps when batches then go to a GPU).

    A dataset without ``__len__`` (sampler ``num_samples=None``) is read in its own order, an
    epoch being one pass over it; micro-batches are dealt round-robin to ranks, the collator
    runs in this process, ``max_steps`` counts the steps this stream yields, and with workers
    the dataset must shard itself (``torch.utils.data.get_worker_info``) or items repeat.

    >>> from trainfold.data.samplers import Sampler
    >>> s = Sampler("sequential", 6, per_device_train_batch_size=2)
    >>> resumed = stream([{"x": i} for i in range(6)], s, pad_collate(), start=(0, 1), max_steps=3)
    >>> [(step[0]["x"].tolist(), step.cursor.as_tuple()) for step in resumed]  # the cursor after each step
    [([2, 3], (0, 2)), ([4, 5], (1, 0))]
    """
    errors = _loader_errors(dataloader_num_workers, dataloader_persistent_workers, dataloader_prefetch_factor)
    for name, value in (("num_epochs", num_epochs), ("max_steps", max_steps)):
        if value is not None and (not isinstance(value, int) or value < 0):
            errors.append(f"{name}={value!r} must be an int >= 0 or None")
    if errors:
        raise ValueError("invalid stream options: " + "; ".join(errors))
    if dataloader_drop_last is not None and dataloader_drop_last != sampler.drop_last:
        sampler = attrs.evolve(sampler, drop_last=dataloader_drop_last)
    begin = (0, 0) if start is None else start.as_tuple() if isinstance(start, Cursor) else tuple(start)
    if begin[0] < 0 or begin[1] < 0:
        raise ValueError(f"start cursor {begin} must have epoch >= 0 and position >= 0")
    loader_options = {
        "num_workers": dataloader_num_workers,
        "persistent_workers": dataloader_persistent_workers,
        "prefetch_factor": dataloader_prefetch_factor,
        "pin_memory": dataloader_pin_memory,
        # DataLoader draws its worker base seed; a private generator keeps global RNG untouched
        "generator": torch.Generator().manual_seed(derive_seed(sampler.seed, 0x5EED)),
        # Orchestrators (Slurm) signal every process of a job; the main process decides when to stop.
        "worker_init_fn": _ignore_sigterm if dataloader_num_workers > 0 else None,
    }
    if sampler.num_samples is None:
        return _iterable_stream(dataset, sampler, collate, begin, num_epochs, max_steps, loader_options)
    if sampler.num_samples != len(dataset):
        raise ValueError(
            f"sampler was made for {sampler.num_samples} samples but the dataset has {len(dataset)}; "
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
    return _map_stream(dataset, sampler, collate, begin, num_epochs, max_steps, loader_options)


def _map_stream(
    dataset: Any,
    sampler: Sampler,
    collate: Callable[..., Any],
    begin: tuple[int, int],
    num_epochs: int | None,
    max_steps: int | None,
    loader_options: dict[str, Any],
) -> Iterator[StepBatch]:
    epoch_batches = functools.lru_cache(maxsize=2)(sampler.epoch_batches)  # shared by loader and steps

    def plan() -> Iterator[_Planned]:
        return _plan(sampler, epoch_batches, begin, num_epochs, max_steps)

    loader = DataLoader(
        _Keyed(dataset), batch_sampler=_MicroBatches(plan), collate_fn=_Collate(collate, sampler.seed), **loader_options
    )
    loaded = iter(loader)
    for planned in plan():
        micro = [next(loaded) for _ in planned.micro]
        yield StepBatch(micro, _cursor(*planned.after), planned.micro)


def _ignore_sigterm(worker_id: int) -> None:
    """Let a DataLoader worker survive SIGTERM, so the main process can finish the step and save."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _as_list(items: list[Any]) -> list[Any]:
    return items


def _iterable_stream(
    dataset: Any,
    sampler: Sampler,
    collate: Callable[..., Any],
    begin: tuple[int, int],
    num_epochs: int | None,
    max_steps: int | None,
    loader_options: dict[str, Any],
) -> Iterator[StepBatch]:
    """Steps of a dataset without length: micro-batches in its own order, dealt round-robin to ranks.

    The collator runs in this process (keys need each sample's position in the epoch). The last
    round of micro-batches that not every rank would get is dropped; ``max_steps`` counts the
    steps this stream yields.
    """
    b, a, w = sampler.per_device_train_batch_size, sampler.gradient_accumulation_steps, sampler.world_size
    epoch, skip = begin
    done = 0
    while num_epochs is None or epoch < num_epochs:
        loader = DataLoader(dataset, batch_size=b, drop_last=sampler.drop_last, collate_fn=_as_list, **loader_options)
        rounds = _chunks(_chunks(iter(loader), w), a)  # steps -> rounds -> micro-batches (all ranks)
        steps = ((pos, [r for r in step if len(r) == w]) for pos, step in enumerate(rounds))
        steps = ((pos, step) for pos, step in steps if step)
        current = next(steps, None)
        if current is None:
            raise ValueError(
                f"epoch {epoch} of {type(dataset).__name__} gives no optimizer step (too few samples for the batch sizes)"
            )
        while current is not None:
            pos, step = current
            current = next(steps, None)
            if pos < skip:
                continue
            if max_steps is not None and done >= max_steps:
                return
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


# -- evaluation batches -----------------------------------------------------------------------


class _Iterated(torch.utils.data.IterableDataset):
    """An iterable that is not a torch dataset (a generator function's result, a custom reader), as one."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


def close_loader(loader: Any) -> None:
    """Stop a DataLoader's persistent workers now.

    They would outlive the run that made the loader: its iterator sits in reference cycles, so nothing
    stops them before the interpreter exits, where ``multiprocessing`` waits for them forever.
    """
    iterator = getattr(loader, "_iterator", None)  # torch keeps a persistent-workers iterator here
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None


def eval_loader(
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    batch_size: int,
    *,
    dataloader_drop_last: bool = False,
    dataloader_num_workers: int = 0,
    dataloader_persistent_workers: bool = False,
    dataloader_prefetch_factor: int | None = None,
    dataloader_pin_memory: bool = False,
) -> DataLoader:
    """Return the ``DataLoader`` of an eval set: batches of ``batch_size`` in dataset order, the HF eval options.

    As HF's eval dataloader: ``num_workers``, ``persistent_workers``, ``prefetch_factor``,
    ``pin_memory`` and, for a dataset with a length, ``drop_last`` (a torch ``IterableDataset``
    keeps its last short batch, as in HF). The order is the dataset's for any number of workers
    (a dataset without length must shard itself across workers, or items repeat). Iterate the
    loader once per evaluation: with ``persistent_workers`` the same workers serve every one.

    >>> loader = eval_loader(list(range(5)), lambda items: items, 2, dataloader_drop_last=True)
    >>> list(loader)
    [[0, 1], [2, 3]]
    """
    errors = _loader_errors(dataloader_num_workers, dataloader_persistent_workers, dataloader_prefetch_factor)
    if not isinstance(batch_size, int) or batch_size <= 0:
        errors.append(f"per_device_eval_batch_size={batch_size!r} must be a positive int")
    if errors:
        raise ValueError("invalid eval dataloader options: " + "; ".join(errors))
    sized = hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    if not sized and not isinstance(dataset, torch.utils.data.IterableDataset):
        dataset = _Iterated(dataset)
    elif sized and not isinstance(dataset, torch.utils.data.IterableDataset):
        if dataloader_drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"dataloader_drop_last=True drops every row of an eval set of {len(dataset)} rows (fewer than "
                f"per_device_eval_batch_size={batch_size}); use a smaller eval batch size or dataloader_drop_last=False"
            )
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        drop_last=dataloader_drop_last and not iterable,
        collate_fn=collate,
        num_workers=dataloader_num_workers,
        persistent_workers=dataloader_persistent_workers,
        prefetch_factor=dataloader_prefetch_factor,
        pin_memory=dataloader_pin_memory,
        worker_init_fn=_ignore_sigterm if dataloader_num_workers > 0 else None,
    )


# -- generation batching --------------------------------------------------------------------


def _repeat_rows(micro: Any, times: int) -> Any:
    if times == 1:
        return micro
    if isinstance(micro, Mapping):
        return {k: _repeat_rows(v, times) for k, v in micro.items()}
    if isinstance(micro, Tensor):
        return micro.repeat_interleave(times, dim=0)
    if isinstance(micro, (list, tuple)):  # each repeat its own object: a reward function may change one
        return type(micro)(copy.deepcopy(x) for x in micro for _ in range(times))
    raise TypeError(f"cannot repeat rows of a {type(micro).__name__}; prompts must be dicts, tensors or lists")


def _block_ends(step: Any, filled: int, optimizer_steps_per_generation: int) -> bool:
    cursor = getattr(step, "cursor", None)
    if cursor is None:
        return filled == optimizer_steps_per_generation
    return filled == optimizer_steps_per_generation or int(cursor.position) % optimizer_steps_per_generation == 0


def generation_batches(
    prompt_stream: Iterable[Sequence[Any]],
    generate: Callable[[list[Any]], Sequence[Any]],
    optimizer_steps_per_generation: int,
    num_generations: int = 1,
    num_iterations: int = 1,
) -> Iterator[tuple[Any, ...]]:
    """Yield optimizer steps of generated data, calling ``generate`` once per block of steps.

    A block gathers the prompt micro-batches of ``optimizer_steps_per_generation`` steps of
    ``prompt_stream`` (rows repeated ``num_generations`` times, consecutively), calls
    ``generate(micro_batches)`` once on all of them, which returns one generated micro-batch per
    prompt micro-batch, and yields the result split back into the block's steps: a StepBatch
    with the prompt step's cursor and indices (prompt indices, not repeated), or a plain tuple
    when the prompt steps carry no cursor. Blocks end where a step's cursor position is a multiple of
    ``optimizer_steps_per_generation`` and at each epoch end, so a resumed stream re-forms the same blocks
    from the next boundary; the last block may be shorter. With ``num_iterations`` > 1 each block's
    steps are yielded that many times over, in the same order (TRL's ``num_iterations``); every
    pass carries the prompt steps' cursors, so a stream resumed from a step's cursor continues after
    it: resume bitwise from the end of a block's last pass.

    >>> prompts = [[[1], [2]], [[3], [4]], [[5], [6]]]  # 3 steps of 2 micro-batches
    >>> out = list(generation_batches(prompts, lambda mbs: [[x * 10 for x in mb] for mb in mbs], 2, 2))
    >>> [list(step) for step in out]
    [[[10, 10], [20, 20]], [[30, 30], [40, 40]], [[50, 50], [60, 60]]]
    """
    if optimizer_steps_per_generation <= 0 or num_generations <= 0 or num_iterations <= 0:
        raise ValueError(
            f"optimizer_steps_per_generation={optimizer_steps_per_generation}, num_generations={num_generations} and "
            f"num_iterations={num_iterations} must be positive ints"
        )
    block: list[Any] = []
    for step in prompt_stream:
        block.append(step)
        if _block_ends(step, len(block), optimizer_steps_per_generation):
            yield from _generate_block(block, generate, num_generations, num_iterations)
            block = []
    if block:
        yield from _generate_block(block, generate, num_generations, num_iterations)


def _generate_block(
    block: list[Any], generate: Callable[[list[Any]], Sequence[Any]], num_generations: int, num_iterations: int = 1
) -> Iterator[tuple[Any, ...]]:
    prompts = [_repeat_rows(mb, num_generations) for step in block for mb in step]
    generated = list(generate(prompts))
    if len(generated) != len(prompts):
        raise ValueError(
            f"generate returned {len(generated)} micro-batches for {len(prompts)} prompt micro-batches; "
            "it must return one generated micro-batch per prompt micro-batch, in order"
        )
    steps, start = [], 0
    for step in block:
        micro = generated[start : start + len(step)]
        cursor = getattr(step, "cursor", None)
        steps.append(tuple(micro) if cursor is None else StepBatch(micro, cursor, getattr(step, "indices", ())))
        start += len(step)
    for _ in range(num_iterations):
        yield from steps


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
