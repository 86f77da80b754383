"""Direct Preference Optimization as plain functions: a collator, the loss math, and an objective.

A preference item holds token ids ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``.
:func:`preference_collate` builds one batch with every ``prompt+chosen`` row first and every
``prompt+rejected`` row after them (right-padded, EOS appended, a ``completion_mask`` that is 1 on
completion tokens only), so the policy scores both halves in one forward pass.
A sequence's log-prob is the *sum* over its completion tokens of the next-token log-probs.

The reference is either a frozen param dict given to :func:`dpo_objective` (run with the same
forward under ``no_grad``), or log-probs stored in the items once before training by
:func:`precompute_ref_logps` or, inside ``train``, by ``dpo_objective(precompute_ref_log_probs=True)``,
cached beside the run (``trainfold.dpo.reference``); then training runs no reference forward at all.

:func:`dpo_loss` is the per-pair loss; with ``Δ = (π_c − ref_c) − (π_r − ref_r)`` the default
is ``−log σ(β·Δ)``: β multiplies the whole difference. The numbers match TRL 1.16's DPOTrainer.

>>> import torch
>>> zero = torch.zeros(2)
>>> round(dpo_loss(zero, zero, zero, zero, beta=0.1).mean().item(), 6)  # reference == policy: ln 2
0.693147
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.chunked_loss import OutputHead, check_chunk_size, output_head
from trainfold.core.counting import count_pairs
from trainfold.core.forward import Forward, LossAux, ModelInputsObjective, Tensors
from trainfold.core.logps import completion_logps, per_sequence
from trainfold.data.collate import check_completion_padding
from trainfold.data.lengths import PREFERENCE_COLUMNS
from trainfold.data.rows import check_items
from trainfold.dpo.logps import MODEL_KEYS, REF_KEYS, halves, token_means
from trainfold.dpo.loss import DPO_LOSS_TYPES as LOSS_TYPES
from trainfold.dpo.loss import dpo_loss, dpo_loss_errors, loss_types_of
from trainfold.dpo.reference import precompute_ref_logps, prepare_reference

__all__ = [
    "LOSS_TYPES",
    "PREFERENCE_COLUMNS",
    "DPOObjective",
    "PreferenceCollate",
    "dpo_loss",
    "dpo_objective",
    "precompute_ref_logps",
    "preference_collate",
]


# -- collation -----------------------------------------------------------------------------


def _preference_fix(item: Mapping[str, Any]) -> str:
    old = [k for k in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids") if k in item]
    return (
        f"rename {old} to TRL 1.x's names {PREFERENCE_COLUMNS}" if old else "tokenize prompt, chosen and rejected first"
    )


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

    columns = (*PREFERENCE_COLUMNS, *REF_KEYS)  # the item columns it reads: remove_unused_columns keeps them
    eos_token_id: int | None
    pad_token_id: int = 0
    max_length: int | None = None
    pad_to_multiple_of: int | None = None  # the padded width is rounded up to a multiple of it (TRL's name)

    def _row(self, prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
        if self.eos_token_id is not None and (not completion or completion[-1] != self.eos_token_id):
            completion = [*completion, self.eos_token_id]
        ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        if self.max_length is not None:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        return ids, mask

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        check_items(items, PREFERENCE_COLUMNS, "preference item", _preference_fix)
        rows = [
            self._row(list(it["prompt_ids"]), list(it[side])) for side in ("chosen_ids", "rejected_ids") for it in items
        ]
        width = max(len(ids) for ids, _ in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
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


def preference_collate(
    eos_token_id: int | None,
    pad_token_id: int = 0,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> PreferenceCollate:
    """Return a collator of preference items (EOS appended when missing; ``max_length`` keeps the start).

    ``pad_to_multiple_of`` rounds the padded width up to a multiple of it (as TRL's collator).

    >>> c = preference_collate(eos_token_id=2)
    >>> b = c([{"prompt_ids": [1, 10], "chosen_ids": [20], "rejected_ids": [30, 31]}])
    >>> b["input_ids"].tolist()
    [[1, 10, 20, 2, 0], [1, 10, 30, 31, 2]]
    >>> b["completion_mask"].tolist()
    [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    >>> preference_collate(2, pad_to_multiple_of=4)([{"prompt_ids": [1], "chosen_ids": [5], "rejected_ids": [6]}])[
    ...     "input_ids"].tolist()
    [[1, 5, 2, 0], [1, 6, 2, 0]]
    """
    check_completion_padding(max_length, pad_to_multiple_of)
    return PreferenceCollate(
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        max_length=max_length,
        pad_to_multiple_of=pad_to_multiple_of,
    )


# -- the objective -------------------------------------------------------------------------


@attrs.frozen(eq=False)
class DPOObjective(ModelInputsObjective):
    """The DPO objective for ``make_step(..., objective=...)``; make one with :func:`dpo_objective`.

    Returns the summed pair losses divided by the step's pair count, and TRL's metrics
    ``rewards/{chosen,rejected,accuracies,margins}`` and ``logps/{chosen,rejected}`` scaled the same
    way, so the step's totals are exact means over its pairs. ``logits/{chosen,rejected}`` (the
    vocabulary-mean next-token logit), ``entropy`` (chosen and rejected tokens) and
    ``mean_token_accuracy`` (chosen tokens) are token means of each micro-batch, weighted by its
    pairs (TRL averages its micro-batches' token means). Evaluation reduces the same values over
    the eval batches (``trainfold.evaluation.evaluation``): ``eval_loss``, ``eval_rewards/chosen``...

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
    loss_type: str | tuple[str, ...]
    label_smoothing: float
    ref_params: Mapping[str, Tensor] | None
    head: OutputHead | None = None  # set: log-probs chunk by chunk from the hidden states (loss_chunk_size)
    chunk_size: int = 0
    precompute_ref_log_probs: bool = False  # train scores the datasets once, cached (trainfold.dpo.reference)
    precompute_ref_batch_size: int | None = None
    loss_weights: tuple[float, ...] | None = None  # one per loss type (TRL's MPO mix); None: all 1
    discopop_tau: float = 0.05
    columns = (*PREFERENCE_COLUMNS, *REF_KEYS)  # the item columns train keeps for it
    aux_reduction = "sum"  # its metrics are divided by the step's pair count, as its loss: the step sums them
    eval_metrics_per_batch = True  # eval: TRL averages each batch's metrics over the batches, unweighted
    model_keys = MODEL_KEYS

    def count_items(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count the pairs of ``micro_batch``."""
        return count_pairs(micro_batch)

    def prepare(
        self,
        model: nn.Module,
        train_dataset: Any,
        eval_dataset: Any,
        collate: Callable[[list[Any]], Any],
        *,
        device: torch.device,
        output_dir: str | os.PathLike,
        train_batch_size: int,
        eval_batch_size: int,
    ) -> tuple[DPOObjective, Any, Any]:
        """Return ``(objective, train_dataset, eval_dataset)`` for a run (``train`` calls it before the first step).

        With ``precompute_ref_log_probs`` the datasets come back carrying the reference log-probs,
        read from (or computed once into) ``output_dir/ref_logps/``, scored ``train_batch_size`` (``eval_batch_size``)
        rows at a time unless ``precompute_ref_batch_size`` is set, and the objective without reference params
        (``trainfold.dpo.reference.prepare_reference``); else all as they are.
        """
        if not self.precompute_ref_log_probs:
            return self, train_dataset, eval_dataset
        return prepare_reference(
            self,
            model,
            train_dataset,
            eval_dataset,
            collate,
            output_dir=output_dir,
            device=device,
            train_batch_size=train_batch_size,
            eval_batch_size=eval_batch_size,
        )

    def count_samples(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count the dataset rows of ``micro_batch`` (its pairs; evaluation's ``samples_per_second``)."""
        return count_pairs(micro_batch)

    def _ref_logps(
        self, forward: Callable[..., Any], inputs: Mapping[str, Tensor], micro: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        if self.ref_params is None:
            missing = [k for k in REF_KEYS if k not in micro]
            if missing and self.precompute_ref_log_probs:
                raise KeyError(
                    f"micro-batch lacks {missing}: dpo_objective(precompute_ref_log_probs=True) without ref_params "
                    "takes the model before training as the reference, which only train has (it stores the values "
                    "in the datasets it prepares); pass ref_params=... to score other data"
                )
            if missing:
                raise KeyError(
                    f"micro-batch lacks {missing} and dpo_objective has no ref_params: pass ref_params=..., "
                    "store reference log-probs in the items with precompute_ref_logps, or train with "
                    "dpo_objective(precompute_ref_log_probs=True)"
                )
            return micro["ref_chosen_logps"], micro["ref_rejected_logps"]
        with torch.no_grad():
            return halves(completion_logps(forward, self.ref_params, inputs, micro, self.head, self.chunk_size)[0])

    def loss_of(self, forward: Forward, params: Tensors, inputs: Tensors, micro: Tensors, n: Tensor) -> LossAux:
        logps, row_stats = completion_logps(forward, params, inputs, micro, self.head, self.chunk_size)
        chosen, rejected = halves(logps)
        ref_chosen, ref_rejected = self._ref_logps(forward, inputs, micro)
        ref_chosen, ref_rejected = ref_chosen.to(chosen), ref_rejected.to(chosen)
        lengths = halves(per_sequence(micro["completion_mask"][:, 1:], micro).to(chosen.dtype))
        losses = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            self.beta,
            self.loss_type,
            self.label_smoothing,
            *lengths,
            loss_weights=self.loss_weights,
            discopop_tau=self.discopop_tau,
        )
        n = n.to(chosen.dtype)
        reward_c = (self.beta * (chosen - ref_chosen)).detach()
        reward_r = (self.beta * (rejected - ref_rejected)).detach()
        aux = {
            "rewards/chosen": reward_c.sum() / n,
            "rewards/rejected": reward_r.sum() / n,
            "rewards/accuracies": (reward_c > reward_r).to(n.dtype).sum() / n,
            "rewards/margins": (reward_c - reward_r).sum() / n,
            "logps/chosen": chosen.detach().sum() / n,
            "logps/rejected": rejected.detach().sum() / n,
            **token_means(row_stats(), lengths, chosen.shape[0] / n),
        }
        return losses.sum() / n, aux

    def predictions(
        self, forward: Callable[..., Any], params: Mapping[str, Tensor], micro_batch: Mapping[str, Tensor]
    ) -> tuple[Any, Tensor]:
        """Return what ``compute_metrics`` scores, as TRL's ``prediction_step``: the policy's outputs on the batch
        rows (its chosen rows, then its rejected rows) and, as ``label_ids``, their ``input_ids``."""
        return forward(params, {k: micro_batch[k] for k in self.model_keys if k in micro_batch}), micro_batch[
            "input_ids"
        ]


def _head(model: nn.Module | None, chunk_size: int | None, size: int | None) -> OutputHead | None:
    """Check the settings and return the output head that ``chunk_size`` needs (None without it)."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"precompute_ref_batch_size={size!r} must be a positive int or None")
    if chunk_size is None:
        return None
    if model is None:
        raise ValueError("dpo_objective(chunk_size=...) needs model= (the causal LM whose output embedding it applies)")
    check_chunk_size(chunk_size)
    return output_head(model)


def dpo_objective(
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    label_smoothing: float = 0.0,
    ref_params: Mapping[str, Tensor] | None = None,
    *,
    loss_weights: Sequence[float] | None = None,
    discopop_tau: float = 0.05,
    model: nn.Module | None = None,
    chunk_size: int | None = None,
    precompute_ref_log_probs: bool = False,
    precompute_ref_batch_size: int | None = None,
) -> DPOObjective:
    """Return the DPO objective; reference from ``ref_params`` (frozen) or from precomputed item columns.

    ``loss_type`` is one of TRL's 15 (``trainfold.dpo.loss.dpo_loss``) or a list of them mixed by
    ``loss_weights`` (TRL's MPO); the loss of a micro-batch is the mean over its pairs, as TRL's.

    ``precompute_ref_log_probs=True`` (TRL's name): ``train`` scores the train and eval sets with
    the reference once, before the first step, ``precompute_ref_batch_size`` pairs at a time
    (default: the per-device batch size), caches the values in ``output_dir/ref_logps/`` (a
    resumed run reads them back) and trains without a reference forward. Without ``ref_params``
    the reference is the model as ``train`` receives it (TRL's ``ref_model=None``).

    ``chunk_size`` (with ``model``, a transformers causal LM) computes the completion log-probs from
    the final hidden states ``chunk_size`` tokens at a time, never materialising the full logits.

    With ``ref_params`` the reference runs through the step's own forward (train mode), so a
    model with dropout would drop units in the reference too: disable dropout for DPO (TRL does
    by default), or precompute the reference log-probs, which runs in eval mode.

    >>> import torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> from trainfold.core.generate import functional_forward
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> params = {k: v.detach() for k, v in model.named_parameters()}
    >>> batch = preference_collate(2)([{"prompt_ids": [1, 3], "chosen_ids": [4], "rejected_ids": [5, 6]}])
    >>> obj = dpo_objective(beta=0.1, ref_params=params)
    >>> loss, aux = obj(functional_forward(model), params, batch, obj.count_items(batch))
    >>> round(loss.item(), 6), aux["rewards/margins"].item()
    (0.693147, 0.0)
    """
    problems = dpo_loss_errors(beta, loss_type, label_smoothing, loss_weights, discopop_tau)
    if problems:
        raise ValueError("; ".join(problems))
    head = _head(model, chunk_size, precompute_ref_batch_size)
    # its own copy: train trains the module's storage in place, and ref_params often are the module's tensors
    frozen = None if ref_params is None else {k: v.detach().clone() for k, v in ref_params.items()}
    return DPOObjective(
        beta=beta,
        loss_type=loss_type if isinstance(loss_type, str) else loss_types_of(loss_type),
        loss_weights=None if loss_weights is None else tuple(float(w) for w in loss_weights),
        discopop_tau=discopop_tau,
        label_smoothing=label_smoothing,
        ref_params=frozen,
        head=head,
        chunk_size=chunk_size or 0,
        precompute_ref_log_probs=bool(precompute_ref_log_probs),
        precompute_ref_batch_size=precompute_ref_batch_size,
    )
