"""Supervised fine-tuning data as TRL 1.16's ``SFTTrainer`` prepares it: rows to ``input_ids`` and ``labels``.

:func:`sft_row` turns one dataset row into token ids and labels (``-100`` where no loss is taken),
for each of TRL's formats:

* language modeling: ``{"text": ...}`` (or ``dataset_text_field``), EOS appended when missing;
* prompt-completion: ``{"prompt": ..., "completion": ...}``, EOS appended to the completion; the loss
  is on the completion only by default (``completion_only_loss``);
* conversational: ``{"messages": [...]}`` or ``prompt``/``completion`` message lists, through the
  tokenizer's chat template; ``assistant_only_loss`` keeps the tokens its ``{% generation %}`` blocks mark;
* pretokenized: ``{"input_ids": [...]}`` (``labels`` kept; else the input ids, masked by a
  ``completion_mask`` or ``assistant_masks`` column when there is one).

:func:`sft_rows` prepares a dataset (truncation to ``max_length`` without packing, rows left with no
label dropped, as TRL); :func:`sft_collate` pads a batch to TRL's keys ``input_ids``,
``attention_mask``, ``labels``. The loss is the causal-LM token mean (``trainfold.core.losses.causal_lm``).

>>> sft_collate(pad_token_id=0)([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5]}])["labels"]
tensor([[-100,    2,    3],
        [   4,    5, -100]])
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.core.losses import IGNORE_INDEX, causal_lm, logits_of
from trainfold.data.rows import common_prefix, is_conversational

__all__ = [
    "SFTCollate",
    "sft_collate",
    "sft_loss",
    "sft_row",
    "sft_rows",
    "sft_token_metrics",
]

_log = logging.getLogger(__name__)


def _chat(tokenizer: Any, messages: list, **kwargs: Any) -> dict[str, list[int]]:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)


def _assistant_masks(out: Mapping[str, Any]) -> list[int]:
    masks = list(out["assistant_masks"])
    if 1 not in masks:
        raise ValueError(
            "assistant_only_loss=True but a conversation has no assistant token in its mask: the chat template "
            "has no {% generation %} ... {% endgeneration %} block around the assistant's messages; add one "
            "(including the end-of-turn token), or set assistant_only_loss=False"
        )
    return masks


def _tokenized(row: Mapping[str, Any], tokenizer: Any, text_field: str, eos: str, assistant_only: bool) -> dict:
    """Return ``input_ids`` and the masks TRL derives labels from (``completion_mask``, ``assistant_masks``)."""
    chat = is_conversational(row)
    tools = {"tools": row["tools"]} if row.get("tools") is not None else {}
    if "prompt" in row:
        if chat:
            prompt = _chat(tokenizer, row["prompt"], add_generation_prompt=True, **tools)["input_ids"]
            both = _chat(tokenizer, row["prompt"] + row["completion"], return_assistant_tokens_mask=assistant_only)
        else:
            completion = row["completion"] if row["completion"].endswith(eos) else row["completion"] + eos
            prompt = tokenizer(text=row["prompt"])["input_ids"]
            both = tokenizer(text=row["prompt"] + completion)
        ids = list(both["input_ids"])
        n = common_prefix(prompt, ids)
        if n < len(prompt):
            _log.warning(
                "the tokenized prompt is not a prefix of the tokenized prompt+completion; the completion "
                "starts where they diverge (as in TRL)"
            )
        out = {"input_ids": ids, "completion_mask": [0] * n + [1] * (len(ids) - n)}
        if assistant_only:
            out["assistant_masks"] = _assistant_masks(both)
        return out
    if chat:
        done = _chat(tokenizer, row["messages"], return_assistant_tokens_mask=assistant_only, **tools)
        out = {"input_ids": list(done["input_ids"])}
        if assistant_only:
            out["assistant_masks"] = _assistant_masks(done)
        return out
    if text_field not in row:
        raise KeyError(
            f"SFT row has no {text_field!r} (has {sorted(row)}): give text in dataset_text_field, prompt and "
            "completion, messages, or input_ids"
        )
    text = row[text_field] if row[text_field].endswith(eos) else row[text_field] + eos
    return {"input_ids": list(tokenizer(text=text)["input_ids"])}


def sft_row(
    row: Mapping[str, Any],
    tokenizer: Any = None,
    *,
    dataset_text_field: str = "text",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    eos_token: str | None = None,
) -> dict[str, list[int]]:
    """Return one row's ``input_ids`` and ``labels`` (``-100`` where no loss is taken), as TRL prepares it.

    ``completion_only_loss=None`` keeps the loss on the completion for prompt-completion rows (TRL's default).

    >>> sft_row({"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}, completion_only_loss=True)
    {'input_ids': [5, 6, 7], 'labels': [-100, 6, 7]}
    >>> sft_row({"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]})["labels"]  # no prompt column: all tokens
    [5, 6, 7]
    """
    if assistant_only_loss and "input_ids" not in row and not is_conversational(row):
        raise ValueError("assistant_only_loss=True needs conversational rows (messages); set it False for text rows")
    if "input_ids" in row:
        out = {k: list(row[k]) for k in ("input_ids", "labels", "completion_mask", "assistant_masks") if k in row}
    else:
        if tokenizer is None:
            raise ValueError("SFT rows of text need processing_class=<a tokenizer>; or give input_ids")
        eos = eos_token or tokenizer.eos_token
        out = _tokenized(row, tokenizer, dataset_text_field, eos, assistant_only_loss)
    if "labels" in out:
        return {"input_ids": out["input_ids"], "labels": out["labels"]}
    completion_only = (
        ("prompt" in row and "completion" in row) if completion_only_loss is None else completion_only_loss
    )
    masks = [out[k] for k in ("completion_mask",) if completion_only and k in out]
    masks += [out["assistant_masks"]] if "assistant_masks" in out else []
    labels = [t if all(bits) else -100 for t, *bits in zip(out["input_ids"], *masks, strict=False)]
    return {"input_ids": out["input_ids"], "labels": labels}


def sft_rows(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: Any = None,
    *,
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    packing: bool = False,
    **settings: Any,
) -> list[dict[str, list[int]]]:
    """Return a dataset's rows prepared by :func:`sft_row`, truncated to ``max_length`` unless ``packing``.

    Truncation keeps the start (``truncation_mode="keep_start"``) or the end; rows left without any
    label are dropped (TRL drops them too). Packing cuts rows itself (``trainfold.data.packing``).

    >>> row = {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]}
    >>> sft_rows([row], max_length=2, completion_only_loss=True), sft_rows([row], max_length=2)
    ([], [{'input_ids': [1, 2], 'labels': [1, 2]}])
    """
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode={truncation_mode!r} is not one of ['keep_start', 'keep_end']")
    out = []
    for row in rows:
        done = sft_row(row, tokenizer, **settings)
        if max_length is not None and not packing:
            cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            done = {k: v[cut] for k, v in done.items()}
            if all(t == -100 for t in done["labels"]):
                continue
        out.append(done)
    return out


@attrs.frozen
class SFTCollate:
    """Pad SFT rows on the right to TRL's ``DataCollatorForLanguageModeling`` keys; see :func:`sft_collate`."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    columns = ("input_ids", "labels")  # the row columns it reads: remove_unused_columns keeps them

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.as_tensor(list(r["input_ids"]))
            labels[i, :n] = torch.as_tensor(list(r.get("labels", r["input_ids"])))
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sft_collate(pad_token_id: int, pad_to_multiple_of: int | None = None) -> Callable[[Sequence[Any]], dict]:
    """Return a collator of SFT rows: ``input_ids`` (padded with ``pad_token_id``), ``attention_mask``, ``labels``.

    >>> b = sft_collate(0, pad_to_multiple_of=4)([{"input_ids": [1, 2, 3]}])
    >>> b["input_ids"].tolist(), b["attention_mask"].tolist(), b["labels"].tolist()
    ([[1, 2, 3, 0]], [[1, 1, 1, 0]], [[1, 2, 3, -100]])
    """
    return SFTCollate(pad_token_id, pad_to_multiple_of)


def sft_token_metrics(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int) -> dict[str, Tensor]:
    """Return TRL's SFT metrics of a micro-batch: ``entropy`` (of the next-token distribution) and
    ``mean_token_accuracy`` (top-1 hits), each the mean over the micro-batch's own supervised positions (0 where it
    has none, as TRL's); ``num_items_in_batch`` (the step's count) is not used.

    ``sft_loss`` says ``aux_reduction = "micro_batch"``: a step logs the mean of its micro-batches' values and a log
    the mean over every micro-batch since the last one (an evaluation: over its batches), as TRL's ``log``
    averages the values its ``compute_loss`` appends.

    >>> logits = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]]])
    >>> m = sft_token_metrics(logits, torch.tensor([[-100, -100, 0]]), 1)  # position 1 predicts token 0: a miss
    >>> round(m["entropy"].item(), 4), m["mean_token_accuracy"].item()
    (0.3653, 0.0)
    """
    with torch.no_grad():
        logits = logits_of(outputs).float()
        target = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
        valid = target != IGNORE_INDEX
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        hits = (logits.argmax(-1) == target) & valid
        n = valid.sum().to(logits.dtype).clamp(min=1)
        return {"entropy": (entropy * valid).sum() / n, "mean_token_accuracy": hits.sum() / n}


def sft_loss(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int) -> Tensor:
    """The SFT loss: ``causal_lm`` (the token mean over the step), with TRL's metrics (:func:`sft_token_metrics`).

    >>> round(sft_loss(torch.zeros(1, 3, 4), torch.tensor([[1, 2, -100]]), 1).item(), 4)  # ln 4
    1.3863
    """
    return causal_lm(outputs, labels, num_items_in_batch)


sft_loss.count_items = causal_lm.count_items  # type: ignore[attr-defined]
sft_loss.metrics = sft_token_metrics  # type: ignore[attr-defined]
sft_loss.aux_reduction = "micro_batch"  # type: ignore[attr-defined]  # its metrics: each micro-batch's (TRL's)
