"""How an LLM run batches its rows, as one value (``LMBatching``): packing, truncation, padding-free, chunked loss.

``lm_inputs(model, batching, ...)`` returns the training dataset, collator and objective those settings
ask for (TRL's names: ``packing``, ``packing_strategy``, ``max_length``, ``padding_free``; trainfold's
``loss_chunk_size``), or the inputs unchanged when none is set. Every combination it cannot do exactly
is refused by name before any work is done. The trainer builds the record from its arguments
(``trainfold.trainer.inputs.lm_batching_for``); nothing here reads an arguments object.

>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> rows = [{"input_ids": [1, 2, 3]}]
>>> lm_inputs(model, LMBatching(), rows, None, None, None).train_dataset is rows
True
>>> lm_inputs(model, LMBatching(max_length=2), rows, None, None, None).train_dataset
[{'input_ids': [1, 2]}]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from trainfold.core.chunked_loss import chunked_causal_lm
from trainfold.core.losses import causal_lm, default_loss_for
from trainfold.data.lengths import PREFERENCE_COLUMNS
from trainfold.data.mixture import is_stream_source
from trainfold.data.packing import check_packable, pack, packed_collate, padding_free_collate
from trainfold.data.packstream import packed

__all__ = ["DEFAULT_MAX_LENGTH", "LMBatching", "LMInputs", "lm_inputs", "truncated", "truncated_as", "truncates"]

DEFAULT_MAX_LENGTH = 1024  # TRL's SFTConfig.max_length


@attrs.frozen
class LMBatching:
    """How rows of token ids become batches: TRL's packing, truncation and padding-free settings, and the chunked loss.

    ``max_length`` is the packed row's length with ``packing`` (None: TRL's 1024), else the length rows are
    cut to (None: not cut), from the side ``truncation_mode`` names; ``prepared=False``: rows are taken as
    given (SFT's ``skip_prepare_dataset``), never cut.
    """

    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    loss_chunk_size: int = 0
    label_smoothing_factor: float = 0.0
    prepared: bool = True


@attrs.frozen(eq=False)
class LMInputs:
    """What ``train`` trains on: the (packed) dataset, the collator and the objective."""

    train_dataset: Any
    data_collator: Callable[..., Any] | None
    objective: Callable[..., Any] | None


def _preference_rows(dataset: Any) -> bool:
    """Say whether ``dataset``'s first row is a DPO preference row (``prompt_ids``, ``chosen_ids``...)."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or not len(dataset):
        return False
    row = dataset[0]
    return isinstance(row, Mapping) and all(k in row for k in PREFERENCE_COLUMNS)


def _refusals(
    model: nn.Module, args: LMBatching, train_dataset: Any, data_collator: Any, compute_loss_func: Any, objective: Any
) -> list[str]:
    out = []
    batching = "packing" if args.packing else "padding_free"
    if (args.packing or args.padding_free) and _preference_rows(train_dataset):
        out.append(
            f"{batching}=True packs or flattens rows of input_ids, not DPO's preference rows (prompt_ids, "
            "chosen_ids, rejected_ids): run trainfold.dpo.train with DPOArguments(padding_free=True), or keep "
            "padding_free=False and packing=False and pass "
            "data_collator=trainfold.dpo.data.padding_free_preference_collate() (flattened chosen and "
            "rejected rows)"
        )
    elif (args.packing or args.padding_free) and data_collator is not None:
        out.append(
            f"{'packing=True' if args.packing else 'padding_free=True'} builds its own batches (positions restart "
            "at each document); "
            "drop data_collator, or set packing=False and padding_free=False"
        )
    indexable = hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")
    if args.packing and not (indexable or is_stream_source(train_dataset)):
        out.append(
            "packing=True packs a map-style dataset (with __len__) before training, or a trainfold.data.files(...) "
            f"source in windows as it streams, not a {type(train_dataset).__name__}; stream the files with "
            "trainfold.data.files, or use padding_free=True"
        )
    if args.loss_chunk_size:
        if objective is not None:
            out.append(
                "loss_chunk_size chunks the causal-LM loss, but an objective replaces it; chunk inside the "
                "objective (trainfold.core.chunked_loss), or set loss_chunk_size=0"
            )
        elif compute_loss_func is not None:
            out.append(
                "loss_chunk_size computes the causal-LM cross-entropy itself, so it cannot apply "
                "compute_loss_func; drop one of the two"
            )
        elif default_loss_for(model, defer=True) is not causal_lm:
            out.append(
                f"loss_chunk_size is for causal LMs; {type(model).__name__} is not one (its default loss is "
                "not the causal-LM cross-entropy): set loss_chunk_size=0"
            )
    return out


def _cut(row: Mapping[str, Any], cut: slice) -> dict[str, Any]:
    """``row`` with ``input_ids`` and every column as long (labels, masks, positions) cut by ``cut``."""
    n = len(row["input_ids"])
    return {
        k: v[cut] if not isinstance(v, (str, bytes)) and hasattr(v, "__len__") and len(v) == n else v
        for k, v in row.items()
    }


def _supervised(row: Mapping[str, Any]) -> bool:
    labels = row.get("labels")
    if labels is None or isinstance(labels, (int, float)) or not hasattr(labels, "__len__"):
        return True  # no token labels (the collator's, or a sequence-level label): nothing to judge
    return bool((torch.as_tensor(labels) != -100).any())


def _cut_row(row: Any, cut: slice) -> Any:
    return _cut(row, cut) if isinstance(row, Mapping) and "input_ids" in row else row


class _TruncatedStream(torch.utils.data.IterableDataset):
    """A dataset without a length, its rows truncated as they are read (TRL's ``IterableDataset.map``)."""

    def __init__(self, rows: Any, cut: slice) -> None:
        self.rows, self.cut = rows, cut

    def __iter__(self) -> Iterator[Any]:
        for row in self.rows:
            done = _cut_row(row, self.cut)
            if _supervised(done):
                yield done


def truncated(dataset: Any, max_length: int, truncation_mode: str = "keep_start") -> Any:
    """Return ``dataset``'s rows cut to ``max_length`` tokens, as TRL's ``SFTTrainer`` truncates without packing.

    ``input_ids`` and every column as long (``labels``, ``attention_mask``...) keep their start (``"keep_end"``:
    their end); rows left with no label (all ``-100``) are dropped, as TRL drops them. Rows without
    ``input_ids`` (a collator that tokenizes) are left as they are. A dataset with a length is returned as a
    list (as it is when nothing changes: the dataset itself); one without is truncated as it is read.

    >>> truncated([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "score": 1.0}], 2)
    [{'input_ids': [1, 2], 'labels': [-100, 2], 'score': 1.0}]
    >>> truncated([{"input_ids": [1, 2, 3], "labels": [-100, -100, 3]}], 2, "keep_start")  # nothing left to learn
    []
    """
    cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
    if is_stream_source(dataset):  # a streaming source: its own map and filter, so a resume seeks exactly
        return dataset.map(functools.partial(_cut_row, cut=cut)).filter(_supervised)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return _TruncatedStream(dataset, cut)
    rows = [dataset[i] for i in range(len(dataset))]
    if not rows or not all(isinstance(r, Mapping) and "input_ids" in r for r in rows):
        return dataset
    if all(len(r["input_ids"]) <= max_length and _supervised(r) for r in rows):
        return dataset  # nothing to cut or drop: the dataset as given (its arrow columns, its type)
    return [done for done in (_cut(r, cut) for r in rows) if _supervised(done)]


def truncates(batching: LMBatching, objective: Any) -> bool:
    """Say whether ``batching`` truncates the rows (TRL's ``max_length`` without packing): not when an objective
    reads rows of its own, nor for rows taken as given (SFT's ``skip_prepare_dataset``)."""
    return batching.max_length is not None and not batching.packing and objective is None and batching.prepared


def truncated_as(dataset: Any, batching: LMBatching) -> Any:
    """``dataset`` (or a dict of named sets) cut to ``batching.max_length`` from the side it names."""
    assert batching.max_length is not None, "truncates(batching, objective) says when to cut"
    if isinstance(dataset, dict):  # named eval sets
        return {name: truncated_as(rows, batching) for name, rows in dataset.items()}
    return truncated(dataset, batching.max_length, batching.truncation_mode)


def lm_inputs(
    model: nn.Module,
    args: LMBatching,
    train_dataset: Any,
    data_collator: Callable[..., Any] | None,
    compute_loss_func: Callable[..., Any] | None,
    objective: Callable[..., Any] | None,
) -> LMInputs:
    """Return the dataset, collator and objective that ``args``' packing, truncation and chunked-loss settings ask
    for (``args``: an :class:`LMBatching`): ``max_length`` without packing truncates the rows (:func:`truncated`)."""
    if truncates(args, objective):
        train_dataset = truncated_as(train_dataset, args)
    if not (args.packing or args.padding_free or args.loss_chunk_size):
        return LMInputs(train_dataset, data_collator, objective)
    problems = _refusals(model, args, train_dataset, data_collator, compute_loss_func, objective)
    if problems:
        raise ValueError("cannot train with these settings:\n  - " + "\n  - ".join(problems))
    if args.packing or args.padding_free:
        check_packable(model)
    if args.packing:  # a source is packed window by window as it streams, before each global batch is dealt
        length, truncate = args.max_length or DEFAULT_MAX_LENGTH, args.packing_strategy == "bfd"
        if is_stream_source(train_dataset):
            train_dataset = packed(train_dataset, length, truncate=truncate)
        else:
            rows = (train_dataset[i] for i in range(len(train_dataset)))
            train_dataset = pack(rows, length, truncate=truncate)
    if args.padding_free:
        data_collator = padding_free_collate()
    elif args.packing:
        data_collator = packed_collate()
    if args.loss_chunk_size:
        objective = chunked_causal_lm(model, args.loss_chunk_size, args.label_smoothing_factor)
    return LMInputs(train_dataset, data_collator, objective)
