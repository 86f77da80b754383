"""Unpaired preference rows to token ids, as TRL 1.16's ``KTOTrainer`` prepares them.

An unpaired row is ``{"prompt", "completion", "label"}`` (text, or message lists through the tokenizer's
chat template; ``label`` True for a desirable completion). :func:`unpaired_rows` prepares a dataset as
``KTOTrainer._prepare_dataset`` does, in its order:

1. rows without ``prompt`` get the prompt their ``chosen`` and ``rejected`` share (TRL's ``extract_prompt``);
2. paired rows (``chosen``/``rejected``) are unpaired as ``unpair_preference_dataset`` does: in blocks of
   1000 rows (``datasets``' map batch), the block's chosen completions (label True), then its rejected ones;
3. text completions get the EOS token appended; ``prompt`` and ``prompt + completion`` are tokenized and
   the prompt's length is their common prefix (a token merged across the boundary goes to the completion);
4. rows whose prompt alone fills ``max_length`` are dropped;
5. with a KL term (``loss_type="kto"``), ``KL_completion_ids`` rotates the completions by one within each
   block of ``kl_batch_size`` consecutive rows (TRL's ``per_device_train_batch_size``, for the eval set
   too): ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``, the mismatched pairs the KL estimate scores.

>>> rows = [{"prompt_ids": [1], "completion_ids": [c], "label": c % 2 == 0} for c in (2, 3, 4)]
>>> [r["KL_completion_ids"] for r in unpaired_rows(rows, kl_batch_size=2)]
[[3], [2], [4]]
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trainfold.data.rows import common_prefix, implicit_prompt, is_conversational

__all__ = ["KL_COLUMN", "UNPAIRED_COLUMNS", "unpair", "unpaired_row", "unpaired_rows", "with_kl_completions"]

UNPAIRED_COLUMNS = ("prompt_ids", "completion_ids", "label")  # TRL 1.x's names for tokenized unpaired rows
KL_COLUMN = "KL_completion_ids"
_UNPAIR_BLOCK = 1000  # datasets' default map batch size, which unpair_preference_dataset runs under


def unpair(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return paired rows (``chosen``/``rejected``, optional ``prompt``) as unpaired ones, in TRL's order.

    >>> unpair([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "d", "chosen": " e", "rejected": " f"}])
    ... # doctest: +NORMALIZE_WHITESPACE
    [{'prompt': 'a', 'completion': ' b', 'label': True}, {'prompt': 'd', 'completion': ' e', 'label': True},
     {'prompt': 'a', 'completion': ' c', 'label': False}, {'prompt': 'd', 'completion': ' f', 'label': False}]
    """
    out = []
    for start in range(0, len(rows), _UNPAIR_BLOCK):
        block = rows[start : start + _UNPAIR_BLOCK]
        for side, label in (("chosen", True), ("rejected", False)):
            for row in block:
                rest = {k: v for k, v in row.items() if k not in ("chosen", "rejected", "prompt")}
                prompt = {"prompt": row["prompt"]} if "prompt" in row else {}
                out.append({**prompt, "completion": row[side], "label": label, **rest})
    return out


def _ids(tokenizer: Any, text_or_messages: Any, **kw: Any) -> list[int]:
    if isinstance(text_or_messages, list):
        return list(tokenizer.apply_chat_template(text_or_messages, tokenize=True, return_dict=True, **kw)["input_ids"])
    return list(tokenizer(text=text_or_messages)["input_ids"])


def unpaired_row(row: Mapping[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """Return one unpaired row's ``prompt_ids``, ``completion_ids`` and ``label`` (TRL's tokenization, step 3 of
    the module doc). Rows that already hold those columns come back as they are.

    >>> unpaired_row({"prompt_ids": [1], "completion_ids": [2, 3], "label": False, "score": 0.5})
    {'prompt_ids': [1], 'completion_ids': [2, 3], 'label': False}
    """
    if all(k in row for k in UNPAIRED_COLUMNS):
        return {"prompt_ids": list(row["prompt_ids"]), "completion_ids": list(row["completion_ids"]),
                "label": bool(row["label"])}  # fmt: skip
    missing = [k for k in ("prompt", "completion", "label") if k not in row]
    if missing:
        raise KeyError(
            f"unpaired row lacks {missing} (has {sorted(row)}): give prompt, completion and label (text or messages), "
            "prompt_ids, completion_ids and label, or paired rows with chosen and rejected"
        )
    if tokenizer is None:
        raise ValueError("unpaired rows of text need processing_class=<a tokenizer>; or give token ids")
    tools = row.get("tools")
    kw = {"tools": json.loads(tools) if isinstance(tools, str) else tools, **(row.get("chat_template_kwargs") or {})}
    prompt, completion = row["prompt"], row["completion"]
    if is_conversational(row):
        prompt_ids = _ids(tokenizer, prompt, add_generation_prompt=True, **kw)
        full = _ids(tokenizer, prompt + completion, **kw)
    else:
        if not completion.endswith(tokenizer.eos_token):
            completion = completion + tokenizer.eos_token
        prompt_ids, full = _ids(tokenizer, prompt), _ids(tokenizer, prompt + completion)
    n = common_prefix(prompt_ids, full)
    return {"prompt_ids": prompt_ids[:n], "completion_ids": full[n:], "label": bool(row["label"])}


def with_kl_completions(rows: Sequence[Mapping[str, Any]], kl_batch_size: int) -> list[dict[str, Any]]:
    """Return copies of ``rows`` with ``KL_completion_ids``: the completions rotated by one within each block of
    ``kl_batch_size`` rows (step 5 of the module doc)."""
    out = []
    for start in range(0, len(rows), kl_batch_size):
        block = rows[start : start + kl_batch_size]
        completions = [block[-1]["completion_ids"], *(r["completion_ids"] for r in block[:-1])]
        out += [{**r, KL_COLUMN: list(c)} for r, c in zip(block, completions, strict=True)]
    return out


def unpaired_rows(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: Any = None,
    max_length: int | None = 1024,
    kl_batch_size: int | None = None,
) -> list[dict[str, Any]]:
    """Return a dataset's rows prepared as ``KTOTrainer`` prepares them (see the module doc); ``kl_batch_size``
    None: no ``KL_completion_ids`` (``loss_type="apo_zero_unpaired"``)."""
    rows = [dict(r) for r in rows]
    if rows and "prompt" not in rows[0] and "prompt_ids" not in rows[0]:
        rows = [{**r, **implicit_prompt(r["chosen"], r["rejected"])} if "chosen" in r else r for r in rows]
    if rows and "chosen" in rows[0] and "rejected" in rows[0]:
        rows = unpair(rows)
    out = [unpaired_row(r, tokenizer) for r in rows]
    out = [r for r in out if max_length is None or len(r["prompt_ids"]) < max_length]
    return out if kl_batch_size is None else with_kl_completions(out, kl_batch_size)
