"""``KTOArguments``: ``TrainingArguments`` plus TRL 1.16 ``KTOConfig``'s settings, with its names and defaults.

``max_length`` (1024) and ``pad_to_multiple_of`` are ``TrainingArguments``' names; ``learning_rate``
defaults to 1e-6, ``logging_steps`` to 10, ``train_sampling_strategy`` to ``"sequential"`` (the KL
completions pair each row with its neighbours in a fixed-order batch), ``gradient_checkpointing`` on and
``bf16`` on unless ``fp16``, as ``KTOConfig``. Settings trainfold does not do are refused by name.

>>> args = KTOArguments(bf16=False, gradient_checkpointing=False)
>>> args.beta, args.loss_type, args.desirable_weight, args.train_sampling_strategy, args.learning_rate
(0.1, 'kto', 1.0, 'sequential', 1e-06)
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold.kto.loss import kto_loss_errors
from trainfold.trainer.args import TrainingArguments

__all__ = ["KTOArguments"]

_REFUSED: dict[str, tuple[Any, str]] = {
    "sync_ref_model": (False, "the reference is frozen (TR-DPO's syncing is not implemented)"),
    "router_aux_loss_coef": (None, "MoE auxiliary losses are not added"),
    "activation_offloading": (False, "activations stay on the device"),
    "trust_remote_code": (False, "load the model yourself and pass the module"),
    "padding_free": (False, "KTOTrainer has no padding-free mode; rows are padded as TRL pads them"),
}
_DEFAULTS = {
    "learning_rate": 1e-6,
    "logging_steps": 10,
    "gradient_checkpointing": True,
    "max_length": 1024,
    "train_sampling_strategy": "sequential",
}


@attrs.frozen(init=False)
class KTOArguments(TrainingArguments):
    """``TrainingArguments`` plus ``KTOConfig``'s KTO settings (see the module doc).

    >>> KTOArguments(loss_type="apo_zero_unpaired", train_sampling_strategy="random", bf16=False).loss_type
    'apo_zero_unpaired'
    """

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    disable_dropout: bool = True
    model_init_kwargs: dict[str, Any] | None = None
    dataset_num_proc: int | None = None  # accepted; preparation runs in this process
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    activation_offloading: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    def __init__(self, **kwargs: Any) -> None:
        kwargs = {**_DEFAULTS, "bf16": not kwargs.get("fp16", False), **kwargs}
        if kwargs.get("pad_to_multiple_of") == "auto":  # KTOConfig's default: no padding off Neuron
            kwargs["pad_to_multiple_of"] = None
        super().__init__(**kwargs)

    def __attrs_post_init__(self) -> None:
        kto = [
            f"{name}={getattr(self, name)!r} is not supported: {why}; set {name}={value!r}"
            for name, (value, why) in _REFUSED.items()
            if getattr(self, name) != value
        ]
        kto += kto_loss_errors(self.beta, self.loss_type, self.desirable_weight, self.undesirable_weight)
        if self.loss_type != "apo_zero_unpaired" and self.train_sampling_strategy != "sequential":
            kto.append(
                f"loss_type={self.loss_type!r} estimates the KL term from each row's neighbours in a fixed-order "
                f"batch and needs train_sampling_strategy='sequential', got {self.train_sampling_strategy!r}"
            )
        if self.loss_type != "apo_zero_unpaired" and self.per_device_train_batch_size <= 1:
            kto.append(
                f"per_device_train_batch_size={self.per_device_train_batch_size} leaves no mismatched pair for the "
                "KL term (it would equal the implied reward); use a batch size > 1, as TRL requires"
            )
        try:
            super().__attrs_post_init__()
        except ValueError as e:
            raise ValueError("\n  - ".join([str(e).replace("TrainingArguments", "KTOArguments"), *kto])) from None
        if kto:
            raise ValueError("invalid KTOArguments:\n  - " + "\n  - ".join(kto))
