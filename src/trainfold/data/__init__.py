"""Samplers, collation and the resumable batch stream; LLM packing."""

from trainfold.data.pipeline import (
    KeyedCollate,
    PadCollate,
    StateStream,
    StepBatch,
    close_loader,
    eval_loader,
    generation_batches,
    keyed,
    pad_collate,
    sample_key,
    stream,
)

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
