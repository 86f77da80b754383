"""Bad inputs to ``train``, refused before they reach torch, each with the problem and the fix.

Cheap by design: the call's arguments and the dataset's first row are checked before the run starts, the
first step's batch before its first forward (one ``min``/``max`` of its ``input_ids``), and a custom loss's
result on every call with host-side checks only (type and ``dim``): no step pays a device sync for this.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from trainfold.core.tasks import model_task
from trainfold.trainer.args import GivenArguments, TrainingArguments
from trainfold.trainer.inputs import warn_about_eval_rows
from trainfold.trainer.optimizer import check_optimizer

_log = logging.getLogger(__name__)

__all__ = [
    "check_first_batch",
    "check_not_iterators",
    "check_rows",
    "check_train_call",
    "checked_loss",
    "checking_first",
    "data_to_check",
    "TRAINER_ONLY",
    "refusing_trainer_keywords",
    "trainfold_arguments",
]

# transformers.Trainer's keywords that train/evaluate/predict take another way: name -> what to write instead
TRAINER_ONLY = {
    "tokenizer": "the older name of processing_class; write processing_class=...",
    "optimizers": (
        "the optimizer and its schedule are built from args (optim, learning_rate, lr_scheduler_type ...), "
        "so no torch optimizer object is taken; another optimizer is optimizer=trainfold.optim.from_torch("
        "torch.optim.X, lr=..., ...), its lr a float or a function of the step"
    ),
    "optimizer_cls_and_kwargs": "write optimizer=trainfold.optim.from_torch(cls, **kwargs)",
    "model_init": "build the model and pass it: train(model_init(), args, ...) (there is no hyperparameter search)",
}


_P = ParamSpec("_P")
_R = TypeVar("_R")


def refusing_trainer_keywords(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Wrap ``fn`` to refuse ``transformers.Trainer``'s keywords it takes another way by name, with the fix.

    >>> @refusing_trainer_keywords
    ... def run(model, processing_class=None):
    ...     return model
    >>> try:
    ...     run(1, tokenizer=None)
    ... except TypeError as err:
    ...     print(err)  # doctest: +ELLIPSIS
    run() takes no tokenizer= (a transformers.Trainer keyword): the older name of processing_class; ...
    """

    @functools.wraps(fn)
    def refusing(*positional: _P.args, **kwargs: _P.kwargs) -> _R:
        named = [f"{k}= (a transformers.Trainer keyword): {TRAINER_ONLY[k]}" for k in kwargs if k in TRAINER_ONLY]
        if named:
            raise TypeError(f"{fn.__name__}() takes no " + "; no ".join(named))
        return fn(*positional, **kwargs)

    return refusing


_ROW = "a row is a dict of columns, e.g. {'input_ids': [1, 2, 3], 'labels': [1, 2, 3]}"


def data_to_check(
    train_dataset: Any,
    eval_dataset: Any,
    data_collator: Any,
    train_stream: Any,
    optimizer: Any = None,
    objective: Any = None,
) -> dict[str, Any]:
    """``check_train_call``'s keywords for a ``train`` call: the rows the default collator will read, the optimizer,
    and whether the eval rows' labels give the loss (no ``objective``); a generator as a dataset is refused here.

    >>> data_to_check([{"input_ids": [1]}], None, None, None)
    {'rows': [{'input_ids': [1]}], 'eval_rows': None, 'no_data': False, 'optimizer': None, 'loss_from_rows': True}
    """
    check_not_iterators(train_dataset=train_dataset, eval_dataset=eval_dataset)
    default = data_collator is None
    return {
        "rows": train_dataset if default and train_stream is None else None,
        "eval_rows": eval_dataset if default else None,
        "no_data": train_dataset is None and train_stream is None,
        "optimizer": optimizer,
        "loss_from_rows": objective is None,
    }


def check_train_call(
    model: nn.Module,
    args: TrainingArguments,
    resume_from_checkpoint: Any,
    metrics_from: Callable[..., Any] | None,
    rows: Any = None,
    *,
    eval_rows: Any = None,
    no_data: bool = False,
    optimizer: Any = None,
    loss_from_rows: bool = True,
) -> None:
    """Refuse a model that is not a module or is on ``meta`` (``args`` that are not ``TrainingArguments``:
    ``trainfold_arguments``, before), no data (``no_data``: neither a dataset nor a stream), a
    ``resume_from_checkpoint`` of the wrong type, an ``output_dir`` that is a file, a ``metric_for_best_model``
    no evaluation will produce, and ``rows`` (and ``eval_rows``: one eval set; a dict of named sets is not
    looked into) the default collator cannot read (``check_rows``), and an ``optimizer`` that is a
    ``torch.optim`` object; warn about an empty eval set and (``loss_from_rows``) eval rows without labels.
    ``metrics_from`` is what reports metrics besides the loss: ``compute_metrics``, or an objective (whose aux
    values are metrics too); without one only a ``...loss``
    metric can be tracked.

    >>> try:
    ...     check_train_call(nn.Linear(2, 1), TrainingArguments(output_dir="out"), 123, None)
    ... except TypeError as err:
    ...     print(str(err).split(";")[0])
    resume_from_checkpoint=123 (int) is not a checkpoint
    """
    _check_call_types(model, no_data)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"the model's parameters are on the meta device (no data: {meta[:3]}{' ...' if len(meta) > 3 else ''}); "
            "train needs real weights: load them (from_pretrained without device_map='meta', or "
            "model.to_empty(device=...) then load_state_dict)"
        )
    if not (resume_from_checkpoint is None or isinstance(resume_from_checkpoint, (bool, str, os.PathLike))):
        raise TypeError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} ({type(resume_from_checkpoint).__name__}) is not a "
            "checkpoint; pass True (the latest in output_dir), a checkpoint directory (str or Path), or None"
        )
    if Path(args.output_dir).is_file():
        raise ValueError(f"output_dir={args.output_dir!r} is a file; name a directory (it is created if missing)")
    metric = args.metric_for_best_model  # unread without evaluation, as in HF
    evaluates = getattr(args, "eval_strategy", "no") != "no"
    if metric is not None and evaluates and metrics_from is None and not metric.endswith("loss"):
        raise ValueError(
            f"metric_for_best_model={metric!r}, but without compute_metrics evaluation reports only the loss; pass "
            f"compute_metrics=fn (fn(EvalPrediction) -> {{{metric.removeprefix('eval_')!r}: value}}), "
            "or metric_for_best_model='loss'"
        )
    if rows is not None:
        check_rows(rows, model=model)
        if _size(rows) == 0:
            raise ValueError("train_dataset is empty (0 rows); pass the rows to train on")
    if eval_rows is not None and not isinstance(eval_rows, Mapping):
        check_rows(eval_rows, "eval_dataset", model=model)
    check_optimizer(optimizer)
    warn_about_eval_rows(eval_rows, args.label_names, loss_from_rows)


def _size(rows: Any) -> int | None:
    try:
        return len(rows)
    except TypeError:
        return None  # a stream


def trainfold_arguments(args: GivenArguments) -> TrainingArguments:
    """Return ``args`` as trainfold's ``TrainingArguments``: as given, or a ``transformers.TrainingArguments`` (or a
    TRL config) converted by ``from_hf``, exactly; refuse anything else (a dict...) by name, with the fix.

    ``TrainingArguments.from_hf`` keeps every setting as transformers resolved it and refuses, by name, the ones
    trainfold cannot honour, so taking the HF object is the conversion the user would write.

    >>> try:
    ...     trainfold_arguments({"max_steps": 10})
    ... except TypeError as err:
    ...     print(str(err).split(";")[0])
    args is a dict, not trainfold's TrainingArguments
    """
    if isinstance(args, TrainingArguments):
        return args
    if type(args).__module__.startswith(("transformers.", "trl.")) and dataclasses.is_dataclass(args):
        _log.info("converting %s with trainfold.TrainingArguments.from_hf", type(args).__name__)
        return TrainingArguments.from_hf(args)
    raise TypeError(
        f"args is a {_qualified(type(args))}, not trainfold's TrainingArguments; pass "
        "trainfold.TrainingArguments(**settings) "
        "(or TrainingArguments.from_hf(hf_args) for a transformers.TrainingArguments)"
    )


def check_not_iterators(**datasets: Any) -> None:
    """Refuse a generator or other one-pass iterator as a dataset: it has no length and cannot be read again.

    >>> try:
    ...     check_not_iterators(train_dataset=(r for r in [{"input_ids": [1]}]))
    ... except TypeError as err:
    ...     print(str(err).split(",")[0])
    train_dataset is a generator
    """
    for name, data in datasets.items():
        if isinstance(data, Iterator) and not isinstance(data, torch.utils.data.IterableDataset):
            raise TypeError(
                f"{name} is a {type(data).__name__}, which is read once and has no length, so the sampler can "
                f"neither shuffle it, count its epochs nor resume it; pass {name}=list(rows), or "
                "datasets.Dataset.from_generator(fn) (fn returns a new generator), or a torch.utils.data."
                "IterableDataset (a stream: set max_steps)"
            )


def _check_call_types(model: Any, no_data: bool) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model is a {type(model).__name__}, not a torch.nn.Module; pass the module whose parameters train "
            "(e.g. AutoModelForCausalLM.from_pretrained(...))"
        )
    if no_data:
        raise TypeError("train_dataset is None; pass the rows to train on (a list of dicts or a datasets.Dataset)")


def check_rows(dataset: Any, name: str = "train_dataset", model: nn.Module | None = None) -> None:
    """Refuse a dataset whose first row the default collator cannot read: a dict of columns, a tuple, text, None,
    or one label per row for a ``model`` that predicts every token.

    >>> check_rows([{"input_ids": [1, 2]}])
    >>> try:
    ...     check_rows({"input_ids": [[1, 2]], "labels": [[1, 2]]})
    ... except TypeError as err:
    ...     print(str(err).split(";")[0])
    train_dataset is a dict of columns ['input_ids', 'labels'], not a sequence of rows
    """
    if isinstance(dataset, Mapping):
        columns = list(dataset)
        if hasattr(dataset, "column_names"):  # a datasets.DatasetDict: its splits
            raise TypeError(f"{name} is a DatasetDict of splits {columns}; pass one, e.g. {name}=dataset['train']")
        raise TypeError(
            f"{name} is a dict of columns {columns}, not a sequence of rows; pass "
            "datasets.Dataset.from_dict(columns), or [dict(zip(columns, row)) for row in zip(*columns.values())]"
        )
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return  # a stream: its rows are not read twice
    try:
        if len(dataset) == 0:
            return
    except TypeError:
        return
    row = dataset[0]
    if isinstance(row, Mapping):
        if model is not None:
            _check_row_labels(row, model, name)
        return
    hint = {
        str: "it is text: tokenize it first (dataset.map(lambda r: tokenizer(r['text'])))",
        type(None): "rows are missing",
        tuple: "a (features, label) pair: write it as {'input_ids': features, 'labels': label}",
        list: "a list: name its columns, {'input_ids': [...], 'labels': [...]}",
    }.get(type(row), "give it named columns, or pass a data_collator that reads it")
    raise TypeError(f"{name}[0] is a {type(row).__name__} ({str(row)[:60]!r}): {hint}; {_ROW}")


def _per_token(model: nn.Module) -> bool:
    return model_task(model) in ("causal_lm", "token_classification", "masked_lm")


def _labels_error(model: nn.Module, where: str, shape: Any, ids_shape: Any) -> ValueError:
    return ValueError(
        f"{where} has shape {shape} but {type(model).__name__} predicts every token, so it needs one label per "
        f"token, shaped like input_ids {ids_shape}; for a causal LM the labels are the input_ids themselves "
        "(padding as -100); one class per row needs a ...ForSequenceClassification model"
    )


def _check_row_labels(row: Mapping[str, Any], model: nn.Module, name: str) -> None:
    labels, ids = row.get("labels"), row.get("input_ids")
    if labels is None or ids is None or not _per_token(model):
        return
    scalar = isinstance(labels, (int, float)) or (isinstance(labels, torch.Tensor) and labels.dim() == 0)
    if scalar and not isinstance(ids, (int, float)):
        raise _labels_error(model, f"{name}[0]['labels'] ({labels!r})", "()", f"({len(ids)},)")


def _vocab_size(model: nn.Module) -> int | None:
    embeddings = getattr(model, "get_input_embeddings", None)
    try:
        layer = embeddings() if callable(embeddings) else None
    except (NotImplementedError, AttributeError):
        return None
    return layer.num_embeddings if isinstance(layer, nn.Embedding) else None


def _takes_input_ids(model: nn.Module) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "input_ids" in parameters


def _qualified(kind: type) -> str:
    """Return ``kind``'s name, with its package unless a builtin (``transformers.TrainingArguments``, ``dict``)."""
    package = kind.__module__.split(".")[0]
    return kind.__name__ if package == "builtins" else f"{package}.{kind.__name__}"


def check_first_batch(model: nn.Module, micro_batch: Any, label_key: str = "labels") -> None:
    """Refuse a collated micro-batch the model cannot take: not a dict, no ``input_ids``, ids that are not
    integers or lie outside the vocabulary of a model that embeds them (a module without input embeddings takes
    any ``input_ids``, as transformers.Trainer's float features), one label per row for a model that predicts every
    token.

    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> model = TinyLM(TinyLMConfig(vocab_size=8, d_model=4, n_layers=1, n_heads=1, max_len=4))
    >>> check_first_batch(model, {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([[1, 2]])})
    >>> try:
    ...     check_first_batch(model, {"input_ids": torch.tensor([[1, 9]])})
    ... except ValueError as err:
    ...     print(str(err).split(";")[0])
    input_ids hold ids outside the model's vocabulary of 8 (0..7): min 1, max 9
    """
    if not isinstance(micro_batch, Mapping):
        raise TypeError(
            f"the data collator returned a {type(micro_batch).__name__} ({str(micro_batch)[:60]!r}); a collator "
            "returns a dict of tensors, e.g. {'input_ids': LongTensor, 'attention_mask': ..., 'labels': ...}"
        )
    ids = micro_batch.get("input_ids")
    if ids is None:
        if "inputs_embeds" not in micro_batch and _takes_input_ids(model):
            raise ValueError(
                f"the batch has no 'input_ids' (its keys: {sorted(micro_batch)}), which "
                f"{type(model).__name__}.forward needs; tokenize the rows (dataset.map(tokenizer)), or rename "
                "the column holding the token ids to 'input_ids'"
            )
        return
    if not isinstance(ids, torch.Tensor):
        return
    vocab = _vocab_size(model)  # None: the model embeds no token ids (a custom module's float features are fine)
    if vocab is not None and (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex()):
        raise TypeError(
            f"input_ids are {ids.dtype}, but token ids are integers; convert them (ids.long()), or check that the "
            "column holds token ids (a tokenizer's output), not features or a mask"
        )
    if vocab is not None and ids.numel():
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= vocab:
            raise ValueError(
                f"input_ids hold ids outside the model's vocabulary of {vocab} (0..{vocab - 1}): min {int(low)}, "
                f"max {int(high)}; use the tokenizer the model was trained with, or grow the embeddings "
                "(model.resize_token_embeddings(len(tokenizer)))"
            )
    labels = micro_batch.get(label_key)
    if isinstance(labels, torch.Tensor) and labels.dim() < ids.dim() and _per_token(model):
        raise _labels_error(model, f"the batch's {label_key!r}", tuple(labels.shape), tuple(ids.shape))


def checking_first(batches: Iterable[Any], check: Callable[[Any], None]) -> Iterator[Any]:
    """Yield ``batches`` unchanged after ``check`` has passed on the first micro-batch of the first one."""
    first = True
    for batch in batches:
        if first and len(batch):
            check(batch[0])
            first = False
        yield batch


def checked_loss(loss: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Wrap a custom ``compute_loss_func`` so that a result that is not a 0-d tensor is refused by name.

    >>> checked_loss(lambda outputs, labels, n=None: torch.tensor(2.0))(None, None).item()
    2.0
    >>> try:
    ...     checked_loss(lambda outputs, labels, n=None: 2.0)(None, None)
    ... except TypeError as err:
    ...     print(str(err).split(";")[0])
    compute_loss_func returned a float (2.0), not a tensor
    """

    # a function made by exec() in a namespace without __name__ has __module__ None
    own = ("trainfold.core.", "trainfold.sft.", "trainfold.dpo.", "trainfold.grpo.")
    if not inspect.isfunction(loss) or (loss.__module__ or "").startswith(own):
        return loss  # trainfold's own losses, and loss objects (their methods stay reachable)

    @functools.wraps(loss)
    def checked(*positional: Any, **kwargs: Any) -> Any:
        value = loss(*positional, **kwargs)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"compute_loss_func returned a {type(value).__name__} ({str(value)[:40]}), not a tensor; return "
                "the loss as a 0-d tensor computed from the outputs (torch ops keep the graph; .item() or float() "
                "cut it)"
            )
        if value.dim() != 0:
            raise ValueError(
                f"compute_loss_func returned a tensor of shape {tuple(value.shape)}, not a scalar; reduce it: "
                "the sum over the micro-batch divided by num_items_in_batch (loss.sum() / num_items_in_batch)"
            )
        return value

    return checked
