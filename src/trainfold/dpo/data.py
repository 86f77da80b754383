"""Preference rows of text or conversations to token ids, as TRL 1.16's ``DPOTrainer`` prepares them.

:func:`preference_row` turns ``{"prompt", "chosen", "rejected"}`` (strings, or message lists through the
tokenizer's chat template) into ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``: EOS appended to
text completions, the prompt's length the shorter common prefix of the tokenized prompt with each
tokenized ``prompt + completion`` (so a token merge at the boundary goes to the completion).
:func:`preference_rows` prepares a dataset, dropping rows whose prompt alone fills ``max_length``.

>>> preference_rows([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]}], max_length=2)
[]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.data.lengths import PREFERENCE_COLUMNS
from trainfold.data.rows import common_prefix, implicit_prompt, is_conversational
from trainfold.dpo.logps import REF_KEYS
from trainfold.dpo.objective import PreferenceCollate

__all__ = [
    "PaddingFreePreferenceCollate",
    "padding_free_preference_collate",
    "preference_row",
    "preference_rows",
]


def preference_row(row: Mapping[str, Any], tokenizer: Any = None) -> dict[str, list[int]]:
    """Return one preference row's ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` (TRL's tokenization).

    Rows that already hold those columns come back as they are.

    >>> preference_row({"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "score": 0.5})
    {'prompt_ids': [1], 'chosen_ids': [2], 'rejected_ids': [3]}
    """
    if all(k in row for k in PREFERENCE_COLUMNS):
        return {k: list(row[k]) for k in PREFERENCE_COLUMNS}
    if "prompt" not in row and "chosen" in row and "rejected" in row:
        row = {**row, **implicit_prompt(row["chosen"], row["rejected"])}
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        raise KeyError(
            f"preference row lacks {missing} (has {sorted(row)}): give prompt, chosen and rejected (text or "
            "messages; without prompt, it is the start chosen and rejected share), or prompt_ids, chosen_ids and "
            "rejected_ids"
        )
    if tokenizer is None:
        raise ValueError("preference rows of text need processing_class=<a tokenizer>; or give token ids")
    tools = {"tools": row["tools"]} if row.get("tools") is not None else {}
    if is_conversational(row):

        def ids(messages: list, **kw: Any) -> list[int]:
            return list(
                tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw, **tools)["input_ids"]
            )

        prompt = ids(row["prompt"], add_generation_prompt=True)
        chosen, rejected = ids(row["prompt"] + row["chosen"]), ids(row["prompt"] + row["rejected"])
    else:
        eos = tokenizer.eos_token
        c = row["chosen"] if row["chosen"].endswith(eos) else row["chosen"] + eos
        r = row["rejected"] if row["rejected"].endswith(eos) else row["rejected"] + eos
        prompt = list(tokenizer(text=row["prompt"])["input_ids"])
        chosen, rejected = (
            list(tokenizer(text=row["prompt"] + c)["input_ids"]),
            list(tokenizer(text=row["prompt"] + r)["input_ids"]),
        )
    n = min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))
    return {"prompt_ids": prompt[:n], "chosen_ids": chosen[n:], "rejected_ids": rejected[n:]}


def preference_rows(
    rows: Iterable[Mapping[str, Any]], tokenizer: Any = None, max_length: int | None = 1024
) -> list[dict[str, list[int]]]:
    """Return a dataset's rows through :func:`preference_row`, without those whose prompt fills ``max_length``."""
    out = [preference_row(r, tokenizer) for r in rows]
    return [r for r in out if max_length is None or len(r["prompt_ids"]) < max_length]


@attrs.frozen
class PaddingFreePreferenceCollate:
    """Collate preference items into one flattened row; see :func:`padding_free_preference_collate`."""

    padded: PreferenceCollate
    columns = PreferenceCollate.columns

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        batch = self.padded(items)
        keep = batch["attention_mask"].bool()
        lengths = batch["attention_mask"].sum(1)
        out = {
            "input_ids": batch["input_ids"][keep][None],
            "completion_mask": batch["completion_mask"][keep][None],
            "position_ids": torch.cat([torch.arange(int(n)) for n in lengths])[None],
            "sequence_index": torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None],
        }
        return out | {k: batch[k] for k in REF_KEYS if k in batch}


def padding_free_preference_collate(
    eos_token_id: int | None = None, max_length: int | None = None
) -> PaddingFreePreferenceCollate:
    """Return a collator of preference items into one row without padding: chosen sequences, then rejected ones.

    Positions restart at each sequence (``position_ids``) and ``sequence_index`` gives each token's
    sequence, so the DPO objective sums each sequence's completion log-probs apart (a model that keeps
    documents apart by their positions is needed: ``trainfold.data.packing.check_packable``).

    >>> b = padding_free_preference_collate()([{"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4]}])
    >>> b["input_ids"].tolist(), b["position_ids"].tolist(), b["sequence_index"].tolist()
    ([[1, 2, 3, 1, 4]], [[0, 1, 2, 0, 1]], [[0, 0, 0, 1, 1]])
    """
    return PaddingFreePreferenceCollate(PreferenceCollate(eos_token_id=eos_token_id, max_length=max_length))
