"""The collator of unpaired preference rows (TRL 1.16's ``DataCollatorForUnpairedPreference``).

Each row becomes ``prompt + completion`` right-padded (``input_ids``, ``attention_mask``, and a
``completion_mask`` that is 1 on completion tokens only), truncated to ``max_length`` before padding;
rows with ``KL_completion_ids`` give the same three for ``prompt + KL completion`` under ``KL_``
names; ``label`` is a bool tensor, and precomputed ``ref_logps``/``ref_KL_logps`` pass on as floats.

>>> b = UnpairedCollate(pad_token_id=0)([{"prompt_ids": [1, 2], "completion_ids": [4, 5], "KL_completion_ids": [6],
...                                        "label": True}, {"prompt_ids": [7], "completion_ids": [9], "label": False,
...                                        "KL_completion_ids": [4, 5]}])
>>> b["input_ids"].tolist(), b["completion_mask"].tolist(), b["KL_input_ids"].tolist(), b["label"].tolist()
([[1, 2, 4, 5], [7, 9, 0, 0]], [[0, 0, 1, 1], [0, 1, 0, 0]], [[1, 2, 6], [7, 4, 5]], [True, False])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.data.collate import check_completion_padding
from trainfold.data.rows import check_items
from trainfold.kto.rows import KL_COLUMN, UNPAIRED_COLUMNS

__all__ = ["REF_COLUMNS", "UnpairedCollate", "unpaired_collate"]

REF_COLUMNS = ("ref_logps", "ref_KL_logps")  # precomputed reference log-probs (TRL's names)


def _padded(rows: list[list[int]], value: int, multiple: int | None) -> Tensor:
    width = max(len(r) for r in rows)
    if multiple:
        width = -(-width // multiple) * multiple
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _unpaired_fix(item: Mapping[str, Any]) -> str:
    return "prepare the rows with trainfold.kto.unpaired_rows (or give prompt_ids, completion_ids and label)"


@attrs.frozen
class UnpairedCollate:
    """Collate unpaired rows into one batch (see the module doc); make one with :func:`unpaired_collate`."""

    columns = (*UNPAIRED_COLUMNS, KL_COLUMN, *REF_COLUMNS)  # the row columns it reads: remove_unused_columns keeps them
    pad_token_id: int = 0
    max_length: int | None = None
    pad_to_multiple_of: int | None = None

    def _side(self, items: Sequence[Mapping[str, Any]], key: str, prefix: str) -> dict[str, Tensor]:
        ids, masks = [], []
        for it in items:
            prompt, completion = list(it["prompt_ids"]), list(it[key])
            full, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
            if self.max_length is not None:
                full, mask = full[: self.max_length], mask[: self.max_length]
            ids.append(full)
            masks.append(mask)
        return {
            f"{prefix}input_ids": _padded(ids, self.pad_token_id, self.pad_to_multiple_of),
            f"{prefix}attention_mask": _padded([[1] * len(r) for r in ids], 0, self.pad_to_multiple_of),
            f"{prefix}completion_mask": _padded(masks, 0, self.pad_to_multiple_of),
        }

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        check_items(items, UNPAIRED_COLUMNS, "unpaired row", _unpaired_fix)
        out = self._side(items, "completion_ids", "")
        if KL_COLUMN in items[0]:
            out |= self._side(items, KL_COLUMN, "KL_")
        for k in REF_COLUMNS:
            if k in items[0]:
                out[k] = torch.tensor([float(it[k]) for it in items], dtype=torch.float32)
        out["label"] = torch.tensor([bool(it["label"]) for it in items])
        return out


def unpaired_collate(
    pad_token_id: int = 0, max_length: int | None = None, pad_to_multiple_of: int | None = None
) -> UnpairedCollate:
    """Return a collator of unpaired rows (``max_length`` keeps the start; ``pad_to_multiple_of`` rounds widths up).

    >>> unpaired_collate(0, pad_to_multiple_of=4)([{"prompt_ids": [1], "completion_ids": [5], "label": 1}])[
    ...     "input_ids"].tolist()
    [[1, 5, 0, 0]]
    """
    check_completion_padding(max_length, pad_to_multiple_of)
    return UnpairedCollate(pad_token_id=pad_token_id, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of)
