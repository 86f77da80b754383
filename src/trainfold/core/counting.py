"""Counting a step's items (``num_items_in_batch``): the one home of the label counters.

A loss divides its micro-batch's summed loss by the count of items over the whole optimizer step;
it declares how items are counted with a ``count_items(labels) -> Tensor`` attribute, read by
:func:`counter_for` (default :func:`count_labels`: labels that are not -100).

>>> import torch
>>> count_labels(torch.tensor([[5, -100, 7]])).item(), count_shifted_labels(torch.tensor([[5, -100, 7]])).item()
(2, 1)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "IGNORE_INDEX",
    "count_elements",
    "count_labels",
    "count_pairs",
    "count_shifted_labels",
    "counter_for",
    "refuse_unlabelled",
    "sequence_count",
    "warn_no_items",
]

IGNORE_INDEX = -100


def count_labels(labels: Tensor) -> Tensor:
    """Count labels that are not -100.

    >>> import torch
    >>> count_labels(torch.tensor([1, -100, 3])).item()
    2
    """
    return (labels != IGNORE_INDEX).sum()


def count_shifted_labels(labels: Tensor) -> Tensor:
    """Count labels that are not -100 after the causal shift (``labels[..., 1:]``).

    >>> import torch
    >>> count_shifted_labels(torch.tensor([[5, 1, -100]])).item()
    1
    """
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def count_elements(labels: Tensor) -> Tensor:
    """Count every label element (regression and multi-label targets ignore nothing).

    >>> import torch
    >>> count_elements(torch.zeros(2, 3)).item()
    6
    """
    return torch.tensor(labels.numel())


def sequence_count(batch: Mapping[str, Tensor]) -> int:
    """Return how many sequences a batch holds: its rows, or a padding-free row's ``sequence_index`` count.

    >>> import torch
    >>> sequence_count({"input_ids": torch.zeros(1, 5), "sequence_index": torch.tensor([[0, 0, 1, 1, 2]])})
    3
    """
    if "sequence_index" in batch:
        return int(batch["sequence_index"].max()) + 1
    return batch["input_ids"].shape[0]


def count_pairs(micro_batch: Mapping[str, Tensor]) -> Tensor:
    """Count the preference pairs of a collated micro-batch (half its sequences: chosen, then as many rejected).

    >>> import torch
    >>> count_pairs({"input_ids": torch.zeros(6, 3)}).item()
    3
    """
    rows = sequence_count(micro_batch)
    if rows % 2:
        raise ValueError(
            f"a preference micro-batch has {rows} rows; it must hold chosen rows then as many rejected rows"
        )
    return torch.tensor(rows // 2)


def counter_for(loss: Callable[..., Tensor]) -> Callable[[Tensor], Tensor]:
    """Return how ``loss`` counts its items: its ``count_items`` attribute, else ``count_labels``.

    >>> from trainfold.core.losses import causal_lm
    >>> counter_for(causal_lm) is count_shifted_labels
    True
    """
    return getattr(loss, "count_items", count_labels)


def warn_no_items(step: int) -> None:
    """Warn that an optimizer step had no labelled items: it counts, but learns nothing."""
    warnings.warn(
        f"optimizer step {step} had no labels other than -100 (num_items_in_batch == 0): the step counts "
        "(step and data cursor advance) but the parameters and optimizer state are unchanged; its loss is NaN "
        "and state.nonfinite_losses counts it. Check the collator's padding and label masking",
        RuntimeWarning,
        stacklevel=3,
    )


def refuse_unlabelled(dataset: Any, loss: Callable[..., Tensor], label_key: str = "labels") -> None:
    """Raise ``ValueError`` when every row of a map-style ``dataset`` has no item ``loss`` would count.

    Rows are read in order until one has a label the loss counts (usually the first); datasets
    without ``__len__``/``__getitem__``, or rows without ``label_key``, cannot be judged and pass.

    >>> from trainfold.core.losses import causal_lm
    >>> refuse_unlabelled([{"labels": [-100, 4, 5]}], causal_lm) is None
    True
    >>> refuse_unlabelled([{"labels": [4, -100]}], causal_lm)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: every one of the 1 rows of train_dataset has no 'labels' that causal_lm counts (all -100, ...
    """
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return
    count = counter_for(loss)
    n = len(dataset)
    for i in range(n):
        row = dataset[i]
        if not isinstance(row, Mapping) or label_key not in row:
            return
        try:
            if int(count(torch.as_tensor(row[label_key]))) > 0:
                return
        except (TypeError, ValueError, RuntimeError):  # labels of a form only the collator understands
            return
    if n == 0:
        return
    causal = count is count_shifted_labels
    shifted = " (all -100, or only the first token, which a causal LM never predicts)" if causal else " (all -100)"
    raise ValueError(
        f"every one of the {n} rows of train_dataset has no {label_key!r} that {getattr(loss, '__name__', 'the loss')} "
        f"counts{shifted}: every step would learn nothing. Check the label masking (e.g. a completion mask that "
        "covers the whole row), or pass labels"
    )
