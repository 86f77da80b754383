"""Reward-modelling rows as TRL 1.16 ``RewardTrainer`` prepares them, and its preference collator.

A row is a preference: ``chosen`` and ``rejected`` texts (implicit prompt), or with a ``prompt`` that
both continue (explicit prompt), as strings or message lists (conversational), optionally with a
``margin``. Text rows get the EOS token appended where they lack it; conversational ones are
rendered by the tokenizer's chat template. Rows already tokenized (``chosen_ids``/``rejected_ids``)
are used as they are. Pairs with either side longer than ``max_length`` are dropped.

>>> collate = reward_collate(pad_id=0)
>>> batch = collate([{"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5], "margin": 0.5},
...                  {"chosen_ids": [6, 7], "rejected_ids": [8], "margin": 0.0}])
>>> batch["input_ids"].tolist(), batch["attention_mask"][3].tolist(), batch["margin"].tolist()
([[1, 2, 3], [6, 7, 0], [4, 5, 0], [8, 0, 0]], [1, 0, 0], [0.5, 0.0])
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

__all__ = [
    "REWARD_COLUMNS",
    "RewardCollate",
    "is_preference_conversational",
    "reward_collate",
    "reward_row",
    "reward_rows",
]

REWARD_COLUMNS = ("chosen_ids", "rejected_ids", "margin")  # what the collator reads (TRL's signature columns)


def is_preference_conversational(row: Mapping[str, Any]) -> bool:
    """Return whether ``row``'s texts are message lists, as TRL's ``is_conversational`` decides.

    >>> messages = [{"role": "user", "content": "hi"}]
    >>> is_preference_conversational({"chosen": messages}), is_preference_conversational({"chosen": "hi"})
    (True, False)
    """
    for key in ("prompt", "chosen", "rejected", "messages", "completion"):
        value = row.get(key)
        if isinstance(value, list) and value and isinstance(value[0], Mapping) and "role" in value[0]:
            return True
    return False


def _ids(tokenizer: Any, value: Any, tools: Any, template_kwargs: Mapping[str, Any]) -> list[int]:
    if isinstance(value, list):  # messages: the chat template renders them
        out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, tools=tools, **template_kwargs)
        return list(out["input_ids"])
    return list(tokenizer(text=value)["input_ids"])


def reward_row(row: Mapping[str, Any], tokenizer: Any, eos_token: str | None = None) -> dict[str, Any]:
    """Return ``row`` tokenized as ``RewardTrainer._prepare_dataset`` does: ``chosen_ids``, ``rejected_ids`` (and
    ``margin`` when the row has one); ``eos_token`` (default: the tokenizer's) ends each text that lacks it."""
    row = dict(row)
    if "chosen_ids" in row and "rejected_ids" in row:
        return row
    if not is_preference_conversational(row):
        eos = eos_token if eos_token is not None else tokenizer.eos_token
        row = {
            **row,
            **{k: row[k] if row[k].endswith(eos) else row[k] + eos for k in ("chosen", "rejected") if k in row},
        }
    tools = json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")
    template_kwargs = row.get("chat_template_kwargs") or {}
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row:  # explicit prompt: both continue it
        chosen, rejected = row["prompt"] + chosen, row["prompt"] + rejected
    out = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
    out["chosen_ids"] = _ids(tokenizer, chosen, tools, template_kwargs)
    out["rejected_ids"] = _ids(tokenizer, rejected, tools, template_kwargs)
    return out


def reward_rows(
    rows: Iterable[Mapping[str, Any]], tokenizer: Any, max_length: int | None = None, eos_token: str | None = None
) -> list[dict[str, Any]]:
    """Return ``rows`` tokenized (``reward_row``), without the pairs where a side is over ``max_length`` tokens."""
    out = [reward_row(r, tokenizer, eos_token) for r in rows]
    if max_length is None:
        return out
    return [r for r in out if len(r["chosen_ids"]) <= max_length and len(r["rejected_ids"]) <= max_length]


def _padded(rows: Sequence[torch.Tensor], value: int, multiple: int | None) -> torch.Tensor:
    width = max(len(r) for r in rows)
    if multiple:
        width = -(-width // multiple) * multiple
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@attrs.frozen
class RewardCollate:
    """TRL's ``DataCollatorForPreference`` (reward): chosen rows, then rejected rows, right-padded; ``margin``."""

    pad_id: int
    pad_to_multiple_of: int | None = None
    columns = REWARD_COLUMNS

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(i["chosen_ids"], dtype=torch.long) for i in items]
        ids += [torch.as_tensor(i["rejected_ids"], dtype=torch.long) for i in items]
        batch = {
            "input_ids": _padded(ids, self.pad_id, self.pad_to_multiple_of),
            "attention_mask": _padded([torch.ones_like(i) for i in ids], 0, self.pad_to_multiple_of),
        }
        if "margin" in items[0]:
            batch["margin"] = torch.tensor([float(i["margin"]) for i in items], dtype=torch.float)
        return batch


def reward_collate(pad_id: int, pad_to_multiple_of: int | None = None) -> RewardCollate:
    """Return the collator of preference rows for a reward model (see ``RewardCollate``)."""
    return RewardCollate(pad_id, pad_to_multiple_of)
