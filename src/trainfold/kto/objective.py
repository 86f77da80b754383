"""The KTO objective for ``make_step``/``train``: TRL 1.16 ``KTOTrainer.compute_loss`` as a function.

Per micro-batch: the policy's summed completion log-probs of every row (with grad); with a KL term the
policy's log-probs of the mismatched ``KL_`` sequences (no grad); the reference's log-probs of both
(frozen ``ref_params`` run through the same forward without grad, or the precomputed ``ref_logps`` and
``ref_KL_logps`` columns); the KL estimate of the micro-batch and :func:`trainfold.kto.loss.kto_loss`.

>>> import torch
>>> from trainfold.kto.collate import unpaired_collate
>>> batch = unpaired_collate()([{"prompt_ids": [1], "completion_ids": [4], "KL_completion_ids": [5], "label": True,
...                              "ref_logps": -5.0, "ref_KL_logps": -3.0}] * 2)
>>> uniform = lambda params, inputs: torch.zeros(*inputs["input_ids"].shape, 16)  # every token: log(1/16) = -2.7726
>>> obj = kto_objective(beta=0.1)  # kl = 3 - 2.7726, reward 0.1 * (5 - 2.7726): loss 1 - σ(0.2)
>>> loss, aux = obj(uniform, {}, batch, obj.count_items(batch))
>>> round(loss.item(), 4), round(aux["kl"].item(), 4), round(aux["rewards/chosen"].item(), 4)
(0.4502, 0.2274, 0.2227)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.forward import Forward, LossAux, ModelInputsObjective, Tensors
from trainfold.core.logps import completion_logps
from trainfold.core.losses import count_key
from trainfold.kto.collate import REF_COLUMNS, UnpairedCollate
from trainfold.kto.loss import kl_estimate, kto_loss, kto_loss_errors
from trainfold.kto.reference import prepare_reference_logps, unpaired_logps
from trainfold.kto.rows import KL_COLUMN, UNPAIRED_COLUMNS

__all__ = ["KTOObjective", "kto_objective"]


def _mean(x: Tensor, rows: Tensor) -> Tensor:
    return x.sum() / rows.clamp(min=1)


@attrs.frozen(eq=False)
class KTOObjective(ModelInputsObjective):
    """The KTO objective; make one with :func:`kto_objective`.

    Returns the summed row losses divided by the step's row count (its ``num_items_in_batch``), so with
    micro-batches of one size the step's loss is TRL's mean of the micro-batch means. TRL's metrics
    ``kl``, ``rewards/{chosen,rejected,margins}``, ``logps/{chosen,rejected}``, ``logits/{chosen,rejected}``
    and ``entropy`` are each micro-batch's own value (TRL's means within the micro-batch); with
    ``aux_reduction = "micro_batch"`` a step reports their mean over its micro-batches and a log their mean over
    every micro-batch since the last log (an evaluation: over its batches), as TRL's ``log`` averages its lists.
    A micro-batch without desirable (undesirable) rows, or without their tokens, has no ``chosen``
    (``rejected``) values and no ``rewards/margins``: its ``core.losses.count_key`` entry is 0, so it is left out
    of their means (and a log whose micro-batches all lack them has none), as TRL appends nothing for it.
    """

    aux_reduction = "micro_batch"  # its metrics are each micro-batch's own values, averaged unweighted (TRL's)

    beta: float
    loss_type: str
    desirable_weight: float
    undesirable_weight: float
    ref_params: Mapping[str, Tensor] | None
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    columns = (*UNPAIRED_COLUMNS, KL_COLUMN, *REF_COLUMNS)  # the row columns train keeps for it

    @property
    def calculate_kl(self) -> bool:
        """Whether the loss reads the KL estimate (every loss type but ``apo_zero_unpaired``)."""
        return self.loss_type != "apo_zero_unpaired"

    def count_items(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count the rows of ``micro_batch``."""
        if "label" not in micro_batch:
            raise KeyError(
                f"a KTO micro-batch needs 'label' (True: desirable), has {sorted(micro_batch)}; collate the rows "
                "with unpaired_collate()"
            )
        return torch.tensor(micro_batch["label"].shape[0])

    def count_samples(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count the dataset rows of ``micro_batch``."""
        return self.count_items(micro_batch)

    def prepare(
        self,
        model: nn.Module,
        train_dataset: Any,
        eval_dataset: Any,
        collate: Any,
        *,
        device: torch.device,
        output_dir: str | os.PathLike | None = None,
        train_batch_size: int,
        eval_batch_size: int,
    ) -> tuple[KTOObjective, Any, Any]:
        """Return ``(objective, train_dataset, eval_dataset)``; with ``precompute_ref_log_probs`` the datasets carry
        the reference log-probs (scored ``train_batch_size`` (``eval_batch_size``) rows at a time unless
        ``precompute_ref_batch_size`` is set; nothing is cached in ``output_dir``) and the objective runs no
        reference forward (``trainfold.kto.reference``)."""
        if not self.precompute_ref_log_probs:
            return self, train_dataset, eval_dataset
        if not isinstance(collate, UnpairedCollate):
            raise ValueError(
                "precompute_ref_log_probs scores the rows through an UnpairedCollate: pass unpaired_collate()"
            )
        ref = self.ref_params or {k: v.detach() for k, v in model.named_parameters()}
        sizes = (self.precompute_ref_batch_size or train_batch_size, self.precompute_ref_batch_size or eval_batch_size)
        train_dataset, eval_dataset = prepare_reference_logps(
            model, ref, train_dataset, eval_dataset, collate, device=device, batch_sizes=sizes, kl=self.calculate_kl
        )
        return attrs.evolve(self, ref_params=None, precompute_ref_log_probs=False), train_dataset, eval_dataset

    def _reference(self, forward: Callable[..., Any], micro: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        if self.ref_params is None:
            missing = [k for k in REF_COLUMNS[: 1 + self.calculate_kl] if k not in micro]
            if missing:
                raise KeyError(
                    f"micro-batch lacks {missing} and kto_objective has no ref_params: pass ref_params=..., or train "
                    "with kto_objective(precompute_ref_log_probs=True)"
                )
            return micro["ref_logps"], micro["ref_KL_logps"] if self.calculate_kl else None
        with torch.no_grad():
            ref_kl = unpaired_logps(forward, self.ref_params, micro, "KL_") if self.calculate_kl else None
            return unpaired_logps(forward, self.ref_params, micro), ref_kl

    def loss_of(self, forward: Forward, params: Tensors, inputs: Tensors, micro: Tensors, n: Tensor) -> LossAux:
        if self.calculate_kl and "KL_input_ids" not in micro:
            raise KeyError(
                f"loss_type={self.loss_type!r} needs the KL sequences (KL_input_ids): prepare the rows with "
                "unpaired_rows(..., kl_batch_size=<per_device_train_batch_size>), or use loss_type='apo_zero_unpaired'"
            )
        logps, row_stats = completion_logps(forward, params, inputs, micro, None, 0)
        with torch.no_grad():
            kl_logps = unpaired_logps(forward, params, micro, "KL_") if self.calculate_kl else None
        ref_logps, ref_kl_logps = self._reference(forward, micro)
        kl = torch.zeros((), device=logps.device)  # TRL's KL without KL rows (apo_zero_unpaired)
        if kl_logps is not None and ref_kl_logps is not None:
            kl = kl_estimate(kl_logps, ref_kl_logps)
        label = micro["label"].to(device=logps.device, dtype=torch.bool)
        losses = kto_loss(
            logps, ref_logps, label, kl, self.beta, self.loss_type, self.desirable_weight, self.undesirable_weight
        )
        metrics = self._metrics(logps, ref_logps, label, kl, row_stats(), micro)
        return losses.sum() / n.to(logps.dtype), metrics

    def _metrics(
        self,
        logps: Tensor,
        ref: Tensor,
        label: Tensor,
        kl: Tensor,
        stats: Tensor,
        micro: Mapping[str, Tensor],
    ) -> dict[str, Tensor]:
        logps, dtype = logps.detach(), torch.float32
        rewards = self.beta * (logps - ref.to(logps))
        tokens = micro["completion_mask"][:, 1:].sum(1).to(stats.dtype)
        out = {"kl": kl.to(dtype).reshape(()), "entropy": _mean(stats[:, 1], tokens.sum()).to(dtype)}
        for name, rows in (("chosen", label), ("rejected", ~label)):  # every key each time: a step's metrics persist
            count, row_tokens = rows.sum().to(dtype), tokens[rows].sum()
            out[f"logits/{name}"] = _mean(stats[rows, 0], row_tokens).to(dtype)
            out[count_key(f"logits/{name}")] = (row_tokens > 0).to(dtype)
            for metric, values in (("rewards", rewards), ("logps", logps)):
                out[f"{metric}/{name}"] = _mean(values[rows].to(dtype), count)
                out[count_key(f"{metric}/{name}")] = (count > 0).to(dtype)
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        out[count_key("rewards/margins")] = out[count_key("rewards/chosen")] * out[count_key("rewards/rejected")]
        return out


def kto_objective(
    beta: float = 0.1,
    loss_type: str = "kto",
    ref_params: Mapping[str, Tensor] | None = None,
    *,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    precompute_ref_log_probs: bool = False,
    precompute_ref_batch_size: int | None = None,
) -> KTOObjective:
    """Return the KTO objective; reference from ``ref_params`` (frozen) or precomputed row columns.

    ``precompute_ref_log_probs=True`` (TRL's name): ``train`` scores the train and eval rows with the
    reference once, before the first step, in eval mode, ``precompute_ref_batch_size`` rows at a time;
    without ``ref_params`` the reference is the model as ``train`` receives it (TRL's ``ref_model=None``).
    """
    problems = kto_loss_errors(beta, loss_type, desirable_weight, undesirable_weight)
    size = precompute_ref_batch_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        problems.append(f"precompute_ref_batch_size={size!r} must be a positive int or None")
    if problems:
        raise ValueError("; ".join(problems))
    frozen = None if ref_params is None else {k: v.detach().clone() for k, v in ref_params.items()}
    return KTOObjective(
        beta=beta,
        loss_type=loss_type,
        desirable_weight=float(desirable_weight),
        undesirable_weight=float(undesirable_weight),
        ref_params=frozen,
        precompute_ref_log_probs=bool(precompute_ref_log_probs),
        precompute_ref_batch_size=precompute_ref_batch_size,
    )
