"""Packing and padding-free batches: many documents in one row, with exact loss counts.

Padding costs compute; putting several documents in one row saves it, but only stays exact when
each document sees only itself and its loss counts only its own targets. Three rules do that:

- ``position_ids`` restart at 0 at every document, and no ``attention_mask`` is passed: Hugging Face
  models (transformers 5) then confine attention to each document (``masking_utils`` finds the
  document boundaries from the positions, for sdpa, eager and flash attention alike). The KV cache
  must be off for that: the step and evaluation run with ``use_cache=False`` (``core.forward.cache_off``),
  as TRL's ``compute_loss`` passes it, so batches hold only TRL's keys;
- each document's first label is -100: after the causal shift the last token of one document would
  otherwise be trained to predict the first token of the next;
- padding, where a batch needs it, is a document of its own (positions from 0, labels -100).

So a packed step counts exactly the targets of the unpacked step (``num_items_in_batch`` included)
and its gradient equals the unpacked step's on the same documents.

``pack(rows, max_length)`` packs a dataset up front, as TRL's ``pack_dataset(strategy="bfd")`` does
(best-fit decreasing over windows of 1000 rows, longer rows truncated, or split with
``truncate=False``), into a new list of rows, so the sampler, the stream and the resume cursor work
on packed rows unchanged: resuming a packed run is bitwise like any other. ``packed_collate()``
batches packed rows; ``padding_free_collate()`` packs each micro-batch into one row (TRL's
``padding_free=True``, transformers' ``DataCollatorWithFlattening``).

>>> rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6]}]
>>> packed = pack(rows, max_length=4)
>>> [r["input_ids"] for r in packed], [r["position_ids"] for r in packed]
([[1, 2, 3, 6], [4, 5]], [[0, 1, 2, 0], [0, 1]])
>>> packed[0]["labels"]              # the first token of each document is no target
[-100, 2, 3, -100]
"""

from __future__ import annotations

import bisect
import collections
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.losses import IGNORE_INDEX

__all__ = ["PACKING_WINDOW", "pack", "packed_collate", "padding_free_collate", "check_packable"]

PACKING_WINDOW = 1000  # rows packed together: TRL packs each batch of datasets' map (1000 rows) on its own


def _as_list(value: Any) -> list[Any]:
    return value.tolist() if isinstance(value, Tensor) else list(value)


def _document(row: Mapping[str, Any], index: int, input_key: str) -> dict[str, list[Any]]:
    """Return the row's token columns (lists as long as ``input_key``); refuse what cannot be packed exactly."""
    if input_key not in row:
        raise KeyError(f"row {index} has no {input_key!r} to pack (keys: {sorted(row)}); pass input_key=")
    ids = _as_list(row[input_key])
    doc = {input_key: ids}
    for key, value in row.items():
        if key == input_key or isinstance(value, (str, bytes, int, float)) or value is None:
            continue  # text, length and other per-row values do not survive packing
        values = _as_list(value)
        if len(values) != len(ids):
            raise ValueError(
                f"row {index}: column {key!r} has {len(values)} entries but {input_key!r} has {len(ids)}; "
                "packing concatenates per-token columns, so drop or fix it first"
            )
        doc[key] = values
    mask = doc.pop("attention_mask", None)
    if mask is not None and not all(mask):
        raise ValueError(
            f"row {index} has padding inside (attention_mask has zeros): packing would attend to it; pack unpadded rows"
        )
    if "position_ids" in doc:
        raise ValueError(f"row {index} already has position_ids: it is packed already")
    doc.setdefault("labels", list(ids))
    return doc


def _cut(doc: dict[str, list[Any]], max_length: int, truncate: bool) -> list[dict[str, list[Any]]]:
    n = len(next(iter(doc.values())))
    if n <= max_length:
        return [doc]
    if truncate:
        return [{k: v[:max_length] for k, v in doc.items()}]
    return [{k: v[i : i + max_length] for k, v in doc.items()} for i in range(0, n, max_length)]


def _best_fit_decreasing(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Return bins of indices: longest first, each into the fullest bin it fits (first such bin on ties)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep row order
    spaces: list[int] = []  # the distinct free spaces of open bins, ascending
    holders: dict[int, collections.deque[list[int]]] = collections.defaultdict(collections.deque)
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(spaces, n)
        if at < len(spaces):
            space = spaces[at]
            chosen = holders[space].popleft()
            if not holders[space]:
                del spaces[at]
        else:
            space, chosen = max_length, []
            bins.append(chosen)
        chosen.append(i)
        left = space - n
        if left > 0:
            if not holders[left]:
                bisect.insort(spaces, left)
            holders[left].append(chosen)
    return bins


def _join(docs: Sequence[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """Concatenate documents into one row: positions restart, each first label is -100."""
    keys = list(docs[0])
    if any(list(d) != keys for d in docs):
        raise ValueError(f"rows to pack have different columns: {sorted({tuple(d) for d in docs})}")
    row: dict[str, list[Any]] = {k: [] for k in keys}
    row["position_ids"] = []
    for d in docs:
        n = len(d[keys[0]])
        for k in keys:
            row[k].extend(d[k])
        row["labels"][len(row["labels"]) - n] = IGNORE_INDEX
        row["position_ids"].extend(range(n))
    return row


def pack(
    rows: Iterable[Mapping[str, Any]],
    max_length: int,
    *,
    window: int = PACKING_WINDOW,
    truncate: bool = True,
    input_key: str = "input_ids",
) -> list[dict[str, list[Any]]]:
    """Pack ``rows`` into rows of at most ``max_length`` tokens (TRL's ``pack_dataset``, strategy ``bfd``).

    Each window of ``window`` rows is packed by best-fit decreasing; a row longer than
    ``max_length`` is truncated (``truncate=False``: split into pieces, TRL's ``bfd_split``); empty
    rows are dropped. Per-token columns (``input_ids``, ``labels``, ...) are concatenated; ``labels``
    default to the inputs; each packed row gets ``position_ids`` restarting at each document, and
    each document's first label becomes -100. Per-row values (``text``, ``length``) are dropped, and
    ``attention_mask`` (all ones) is replaced by the positions.

    >>> rows = [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7]}, {"input_ids": [8, 9, 10]}, {"input_ids": [11]}]
    >>> [r["input_ids"] for r in pack(rows, 4)]                 # the example of TRL's pack_dataset
    [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]]
    >>> [r["input_ids"] for r in pack(rows, 4, truncate=False)]
    [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]]
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int (tokens per packed row), got {max_length!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (rows packed together), got {window!r}")
    out: list[dict[str, list[Any]]] = []
    buffer: list[Mapping[str, Any]] = []
    start = 0

    def flush() -> None:
        docs = []
        for i, row in enumerate(buffer):
            doc = _document(row, start + i, input_key)
            if doc[input_key]:
                docs.extend(_cut(doc, max_length, truncate))
        for b in _best_fit_decreasing([len(d[input_key]) for d in docs], max_length):
            out.append(_join([docs[i] for i in b]))

    for row in rows:
        buffer.append(row)
        if len(buffer) == window:
            flush()
            start += window
            buffer = []
    if buffer:
        flush()
    return out


def _pad_tail(row: dict[str, list[Any]], length: int, pad_token_id: int, input_key: str) -> dict[str, list[Any]]:
    """Pad a packed row to ``length`` with a document of its own that has no targets."""
    extra = length - len(row[input_key])
    if extra == 0:
        return row
    pads = {input_key: pad_token_id, "labels": IGNORE_INDEX}
    out = {k: v + [pads.get(k, 0)] * extra for k, v in row.items() if k != "position_ids"}
    out["position_ids"] = row["position_ids"] + list(range(extra))
    return out


def _tensors(rows: Sequence[dict[str, list[Any]]]) -> dict[str, Any]:
    return {k: torch.tensor([r[k] for r in rows], dtype=torch.long) for k in rows[0]}


def _flattened(row: dict[str, list[Any]]) -> dict[str, Any]:
    """Return one flattened row as TRL's padding-free collator does: with the documents' boundaries for the
    varlen kernels (``cu_seq_lens_q``/``_k``, int32), the longest document (``max_length_q``/``_k``) and each
    token's document (``seq_idx``, int32)."""
    batch = _tensors([row])
    starts = batch["position_ids"][0] == 0
    bounds = torch.cat([starts.nonzero().flatten(), torch.tensor([starts.numel()])]).to(torch.int32)
    longest = int(bounds.diff().max())
    batch.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)
    batch["seq_idx"] = (starts.cumsum(0) - 1).to(torch.int32)[None]
    return batch


@attrs.frozen
class PackedCollate:
    """Batch packed rows (from :func:`pack`): pad each to the longest, the padding a document of its own."""

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    input_key: str = "input_ids"

    def __call__(self, items: list[Mapping[str, Any]]) -> dict[str, Any]:
        rows = [{k: _as_list(v) for k, v in item.items() if not isinstance(v, (str, int, float))} for item in items]
        for i, row in enumerate(rows):
            if "position_ids" not in row:
                raise KeyError(
                    f"item {i} has no position_ids: packed_collate batches rows made by pack(); "
                    "use padding_free_collate() for unpacked rows"
                )
        longest = max(len(r[self.input_key]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return _tensors([_pad_tail(r, longest, self.pad_token_id, self.input_key) for r in rows])


def packed_collate(pad_token_id: int = 0, pad_to_multiple_of: int | None = None) -> PackedCollate:
    """Return the collator for packed rows: ``input_ids``, ``labels``, ``position_ids``, no attention mask.

    >>> c = packed_collate()
    >>> out = c(pack([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}], max_length=3))
    >>> out["input_ids"].tolist(), out["position_ids"].tolist(), out["labels"].tolist()
    ([[1, 2, 3], [4, 5, 0]], [[0, 1, 2], [0, 1, 0]], [[-100, 2, 3], [-100, 5, -100]])
    """
    if pad_to_multiple_of is not None and pad_to_multiple_of <= 0:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be a positive int or None")
    return PackedCollate(pad_token_id, pad_to_multiple_of)


@attrs.frozen
class PaddingFreeCollate:
    """Concatenate a micro-batch's rows into one row with restarting positions: no padding at all."""

    input_key: str = "input_ids"

    def __call__(self, items: list[Mapping[str, Any]]) -> dict[str, Any]:
        if items and all("position_ids" in item for item in items):  # packed rows: documents already marked
            rows = [{k: _as_list(v) for k, v in it.items() if not isinstance(v, (str, int, float))} for it in items]
            return _flattened({k: [x for r in rows for x in r[k]] for k in rows[0]})
        docs = [_document(item, i, self.input_key) for i, item in enumerate(items)]
        docs = [d for d in docs if d[self.input_key]]
        if not docs:
            raise ValueError("every row of this micro-batch is empty: nothing to train on")
        return _flattened(_join(docs))


def padding_free_collate() -> PaddingFreeCollate:
    """Return the padding-free collator (TRL's ``padding_free=True``): each micro-batch becomes one row.

    The keys are TRL's ``DataCollatorForLanguageModeling(padding_free=True)``'s (and any other per-token column).

    >>> out = padding_free_collate()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    >>> out["input_ids"].tolist(), out["position_ids"].tolist(), out["labels"].tolist()
    ([[1, 2, 3, 4, 5]], [[0, 1, 2, 0, 1]], [[-100, 2, 3, -100, 5]])
    >>> out["cu_seq_lens_q"].tolist(), out["max_length_k"], out["seq_idx"].tolist()
    ([0, 3, 5], 3, [[0, 0, 0, 1, 1]])
    """
    return PaddingFreeCollate()


def check_packable(model: nn.Module) -> None:
    """Raise ``ValueError`` unless ``model`` can keep packed documents apart (its forward takes ``position_ids``).

    >>> import torch
    >>> check_packable(torch.nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    ValueError: packing needs a model whose forward takes position_ids (a transformers causal LM), so that \
attention stays within each document; Linear.forward takes ['input']: train without packing/padding_free
    """
    params = inspect.signature(model.forward).parameters
    base = getattr(model, "get_base_model", None)  # a peft model passes position_ids to its base through **kwargs
    if base is not None and "position_ids" not in params:
        params = inspect.signature(base().forward).parameters
    if "position_ids" not in params:
        raise ValueError(
            "packing needs a model whose forward takes position_ids (a transformers causal LM), so that attention "
            f"stays within each document; {type(model).__name__}.forward takes {list(params)}: "
            "train without packing/padding_free"
        )
