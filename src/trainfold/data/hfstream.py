"""A ``datasets.IterableDataset`` read from files, read by :func:`~trainfold.data.files` instead: exact resumes.

``datasets.load_dataset("parquet", data_files=..., streaming=True)`` (also ``"arrow"`` and ``"json"`` for
JSON Lines) streams the files in order; resuming it means reading again up to the stopping point.
:func:`as_source` recognises such a dataset, one not shuffled, mapped, filtered, formatted or split by
node, and returns ``files(its files, shuffle=False)``: the same rows in the same order, whose position
is part of the cursor, so a resume seeks (O(one row group)) and is independent of the world size.
Any other dataset is returned as it is (``train`` then reads it as a dataset without a length).

>>> import datasets, pyarrow as pa, pyarrow.parquet as pq, tempfile
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"id": list(range(6))}), f"{d}/part-0.parquet", row_group_size=2)
>>> ds = datasets.load_dataset("parquet", data_files=f"{d}/*.parquet", split="train", streaming=True)
>>> src = as_source(ds)
>>> type(src).__name__, [r["id"] for _, r in zip(range(6), (row for _, row in src.rows(0)))] == [r["id"] for r in ds]
('FileSource', True)
>>> shuffled = ds.shuffle(seed=0, buffer_size=4)
>>> as_source(shuffled) is shuffled  # datasets' shuffle buffer: read by datasets, as given
True
"""

from __future__ import annotations

import os
from typing import Any

from trainfold.data.filestream import files

__all__ = ["as_source", "iterable_files"]

_BUILDERS = {"parquet": (".parquet",), "arrow": (".arrow",), "json": (".jsonl", ".json")}


def iterable_files(dataset: Any) -> list[str] | None:
    """The files a bare ``datasets.IterableDataset`` reads in order, or ``None`` when it is not one read as is."""
    ex = getattr(dataset, "_ex_iterable", None)
    if ex is None or type(ex).__name__ != "ArrowExamplesIterable" or not hasattr(ex, "kwargs"):
        return None  # shuffled, mapped, filtered, ... (a wrapping examples iterable), or not a datasets stream
    kwargs, info = ex.kwargs, getattr(dataset, "info", None)
    builder = getattr(info, "builder_name", None)
    paths = kwargs.get("files")
    if builder not in _BUILDERS or not isinstance(paths, list) or set(kwargs) - {"files", "row_groups_list"}:
        return None
    if any(g is not None for g in kwargs.get("row_groups_list") or []):
        return None  # datasets already split the row groups (between shards of its own)
    if getattr(dataset, "_formatting", None) is not None or getattr(dataset, "_distributed", None) is not None:
        return None
    names = [str(p) for p in paths]
    if not names or not all(os.path.isfile(p) and p.lower().endswith(_BUILDERS[builder]) for p in names):
        return None  # a remote file, a compressed one, an extension of another kind
    return names


def as_source(dataset: Any) -> Any:
    """Return ``files(...)`` over a bare file-backed ``datasets.IterableDataset``'s files in order; else ``dataset``."""
    paths = iterable_files(dataset)
    if paths is None:
        return dataset
    features = getattr(getattr(dataset, "info", None), "features", None)
    columns = None if features is None else list(features)
    return files(paths, shuffle=False, columns=columns)
