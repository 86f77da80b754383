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

from typing import Any

import attrs

from trainfold.dpo.loss import dpo_loss_errors
from trainfold.trainer.args import TrainingArguments

__all__ = ["DPOArguments"]

_REFUSED: dict[str, tuple[Any, str]] = {
    "ld_alpha": (None, "LD-DPO's length weighting is not implemented; compose an objective"),
    "f_divergence_type": ("reverse_kl", "only the reverse KL (standard DPO) is implemented"),
    "use_weighting": (False, "WPO weighting is not implemented"),
    "sync_ref_model": (False, "the reference is frozen (TR-DPO's syncing is not implemented)"),
    "router_aux_loss_coef": (None, "MoE auxiliary losses are not added"),
    "activation_offloading": (False, "activations stay on the device"),
    "trust_remote_code": (False, "load the model yourself and pass the module"),
    "truncation_mode": ("keep_start", "keep_end is deprecated in TRL; truncation keeps the start"),
}
_DEFAULTS = {"learning_rate": 1e-6, "logging_steps": 10, "gradient_checkpointing": True, "max_length": 1024}


@attrs.frozen(init=False)
class DPOArguments(TrainingArguments):
    """``TrainingArguments`` plus ``DPOConfig``'s DPO settings (see the module doc).

    ``loss_type`` takes one name or a list (mixed by ``loss_weights``, TRL's MPO).

    >>> DPOArguments(loss_type=["sigmoid", "sft"], loss_weights=[1, 0.5], bf16=False).loss_weights
    (1.0, 0.5)
    """

    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    disable_dropout: bool = True
    truncation_mode: str = "keep_start"
    model_init_kwargs: dict[str, Any] | None = None
    dataset_num_proc: int | None = None  # accepted; preparation runs in this process
    pad_token: str | None = None
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    use_weighting: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    router_aux_loss_coef: float | None = None
    activation_offloading: bool = False
    trust_remote_code: bool = False

    def __init__(self, **kwargs: Any) -> None:
        kwargs = {**_DEFAULTS, "bf16": not kwargs.get("fp16", False), **kwargs}
        if isinstance(kwargs.get("loss_type"), (str, list)):
            kwargs["loss_type"] = (
                (kwargs["loss_type"],) if isinstance(kwargs["loss_type"], str) else tuple(kwargs["loss_type"])
            )
        if isinstance(kwargs.get("loss_weights"), list):
            kwargs["loss_weights"] = tuple(float(w) for w in kwargs["loss_weights"])
        super().__init__(**kwargs)

    def __attrs_post_init__(self) -> None:
        dpo = [
            f"{name}={getattr(self, name)!r} is not supported: {why}; set {name}={value!r}"
            for name, (value, why) in _REFUSED.items()
            if getattr(self, name) != value
        ]
        dpo += dpo_loss_errors(self.beta, self.loss_type, self.label_smoothing, self.loss_weights, self.discopop_tau)
        try:
            super().__attrs_post_init__()
        except ValueError as e:
            raise ValueError("\n  - ".join([str(e).replace("TrainingArguments", "DPOArguments"), *dpo])) from None
        if dpo:
            raise ValueError("invalid DPOArguments:\n  - " + "\n  - ".join(dpo))
