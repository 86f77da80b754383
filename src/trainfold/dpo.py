"""Direct Preference Optimization as plain functions: a collator, the loss math, and an objective.

A preference item holds token ids ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``.
:func:`preference_collate` builds one batch with every ``prompt+chosen`` row first and every
``prompt+rejected`` row after them (right-padded, EOS appended, a ``completion_mask`` that is 1 on
completion tokens only), so the policy scores both halves in one forward pass.
A sequence's log-prob is the *sum* over its completion tokens of the next-token log-probs.

The reference is either a frozen param dict given to :func:`dpo_objective` (run with the same
forward under ``no_grad``), or log-probs stored in the items once before training by
:func:`precompute_ref_logps` (then training runs no reference forward at all).

:func:`dpo_loss` is the per-pair loss; with ``Δ = (π_c − ref_c) − (π_r − ref_r)`` the default
is ``−log σ(β·Δ)``: β multiplies the whole difference. The numbers match TRL 1.16's DPOTrainer.

>>> import torch
>>> zero = torch.zeros(2)
>>> round(dpo_loss(zero, zero, zero, zero, beta=0.1).mean().item(), 6)  # reference == policy: ln 2
0.693147
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.chunked_loss import OutputHead, check_chunk_size, chunked_token_logps, output_head
from trainfold.generate import functional_forward, token_logps
from trainfold.losses import DPO_LOSS_TYPES as LOSS_TYPES
from trainfold.losses import dpo as dpo_loss
from trainfold.losses import dpo_loss_errors as _loss_errors
from trainfold.losses import logits_of
from trainfold.step import train_mode

__all__ = [
    "LOSS_TYPES",
    "DPOObjective",
    "PreferenceCollate",
    "count_pairs",
    "dpo_loss",
    "dpo_objective",
    "precompute_ref_logps",
    "preference_collate",
    "sequence_logps",
]

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
_MODEL_KEYS = ("input_ids", "attention_mask")


# -- collation -----------------------------------------------------------------------------


@attrs.frozen
class PreferenceCollate:
    """Collate preference items into one batch: chosen rows, then rejected rows (see module doc).

    Make one with :func:`preference_collate`. Items carrying precomputed reference log-probs
    pass them on as float columns:

    >>> c = PreferenceCollate(eos_token_id=None, pad_token_id=9)
    >>> b = c([{"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4],
    ...         "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.0}])
    >>> b["input_ids"].tolist(), b["completion_mask"].tolist(), b["ref_rejected_logps"].tolist()
    ([[1, 2, 3], [1, 4, 9]], [[0, 1, 1], [0, 1, 0]], [-2.0])
    """

    eos_token_id: int | None
    pad_token_id: int = 0
    max_length: int | None = None

    def _row(self, prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
        if self.eos_token_id is not None and (not completion or completion[-1] != self.eos_token_id):
            completion = [*completion, self.eos_token_id]
        ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        if self.max_length is not None:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        return ids, mask

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        if not items:
            raise ValueError("cannot collate an empty list of preference items")
        for i, item in enumerate(items):
            missing = [k for k in ("prompt_ids", "chosen_ids", "rejected_ids") if k not in item]
            if missing:
                raise KeyError(f"preference item {i} lacks {missing} (has {sorted(item)}); tokenize prompt, chosen and rejected first")
        rows = [self._row(list(it["prompt_ids"]), list(it[side])) for side in ("chosen_ids", "rejected_ids") for it in items]
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        completion = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (ids, mask) in enumerate(rows):
            input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention[r, : len(ids)] = 1
            completion[r, : len(ids)] = torch.tensor(mask, dtype=torch.long)
        out = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}
        have = [all(k in it for it in items) for k in REF_KEYS]
        if any(have):
            if not all(have):
                raise KeyError(f"items carry only some of {list(REF_KEYS)}; precompute both with precompute_ref_logps")
            for k in REF_KEYS:
                out[k] = torch.tensor([float(it[k]) for it in items], dtype=torch.float32)
        return out


def preference_collate(eos_token_id: int | None, pad_token_id: int = 0, max_length: int | None = None) -> PreferenceCollate:
    """Return a collator of preference items (EOS appended when missing; ``max_length`` keeps the start).

    >>> c = preference_collate(eos_token_id=2)
    >>> b = c([{"prompt_ids": [1, 10], "chosen_ids": [20], "rejected_ids": [30, 31]}])
    >>> b["input_ids"].tolist()
    [[1, 10, 20, 2, 0], [1, 10, 30, 31, 2]]
    >>> b["completion_mask"].tolist()
    [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    """
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length={max_length} leaves no completion token to score; use None or >= 2")
    return PreferenceCollate(eos_token_id=eos_token_id, pad_token_id=pad_token_id, max_length=max_length)


# -- log-probs and the loss ----------------------------------------------------------------


def sequence_logps(logits: Tensor, input_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Return each row's summed log-prob of its completion tokens (position t scores token t+1).

    >>> import torch
    >>> logits = torch.zeros(1, 3, 4)  # uniform: each token has log-prob ln(1/4)
    >>> round(sequence_logps(logits, torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 1]])).item(), 4)
    -2.7726
    """
    per_token = token_logps(logits, input_ids)
    return (per_token * completion_mask[:, 1:].to(per_token.dtype)).sum(-1)


def _completion_logps(forward: Callable[..., Any], params: Mapping[str, Tensor], inputs: Mapping[str, Tensor],
                      batch: Mapping[str, Tensor], head: OutputHead | None, chunk_size: int) -> Tensor:
    """Return each row's completion log-prob: from the logits, or chunk by chunk from the hidden states."""
    if head is None:
        return sequence_logps(logits_of(forward(params, inputs)), batch["input_ids"], batch["completion_mask"])
    hidden = head.hidden(forward, params, inputs)
    targets = batch["input_ids"][:, 1:].masked_fill(batch["completion_mask"][:, 1:] == 0, -100)
    per_token = chunked_token_logps(hidden[:, :-1], head.weight(params), targets, bias=head.bias, chunk_size=chunk_size)
    return per_token.sum(-1)


# -- the objective -------------------------------------------------------------------------


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    n = x.shape[0] // 2
    return x[:n], x[n:]


def count_pairs(micro_batch: Mapping[str, Tensor]) -> Tensor:
    """Count the preference pairs of a collated micro-batch (half its rows).

    >>> import torch
    >>> count_pairs({"input_ids": torch.zeros(6, 3)}).item()
    3
    """
    rows = micro_batch["input_ids"].shape[0]
    if rows % 2:
        raise ValueError(f"a preference micro-batch has {rows} rows; it must hold chosen rows then as many rejected rows")
    return torch.tensor(rows // 2)


@attrs.frozen(eq=False)
class DPOObjective:
    """The DPO objective for ``make_step(..., objective=...)``; make one with :func:`dpo_objective`.

    Returns the summed pair losses divided by the step's pair count, and the metrics
    ``rewards/{chosen,rejected,accuracies,margins}`` and ``logps/{chosen,rejected}`` scaled the same
    way, so the step's totals are exact means over its pairs.

    A uniform policy over 16 tokens scores each 2-token completion ``2 ln(1/16)``; with the
    reference 10 nats below it on chosen and 10 above on rejected, the margin is ``beta * 20``:

    >>> import math
    >>> lp = 2 * math.log(1 / 16)
    >>> batch = preference_collate(2)([{"prompt_ids": [1], "chosen_ids": [4], "rejected_ids": [5],
    ...                                 "ref_chosen_logps": lp - 10, "ref_rejected_logps": lp + 10}])
    >>> uniform = lambda params, inputs: torch.zeros(*inputs["input_ids"].shape, 16)
    >>> obj = dpo_objective(beta=0.1)
    >>> loss, aux = obj(uniform, {}, batch, obj.count_items(batch))
    >>> round(loss.item(), 4), round(aux["rewards/margins"].item(), 4), aux["rewards/accuracies"].item()
    (0.1269, 2.0, 1.0)
    """

    beta: float
    loss_type: str
    label_smoothing: float
    ref_params: Mapping[str, Tensor] | None
    head: OutputHead | None = None  # set: log-probs chunk by chunk from the hidden states (loss_chunk_size)
    chunk_size: int = 0
    columns = ("prompt_ids", "chosen_ids", "rejected_ids", *REF_KEYS)  # the item columns train keeps for it

    def count_items(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count the pairs of ``micro_batch``."""
        return count_pairs(micro_batch)

    def _ref_logps(self, forward: Callable[..., Any], inputs: Mapping[str, Tensor], micro: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        if self.ref_params is None:
            missing = [k for k in REF_KEYS if k not in micro]
            if missing:
                raise KeyError(
                    f"micro-batch lacks {missing} and dpo_objective has no ref_params: pass ref_params=..., "
                    "or store reference log-probs in the items with precompute_ref_logps"
                )
            return micro["ref_chosen_logps"], micro["ref_rejected_logps"]
        with torch.no_grad():
            return _halves(_completion_logps(forward, self.ref_params, inputs, micro, self.head, self.chunk_size))

    def __call__(
        self,
        forward: Callable[..., Any],
        params: Mapping[str, Tensor],
        micro_batch: Mapping[str, Tensor],
        num_items_in_batch: Tensor,
        key: torch.Generator | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        inputs = {k: micro_batch[k] for k in _MODEL_KEYS if k in micro_batch}
        logps = _completion_logps(forward, params, inputs, micro_batch, self.head, self.chunk_size)
        chosen, rejected = _halves(logps)
        ref_chosen, ref_rejected = self._ref_logps(forward, inputs, micro_batch)
        ref_chosen, ref_rejected = ref_chosen.to(chosen), ref_rejected.to(chosen)
        lengths = _halves(micro_batch["completion_mask"][:, 1:].sum(-1).to(chosen.dtype))
        losses = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type,
                          self.label_smoothing, *lengths)
        n = num_items_in_batch.to(chosen.dtype)
        reward_c = (self.beta * (chosen - ref_chosen)).detach()
        reward_r = (self.beta * (rejected - ref_rejected)).detach()
        aux = {
            "rewards/chosen": reward_c.sum() / n,
            "rewards/rejected": reward_r.sum() / n,
            "rewards/accuracies": (reward_c > reward_r).to(n.dtype).sum() / n,
            "rewards/margins": (reward_c - reward_r).sum() / n,
            "logps/chosen": chosen.detach().sum() / n,
            "logps/rejected": rejected.detach().sum() / n,
        }
        return losses.sum() / n, aux


def dpo_objective(
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    ref_params: Mapping[str, Tensor] | None = None,
    *,
    model: nn.Module | None = None,
    chunk_size: int | None = None,
) -> DPOObjective:
    """Return the DPO objective; reference from ``ref_params`` (frozen) or from precomputed item columns.

    ``chunk_size`` (with ``model``, a transformers causal LM) computes the completion log-probs from
    the final hidden states ``chunk_size`` tokens at a time, never materialising the full logits.

    With ``ref_params`` the reference runs through the step's own forward (train mode), so a
    model with dropout would drop units in the reference too: disable dropout for DPO (TRL does
    by default), or precompute the reference log-probs, which runs in eval mode.

    >>> import torch
    >>> from trainfold.models import TinyLM, TinyLMConfig
    >>> from trainfold.generate import functional_forward
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> params = {k: v.detach() for k, v in model.named_parameters()}
    >>> batch = preference_collate(2)([{"prompt_ids": [1, 3], "chosen_ids": [4], "rejected_ids": [5, 6]}])
    >>> obj = dpo_objective(beta=0.1, ref_params=params)
    >>> loss, aux = obj(functional_forward(model), params, batch, obj.count_items(batch))
    >>> round(loss.item(), 6), aux["rewards/margins"].item()
    (0.693147, 0.0)
    """
    problems = _loss_errors(beta, loss_type, label_smoothing)
    if problems:
        raise ValueError("; ".join(problems))
    if chunk_size is not None and model is None:
        raise ValueError("dpo_objective(chunk_size=...) needs model= (the causal LM whose output embedding it applies)")
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    head = None if chunk_size is None else output_head(model)
    # its own copy: train trains the module's storage in place, and ref_params often are the module's tensors
    frozen = None if ref_params is None else {k: v.detach().clone() for k, v in ref_params.items()}
    return DPOObjective(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, ref_params=frozen,
                        head=head, chunk_size=chunk_size or 0)


def precompute_ref_logps(
    model: nn.Module,
    ref_params: Mapping[str, Tensor],
    items: Sequence[Mapping[str, Any]],
    collate: PreferenceCollate,
    batch_size: int = 16,
    buffers: Mapping[str, Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Return copies of ``items`` with ``ref_chosen_logps``/``ref_rejected_logps`` (floats) added.

    One pass of the reference (``model`` run on ``ref_params``, eval mode, no grad) in item order.
    The collator must be the one training uses, so the scored tokens are the same.

    >>> import torch
    >>> from trainfold.models import TinyLM, TinyLMConfig
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> items = [{"prompt_ids": [1], "chosen_ids": [4], "rejected_ids": [5]}]
    >>> out = precompute_ref_logps(model, dict(model.named_parameters()), items, preference_collate(2))
    >>> sorted(out[0]), "ref_chosen_logps" in items[0]
    (['chosen_ids', 'prompt_ids', 'ref_chosen_logps', 'ref_rejected_logps', 'rejected_ids'], False)
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be a positive int")
    forward = functional_forward(model, buffers)
    params = {k: v.detach() for k, v in ref_params.items()}
    out: list[dict[str, Any]] = []
    with torch.no_grad(), train_mode(model, False):
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            batch = collate([{k: v for k, v in it.items() if k not in REF_KEYS} for it in chunk])
            logits = logits_of(forward(params, {k: batch[k] for k in _MODEL_KEYS}))
            chosen, rejected = _halves(sequence_logps(logits, batch["input_ids"], batch["completion_mask"]))
            for it, c, r in zip(chunk, chosen.tolist(), rejected.tolist()):
                out.append({**it, "ref_chosen_logps": c, "ref_rejected_logps": r})
    return out
