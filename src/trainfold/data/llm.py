"""The LLM settings of ``TrainingArguments`` as one value: packing, padding-free batches, chunked loss.

``lm_inputs(model, args, ...)`` returns the training dataset, collator and objective those
settings ask for (TRL's names: ``packing``, ``packing_strategy``, ``max_length``, ``padding_free``;
trainfold's ``loss_chunk_size``), or the inputs unchanged when none is set. Every combination it
cannot do exactly is refused by name before any work is done.

>>> from trainfold.hf.args import TrainingArguments
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> rows = [{"input_ids": [1, 2, 3]}]
>>> lm_inputs(model, TrainingArguments(), rows, None, None, None).train_dataset is rows
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from torch import nn

from trainfold.core.chunked_loss import chunked_causal_lm
from trainfold.core.losses import causal_lm, default_loss_for
from trainfold.data.packing import check_packable, pack, packed_collate, padding_free_collate

__all__ = ["DEFAULT_MAX_LENGTH", "LMInputs", "lm_inputs"]

DEFAULT_MAX_LENGTH = 1024  # TRL's SFTConfig.max_length


@attrs.frozen(eq=False)
class LMInputs:
    """What ``train`` trains on: the (packed) dataset, the collator and the objective."""

    train_dataset: Any
    data_collator: Callable[..., Any] | None
    objective: Callable[..., Any] | None


def _refusals(
    model: nn.Module, args: Any, train_dataset: Any, data_collator: Any, compute_loss_func: Any, objective: Any
) -> list[str]:
    out = []
    if (args.packing or args.padding_free) and data_collator is not None:
        out.append(
            f"{'packing=True' if args.packing else 'padding_free=True'} builds its own batches (positions restart "
            "at each document); "
            "drop data_collator, or set packing=False and padding_free=False"
        )
    if args.packing and not (hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")):
        out.append(
            "packing=True packs the whole dataset before training, so it needs a map-style dataset "
            f"(with __len__), not {type(train_dataset).__name__}; use padding_free=True for a stream"
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


def lm_inputs(
    model: nn.Module,
    args: Any,
    train_dataset: Any,
    data_collator: Callable[..., Any] | None,
    compute_loss_func: Callable[..., Any] | None,
    objective: Callable[..., Any] | None,
) -> LMInputs:
    """Return the dataset, collator and objective that ``args``' packing and chunked-loss settings ask for."""
    if not (args.packing or args.padding_free or args.loss_chunk_size):
        return LMInputs(train_dataset, data_collator, objective)
    problems = _refusals(model, args, train_dataset, data_collator, compute_loss_func, objective)
    if problems:
        raise ValueError("cannot train with these settings:\n  - " + "\n  - ".join(problems))
    if args.packing or args.padding_free:
        check_packable(model)
    if args.packing:
        rows = (train_dataset[i] for i in range(len(train_dataset)))
        train_dataset = pack(rows, args.max_length or DEFAULT_MAX_LENGTH, truncate=args.packing_strategy == "bfd")
    if args.padding_free:
        data_collator = padding_free_collate()
    elif args.packing:
        data_collator = packed_collate()
    if args.loss_chunk_size:
        objective = chunked_causal_lm(model, args.loss_chunk_size, args.label_smoothing_factor)
    return LMInputs(train_dataset, data_collator, objective)
