"""``KTOArguments``: ``TrainingArguments`` plus TRL 1.16 ``KTOConfig``'s settings, with its names and defaults.

``max_length`` (1024) and ``pad_to_multiple_of`` are ``TrainingArguments``' names; ``learning_rate``
defaults to 1e-6, ``logging_steps`` to 10, ``train_sampling_strategy`` to ``"sequential"`` (the KL
completions pair each row with its neighbours in a fixed-order batch), ``gradient_checkpointing`` on and
``bf16`` on unless ``fp16``, as ``KTOConfig``. Each setting is declared once (``trainfold.trainer.setting``);
settings trainfold does not do are refused by name.

>>> args = KTOArguments(bf16=False, gradient_checkpointing=False)
>>> args.beta, args.loss_type, args.desirable_weight, args.train_sampling_strategy, args.learning_rate
(0.1, 'kto', 1.0, 'sequential', 1e-06)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from trainfold.kto.loss import kto_loss_errors
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.setting import ONE_PROCESS, redeclared, setting

__all__ = ["KTOArguments"]

_BASE = attrs.fields(TrainingArguments)
_NO_SYNC = "it sets TR-DPO's reference syncing, which trainfold does not do (sync_ref_model=False only)"


def _kto_problems(a: KTOArguments) -> list[str]:
    out = kto_loss_errors(a.beta, a.loss_type, a.desirable_weight, a.undesirable_weight)
    if a.loss_type == "apo_zero_unpaired":  # no KL term: any order, any batch size
        return out
    sampling, batch = attrs.fields(type(a)).train_sampling_strategy, attrs.fields(type(a)).per_device_train_batch_size
    if a.train_sampling_strategy != sampling.default:
        out.append(
            f"loss_type={a.loss_type!r} estimates the KL term from each row's neighbours in a fixed-order batch and "
            f"needs {sampling.name}={sampling.default!r}, got {a.train_sampling_strategy!r}"
        )
    if a.per_device_train_batch_size <= 1:
        out.append(
            f"{batch.name}={a.per_device_train_batch_size} leaves no mismatched pair for the KL term (it would "
            "equal the implied reward); use a batch size > 1, as TRL requires"
        )
    return out


@attrs.frozen(init=False)
class KTOArguments(TrainingArguments):
    """``TrainingArguments`` plus ``KTOConfig``'s KTO settings (see the module doc).

    >>> KTOArguments(loss_type="apo_zero_unpaired", train_sampling_strategy="random", bf16=False).loss_type
    'apo_zero_unpaired'
    """

    # KTOConfig's defaults where they differ from TrainingArguments' (bf16: on unless fp16)
    learning_rate: float = redeclared(_BASE.learning_rate, 1e-6)
    logging_steps: float = redeclared(_BASE.logging_steps, 10)
    gradient_checkpointing: bool | None = redeclared(_BASE.gradient_checkpointing, True)
    max_length: int | None = redeclared(_BASE.max_length, 1024)
    bf16: bool = redeclared(_BASE.bf16, attrs.Factory(lambda self: not self.fp16, takes_self=True))
    train_sampling_strategy: str = redeclared(_BASE.train_sampling_strategy, "sequential")
    padding_free: bool = redeclared(
        _BASE.padding_free, False, only=(False, "KTOTrainer has no padding-free mode; rows are padded as TRL pads them")
    )
    beta: float = 0.1  # with loss_type, desirable_weight, undesirable_weight: kto.loss.kto_loss_errors
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = setting(None, range="[1, inf)")
    disable_dropout: bool = True
    model_init_kwargs: dict[str, Any] | None = None  # from_pretrained's keywords when the model is a name or path
    dataset_num_proc: int | None = setting(None, only=(None, ONE_PROCESS))
    trust_remote_code: bool = setting(False, only=(False, "load the model yourself and pass the module"))
    router_aux_loss_coef: float | None = setting(None, only=(None, "MoE auxiliary losses are not added"))
    activation_offloading: bool = setting(False, only=(False, "activations stay on the device"))
    sync_ref_model: bool = setting(False, only=(False, "the reference is frozen (TR-DPO's syncing is not implemented)"))
    ref_model_mixup_alpha: float = setting(0.6, only=(0.6, _NO_SYNC))
    ref_model_sync_steps: int = setting(512, only=(512, _NO_SYNC))

    @classmethod
    def combined_checks(cls) -> tuple[Callable[[Any], list[str]], ...]:
        """Return ``TrainingArguments``' checks of settings together, and KTO's (its loss, its KL estimate's)."""
        return (*super().combined_checks(), _kto_problems)
