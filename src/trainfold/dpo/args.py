"""``DPOArguments``: ``TrainingArguments`` plus TRL 1.16 ``DPOConfig``'s settings, with its names and defaults.

``max_length`` (1024), ``pad_to_multiple_of`` and ``padding_free`` (one flattened row per micro-batch,
``trainfold.dpo.data``) are ``TrainingArguments``' names;
``learning_rate`` defaults to 1e-6, ``logging_steps`` to 10, ``gradient_checkpointing`` on and ``bf16`` on
unless ``fp16``, as ``DPOConfig``. Settings trainfold does not do are refused by name.

>>> args = DPOArguments(bf16=False, gradient_checkpointing=False)
>>> args.beta, args.loss_type, args.max_length, args.learning_rate
(0.1, ('sigmoid',), 1024, 1e-06)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from trainfold.dpo.loss import dpo_loss_errors
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.setting import ONE_PROCESS, redeclared, setting

__all__ = ["DPOArguments"]

_BASE = attrs.fields(TrainingArguments)
_NO_ALPHA = "it weighs the alpha divergence, which trainfold does not do (f_divergence_type='reverse_kl' only)"
_NO_SYNC = "it sets TR-DPO's reference syncing, which trainfold does not do (sync_ref_model=False only)"


def _loss_problems(a: DPOArguments) -> list[str]:
    return dpo_loss_errors(a.beta, a.loss_type, a.label_smoothing, a.loss_weights, a.discopop_tau)


@attrs.frozen(init=False)
class DPOArguments(TrainingArguments):
    """``TrainingArguments`` plus ``DPOConfig``'s DPO settings (see the module doc).

    ``loss_type`` takes one name or a list (mixed by ``loss_weights``, TRL's MPO).

    >>> DPOArguments(loss_type=["sigmoid", "sft"], loss_weights=[1, 0.5], bf16=False).loss_weights
    (1.0, 0.5)
    """

    # DPOConfig's defaults where they differ from TrainingArguments' (bf16: on unless fp16)
    learning_rate: float = redeclared(_BASE.learning_rate, 1e-6)
    logging_steps: float = redeclared(_BASE.logging_steps, 10)
    gradient_checkpointing: bool | None = redeclared(_BASE.gradient_checkpointing, True)
    max_length: int | None = redeclared(_BASE.max_length, 1024)
    bf16: bool = redeclared(_BASE.bf16, attrs.Factory(lambda self: not self.fp16, takes_self=True))
    beta: float = 0.1  # with loss_type, loss_weights, label_smoothing, discopop_tau: recipes.dpo_loss_errors
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = setting(None, range="[1, inf)")
    disable_dropout: bool = True
    truncation_mode: str = setting(
        "keep_start", only=("keep_start", "keep_end is deprecated in TRL; truncation keeps the start")
    )
    model_init_kwargs: dict[str, Any] | None = None
    dataset_num_proc: int | None = setting(None, only=(None, ONE_PROCESS))
    pad_token: str | None = None
    ld_alpha: float | None = setting(
        None, only=(None, "LD-DPO's length weighting is not implemented; compose an objective")
    )
    f_divergence_type: str = setting(
        "reverse_kl", only=("reverse_kl", "only the reverse KL (standard DPO) is implemented")
    )
    f_alpha_divergence_coef: float = setting(0.5, only=(0.5, _NO_ALPHA))
    use_weighting: bool = setting(False, only=(False, "WPO weighting is not implemented"))
    sync_ref_model: bool = setting(False, only=(False, "the reference is frozen (TR-DPO's syncing is not implemented)"))
    ref_model_mixup_alpha: float = setting(0.6, only=(0.6, _NO_SYNC))
    ref_model_sync_steps: int = setting(512, only=(512, _NO_SYNC))
    router_aux_loss_coef: float | None = setting(None, only=(None, "MoE auxiliary losses are not added"))
    activation_offloading: bool = setting(False, only=(False, "activations stay on the device"))
    trust_remote_code: bool = setting(False, only=(False, "load the model yourself and pass the module"))

    @classmethod
    def combined_checks(cls) -> tuple[Callable[[Any], list[str]], ...]:
        """Return ``TrainingArguments``' checks of settings together, and the DPO loss's."""
        return (*super().combined_checks(), _loss_problems)
