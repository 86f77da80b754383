"""What a run feeds the model: its device, the columns it reads, the loss, the objective and the collators.

>>> import torch
>>> from trainfold.trainer.args import TrainingArguments
>>> device_for(TrainingArguments(use_cpu=True)).type
'cpu'
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from trainfold.core.losses import default_loss_for, label_smoothed, refuse_unlabelled
from trainfold.core.model_loss import model_loss
from trainfold.core.tasks import model_task
from trainfold.data import StepBatch
from trainfold.data.collate import collate_for, model_pad_collate, pad_collate
from trainfold.data.columns import (
    HF_LABEL_COLUMNS,
    Columns,
    columns_for,
    eval_collate,
    padded_to_multiple,
    with_columns,
)
from trainfold.data.hfstream import as_source
from trainfold.data.llm import LMBatching, lm_inputs, truncated_as, truncates
from trainfold.trainer.args import TrainingArguments

__all__ = [
    "RunInputs",
    "LabelsFromInputs",
    "eval_labels",
    "run_inputs",
    "device_for",
    "columns_of",
    "to_device",
    "warn_about_eval_rows",
]


def device_for(args: TrainingArguments) -> torch.device:
    """Return the run's device: CUDA when there is one and ``use_cpu`` is off, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() and not args.use_cpu else torch.device("cpu")


def columns_of(
    model: nn.Module,
    args: TrainingArguments,
    data_collator: Callable[..., Any] | None,
    *,
    labels_required: bool = False,
    objective: Any = None,
) -> Columns:
    """Return which columns reach ``model`` (HF's ``remove_unused_columns``, ``label_names``; ``data.columns``)."""
    return columns_for(
        model,
        label_names=args.label_names,
        remove_unused_columns=args.remove_unused_columns,
        length_column_name=args.length_column_name,
        default_collator=data_collator is None,
        labels_required=labels_required,
        reads=(*getattr(objective, "columns", ()), *getattr(data_collator, "columns", ())),
    )


def to_device(batches: Iterable[StepBatch], device: torch.device) -> Iterator[StepBatch]:
    """Yield ``batches`` with their tensors on ``device`` (unchanged on the CPU)."""
    if device.type == "cpu":
        yield from batches
        return
    for b in batches:
        moved = [
            {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
            for mb in b
        ]
        yield StepBatch(moved, b.cursor, getattr(b, "indices", ()))


@attrs.frozen
class LabelsFromInputs:
    """A collator that gives each item without ``labels`` its ``input_ids`` as labels, then calls ``collate``.

    What packing does for training (each document's tokens are its targets), done for evaluation,
    which never packs: so rows with only ``input_ids`` still get an ``eval_loss``.

    >>> from trainfold.data.collate import pad_collate
    >>> LabelsFromInputs(pad_collate(pad_token_id=9))([{"input_ids": [1, 2]}, {"input_ids": [3]}])["labels"].tolist()
    [[1, 2], [3, -100]]
    """

    collate: Callable[[list[Any]], Any]

    def __call__(self, items: list[Any]) -> Any:
        return self.collate([item if "labels" in item else {**item, "labels": item["input_ids"]} for item in items])


def eval_labels(collate: Callable[..., Any] | None, args: TrainingArguments, data_collator: Any, objective: Any) -> Any:
    """Return the evaluation collator: ``LabelsFromInputs`` where training builds labels (packing), else as is."""
    if data_collator is not None or objective is not None:
        return collate
    if not (args.packing or args.padding_free):
        return collate
    return LabelsFromInputs(collate or pad_collate())


@attrs.frozen
class RunInputs:
    """The datasets, loss, objectives and collators of a run, after DPO's ``prepare`` and the LLM settings."""

    train_dataset: Any
    eval_dataset: Any
    loss: Callable[..., Any]
    objective: Callable[..., Any] | None  # the training objective (packing/chunked loss applied; NEFTune not yet)
    eval_objective: Callable[..., Any] | None  # the user's (prepared) objective: evaluation scores with it
    columns: Columns
    collate: Callable[[list[Any]], Any]  # training batches
    eval_collate: Callable[[list[Any]], Any]  # evaluation batches (no packing)


# the tasks trainfold has a loss for (losses.default_loss_for), and seq2seq, whose refusal names the fix
_TASKS_WITH_LOSSES = ("causal_lm", "token_classification", "masked_lm", "sequence_classification", "seq2seq")


def own_loss_objective(model: nn.Module, compute_loss_func: Any, objective: Any, *, evaluation: bool = False) -> Any:
    """Return ``objective``, or where ``transformers.Trainer`` would train with the loss the model returns and
    trainfold knows no loss for its task (no ``compute_loss_func``, no objective), ``core.model_loss`` of it
    (``evaluation``: the one scoring it)."""
    if compute_loss_func is not None or objective is not None or model_task(model) in _TASKS_WITH_LOSSES:
        return objective
    return model_loss(model, evaluation=evaluation)


def _loss(
    model: nn.Module, args: TrainingArguments, compute_loss_func: Callable[..., Any] | None, objective: Any
) -> Callable[..., Any]:
    loss = compute_loss_func or default_loss_for(model, defer=objective is not None)
    if args.label_smoothing_factor:
        if objective is not None:
            raise ValueError(
                "label_smoothing_factor smooths the loss, but an objective replaces it; smooth inside "
                "the objective, or set label_smoothing_factor=0"
            )
        loss = label_smoothed(loss, args.label_smoothing_factor)  # names the fix for a custom loss
    return loss


def run_inputs(
    model: nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    eval_dataset: Any,
    data_collator: Callable[[list[Any]], Any] | None,
    compute_loss_func: Callable[..., Any] | None,
    objective: Callable[..., Any] | None,
    *,
    world_size: int = 1,
    device: torch.device | None = None,
    processing_class: Any = None,
) -> RunInputs:
    """Return what the run feeds the model; refuse a dataset that trains nothing, and what cannot be done.

    Without ``data_collator``, batches are padded with ``processing_class``'s pad id (as HF's
    ``DataCollatorWithPadding``), else with the model's ``config.pad_token_id``; without either, rows that need
    padding are refused (``collate.model_pad_collate``); packing's and padding-free collators pad nothing.
    """
    train_dataset = as_source(train_dataset)  # a datasets stream of local files: read by files(), resumes seek
    loss = _loss(model, args, compute_loss_func, objective)
    batching = lm_batching_for(args)
    if eval_dataset is not None and truncates(batching, objective):  # as the training rows (lm_inputs), as TRL
        eval_dataset = truncated_as(eval_dataset, batching)
    if objective is None:
        refuse_unlabelled(train_dataset, loss)  # a fully masked dataset would train nothing, forever
    elif eval_dataset is not None and world_size > 1:
        raise NotImplementedError(
            "evaluating an objective across ranks is not supported yet; evaluate after training "
            "in one process (trainfold.evaluate(..., objective=...)), or drop eval_dataset"
        )
    columns = columns_of(model, args, data_collator, labels_required=objective is None, objective=objective)
    default = data_collator if data_collator is not None else collate_for(processing_class)
    default = default if default is not None else model_pad_collate(model)  # the model's pad id, or a refusal
    padded = padded_to_multiple(default, args.pad_to_multiple_of)
    prepare = getattr(objective, "prepare", None)
    if prepare is not None:  # DPO: precomputed reference log-probs, cached in output_dir
        objective, train_dataset, eval_dataset = prepare(
            model, train_dataset, eval_dataset, padded, device=device or device_for(args), output_dir=args.output_dir,
            train_batch_size=args.per_device_train_batch_size, eval_batch_size=args.per_device_eval_batch_size,
        )  # fmt: skip
    lm = lm_inputs(model, batching, train_dataset, data_collator, compute_loss_func, objective)  # packing, chunked loss
    return RunInputs(
        train_dataset=lm.train_dataset,
        eval_dataset=eval_dataset,
        loss=loss,
        objective=lm.objective,
        eval_objective=getattr(objective, "for_evaluation", objective),  # the model's own loss: scored by rows
        columns=columns,
        collate=with_columns(padded_to_multiple(_either(lm.data_collator, default), args.pad_to_multiple_of), columns),
        eval_collate=eval_collate(eval_labels(padded, args, data_collator, objective), columns),
    )


def lm_batching_for(args: TrainingArguments) -> LMBatching:
    """The arguments' LLM batching settings as the record ``data.llm`` takes (SFT's truncation side, if any)."""
    return LMBatching(
        packing=args.packing,
        packing_strategy=args.packing_strategy,
        padding_free=args.padding_free,
        max_length=args.max_length,
        truncation_mode=getattr(args, "truncation_mode", "keep_start"),  # SFTArguments' field, not HF's
        loss_chunk_size=args.loss_chunk_size,
        label_smoothing_factor=args.label_smoothing_factor,
        prepared=not (getattr(args, "dataset_kwargs", None) or {}).get("skip_prepare_dataset"),
    )


def _either(collate: Any, default: Any) -> Any:
    return collate if collate is not None else default


def warn_about_eval_rows(rows: Any, label_names: Sequence[str] | None, loss_from_rows: bool = True) -> None:
    """Warn when the eval set has no rows, or (``loss_from_rows``) its first row has no label column.

    Evaluation would run and report nothing, or no loss: a silent result the user did not mean.
    """
    if rows is None or isinstance(rows, (Mapping, torch.utils.data.IterableDataset)):
        return
    size = len(rows) if hasattr(rows, "__len__") else None
    if size == 0:
        warnings.warn(
            "eval_dataset is empty (0 rows): every evaluation reports no loss and no metrics; pass the rows to "
            "evaluate on, or eval_dataset=None (and eval_strategy='no')",
            UserWarning,
            stacklevel=4,
        )
        return
    if not loss_from_rows or size is None or not hasattr(rows, "__getitem__"):
        return
    row = rows[0]
    names = list(label_names or ("labels",))
    names += [k for k in HF_LABEL_COLUMNS if "labels" in names]  # renamed to 'labels' by the default collators
    if isinstance(row, Mapping) and not any(k in row for k in names):
        warnings.warn(
            f"eval_dataset[0] has no label column ({names}; its keys: {sorted(row)}): evaluation computes no "
            "eval_loss and compute_metrics gets no label_ids; add the labels to the eval rows, or set label_names "
            "to the column that holds them",
            UserWarning,
            stacklevel=4,
        )
