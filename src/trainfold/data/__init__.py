"""Samplers, collation, the resumable step stream and the DataLoaders; LLM packing.

The modules: ``samplers`` (each epoch's order, a pure function of ``(seed, epoch)``), ``collate``
(padding and keyed collators), ``steps`` (the resumable ``stream`` of StepBatches), ``loaders``
(DataLoader settings and the eval DataLoader), ``columns``, ``packing`` and ``llm``.
"""

from trainfold.data.collate import KeyedCollate, PadCollate, keyed, pad_collate, sample_key
from trainfold.data.loaders import close_loader, eval_loader, loader_errors
from trainfold.data.samplers import (
    LENGTH_STRATEGIES,
    STRATEGIES,
    Sampler,
    dataset_lengths,
    make_sampler,
    padded_cost,
    preference_length,
)
from trainfold.data.steps import StateStream, StepBatch, stream

__all__ = [
    "LENGTH_STRATEGIES",
    "STRATEGIES",
    "KeyedCollate",
    "PadCollate",
    "Sampler",
    "StateStream",
    "StepBatch",
    "close_loader",
    "dataset_lengths",
    "eval_loader",
    "keyed",
    "loader_errors",
    "make_sampler",
    "pad_collate",
    "padded_cost",
    "preference_length",
    "sample_key",
    "stream",
]
