"""Sample lengths: a dataset's length column, or each item measured once (through arrow when it can).

>>> dataset_lengths([{"input_ids": [1, 2]}, {"input_ids": [3]}])
(2, 1)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, overload

import numpy as np
import torch

__all__ = ["PREFERENCE_COLUMNS", "dataset_lengths", "int_tuple", "item_length", "padded_cost", "preference_length"]


@overload
def int_tuple(values: None) -> None: ...
@overload
def int_tuple(values: Sequence[Any] | np.ndarray) -> tuple[int, ...]: ...
def int_tuple(values: Sequence[Any] | np.ndarray | None) -> tuple[int, ...] | None:
    """Return ``values`` as a tuple of Python ints (``None`` stays ``None``).

    >>> int_tuple(np.array([3, 1]))
    (3, 1)
    """
    if values is None:
        return None
    if isinstance(values, np.ndarray):  # lengths read through arrow: one conversion, not one per item
        return tuple(values.astype(np.int64, copy=False).tolist())
    return tuple(int(v) for v in values)


PREFERENCE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")  # a tokenized DPO row (TRL 1.x's names)


def _size(value: Any) -> int:
    return int(value.shape[-1]) if isinstance(value, torch.Tensor) and value.dim() > 0 else len(value)


def preference_length(item: Any) -> int:
    """Return the length of a preference row as its collated rows see it: prompt + the longer completion.

    >>> preference_length({"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5, 6]})
    5
    """
    return _size(item["prompt_ids"]) + max(_size(item["chosen_ids"]), _size(item["rejected_ids"]))


def item_length(item: Any, key: str, index: int) -> int:
    """Return the length of dataset item ``index``: ``len(item[key])``, or a preference row's length.

    >>> item_length({"input_ids": [1, 2, 3]}, "input_ids", 0)
    3
    """
    if hasattr(item, "keys") and key not in item and all(k in item for k in PREFERENCE_COLUMNS):
        return preference_length(item)
    try:
        value = item[key]
    except (KeyError, TypeError, IndexError) as exc:
        keys = sorted(item.keys()) if hasattr(item, "keys") else type(item).__name__
        raise KeyError(
            f"dataset item {index} has no {key!r} to measure its length (item keys: {keys}); pass "
            f"model_input_name= naming the input to measure, or give the dataset a length column"
        ) from exc
    return _size(value)


def dataset_lengths(
    dataset: Any, length_column_name: str = "length", model_input_name: str = "input_ids"
) -> tuple[int, ...]:
    """Return one length per sample: the dataset's length column, else ``len(item[model_input_name])``.

    The column is used when the dataset exposes ``column_names`` containing
    ``length_column_name`` (a Hugging Face ``datasets.Dataset`` or anything alike). A dataset
    with columns that lacks it gets a warning and the lengths are measured item by item, once
    (a ``datasets.Dataset`` through arrow, without reading its rows). A preference row (DPO's
    ``prompt_ids``, ``chosen_ids``, ``rejected_ids``, no ``model_input_name``) measures
    :func:`preference_length`: prompt + the longer completion.

    >>> dataset_lengths([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    (3, 1)
    >>> dataset_lengths([{"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4]}])
    (3,)
    """
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        if length_column_name in columns:
            read = _arrow_column(dataset, length_column_name)
            if read is not None and read.null_count == 0 and _pa_types().is_integer(read.type):
                return int_tuple(read.to_numpy())
            return tuple(int(n) for n in dataset[length_column_name])
        preference = model_input_name not in columns and all(k in columns for k in PREFERENCE_COLUMNS)
        measured = "prompt + the longer completion" if preference else f"len(item[{model_input_name!r}])"
        warnings.warn(
            f"dataset has no column {length_column_name!r} (columns: {list(columns)}); measuring "
            f"{measured} of every item instead",
            stacklevel=2,
        )
        if preference:
            lengths = _arrow_lengths(dataset, PREFERENCE_COLUMNS)
            if lengths is not None:
                prompt, chosen, rejected = lengths
                return int_tuple(prompt + np.maximum(chosen, rejected))
        lengths = _arrow_lengths(dataset, (model_input_name,)) if model_input_name in columns else None
        if lengths is not None:
            return int_tuple(lengths[0])
    return tuple(item_length(dataset[i], model_input_name, i) for i in range(len(dataset)))


def _arrow_lengths(dataset: Any, names: Sequence[str]) -> list[np.ndarray] | None:
    """Return the list lengths of each column in ``names`` through arrow, or None when one is not a flat list column."""
    reads = [_arrow_column(dataset, name) for name in names]
    if any(r is None or r.null_count or not _flat_list(r.type) for r in reads):
        return None
    import pyarrow.compute as pc

    return [pc.list_value_length(r).to_numpy().astype(np.int64) for r in reads]


def _arrow_column(dataset: Any, name: str) -> Any:
    """Return a ``datasets.Dataset`` column as one arrow array (its row selection applied), or None."""
    with_format = getattr(dataset, "with_format", None)
    if with_format is None:
        return None
    try:
        column = with_format("arrow")[name]
    except Exception:  # not a datasets.Dataset after all: measure item by item
        return None
    return column if hasattr(column, "null_count") and hasattr(column, "type") else None


def _pa_types() -> Any:
    import pyarrow.types

    return pyarrow.types


def _flat_list(arrow_type: Any) -> bool:
    """Say whether a column holds lists of scalars (whose lengths are the item lengths)."""
    types = _pa_types()
    is_list = types.is_list(arrow_type) or types.is_large_list(arrow_type) or types.is_fixed_size_list(arrow_type)
    return is_list and not types.is_nested(arrow_type.value_type)


def padded_cost(micro_batch: Sequence[int], lengths: Sequence[int]) -> int:
    """Return the padded tokens of a micro-batch: its size times its longest length.

    >>> padded_cost([0, 2], [3, 1, 5])
    10
    """
    return len(micro_batch) * max((lengths[i] for i in micro_batch), default=0)
