"""The plumbing the TRL runs share (``trainfold.sft/dpo/kto/reward.train``): their Arguments checked, a stream prepared.

>>> from trainfold.trainer.args import TrainingArguments
>>> check_arguments(TrainingArguments(bf16=False), TrainingArguments, "sft") is None
True
>>> list(PreparedStream([{"x": 1}, {"x": 2}], lambda rows: [{"y": row["x"] * 10} for row in rows]))
[{'y': 10}, {'y': 20}]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from trainfold.trainer.args import TrainingArguments

__all__ = ["PreparedStream", "check_arguments"]


def check_arguments(args: object, expected: type[TrainingArguments], package: str) -> None:
    """Refuse ``args`` unless it is an ``expected`` (the Arguments of ``trainfold.<package>.train``), naming the fix."""
    if not isinstance(args, expected):
        config = expected.__name__.replace("Arguments", "Config")
        raise TypeError(
            f"trainfold.{package}.train takes {expected.__name__} (TRL's {config} names), not {type(args).__name__}; "
            f"convert a trl.{config} with {expected.__name__}.from_hf(config)"
        )


class PreparedStream(torch.utils.data.IterableDataset):
    """A dataset without a length (``datasets.IterableDataset``, streaming) prepared row by row as it is read."""

    def __init__(
        self, rows: Iterable[Mapping[str, Any]], prepare: Callable[[list[Mapping[str, Any]]], Iterable[Any]]
    ) -> None:
        self.rows, self.prepare = rows, prepare

    def __iter__(self) -> Iterator[Any]:
        for row in self.rows:
            yield from self.prepare([row])
