"""Samplers, collation, the resumable step stream and the DataLoaders; LLM packing.

The modules: ``samplers`` (each epoch's order, a pure function of ``(seed, epoch)``), ``collate``
(padding and keyed collators), ``steps`` (the resumable ``stream`` of StepBatches), ``loaders``
(DataLoader settings and the eval DataLoader), ``columns``, ``packing`` and ``llm``; ``filestream``
(``files``: streaming sources over sharded Parquet / Arrow / JSON Lines files) and ``mixture`` (``mix`` and
``source_stream``, the resumable step stream over a source), ``packstream`` (``packed``: packing a source in fixed
windows before its global batches are dealt).
"""

from trainfold.data.collate import KeyedCollate, PadCollate, keyed, pad_collate, sample_key
from trainfold.data.filestream import ShardChangedError, files, is_source
from trainfold.data.hfstream import as_source
from trainfold.data.loaders import close_loader, eval_loader, loader_errors
from trainfold.data.mixture import (
    Mixture,
    SourceData,
    is_stream_source,
    mix,
    source_data,
    source_steps,
    source_stream,
    stream_cursor,
)
from trainfold.data.packstream import Packed, packed
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
    "Mixture",
    "Packed",
    "ShardChangedError",
    "PadCollate",
    "Sampler",
    "StateStream",
    "StepBatch",
    "as_source",
    "close_loader",
    "dataset_lengths",
    "eval_loader",
    "files",
    "is_source",
    "is_stream_source",
    "keyed",
    "loader_errors",
    "make_sampler",
    "mix",
    "pad_collate",
    "packed",
    "padded_cost",
    "preference_length",
    "sample_key",
    "SourceData",
    "source_data",
    "source_steps",
    "source_stream",
    "stream",
    "stream_cursor",
]
