"""``RewardArguments``: ``TrainingArguments`` plus TRL 1.16 ``RewardConfig``'s settings, with its names and defaults.

``learning_rate`` 1e-4, ``logging_steps`` 10, ``gradient_checkpointing`` on, ``bf16`` on unless ``fp16``,
``max_length`` 1024 (pairs with a longer side are dropped), ``disable_dropout`` on, as ``RewardConfig``.
Settings trainfold cannot honour are refused by name.

>>> args = RewardArguments(bf16=False)
>>> args.learning_rate, args.max_length, args.center_rewards_coefficient, args.disable_dropout
(0.0001, 1024, None, True)
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold.trainer.args import TrainingArguments

__all__ = ["RewardArguments"]

# RewardConfig settings whose other values trainfold does not do: name -> (the value it does, why)
_REFUSED: dict[str, tuple[Any, str]] = {
    "chat_template_path": (None, "set the tokenizer's chat_template before calling train"),
    "activation_offloading": (False, "activations stay on the device"),
    "trust_remote_code": (False, "load the model yourself and pass the module"),
}
_DEFAULTS = {"learning_rate": 1e-4, "logging_steps": 10, "gradient_checkpointing": True, "max_length": 1024}


@attrs.frozen(init=False)
class RewardArguments(TrainingArguments):
    """``TrainingArguments`` plus ``RewardConfig``'s settings (see the module doc)."""

    model_init_kwargs: dict[str, Any] | None = None  # from_pretrained's keywords when the model is a name or path
    trust_remote_code: bool = False
    chat_template_path: str | None = None
    disable_dropout: bool = True
    dataset_num_proc: int | None = None  # accepted; preparation runs in this process
    eos_token: str | None = None
    center_rewards_coefficient: float | None = None
    activation_offloading: bool = False
    pad_token: str | None = None

    def __init__(self, **kwargs: Any) -> None:
        kwargs = {**_DEFAULTS, "bf16": not kwargs.get("fp16", False), **kwargs}
        if kwargs.get("pad_to_multiple_of") == "auto":  # TRL's: 128 on Neuron only
            kwargs["pad_to_multiple_of"] = None
        super().__init__(**kwargs)

    def __attrs_post_init__(self) -> None:
        found = [
            f"{name}={getattr(self, name)!r} is not supported: {why}; set {name}={value!r}"
            for name, (value, why) in _REFUSED.items()
            if getattr(self, name) != value
        ]
        c = self.center_rewards_coefficient
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0):
            found.append(f"center_rewards_coefficient={c!r} must be a number >= 0 or None (TRL suggests 0.01)")
        try:
            super().__attrs_post_init__()
        except ValueError as e:
            raise ValueError("\n  - ".join([str(e).replace("TrainingArguments", "RewardArguments"), *found])) from None
        if found:
            raise ValueError("invalid RewardArguments:\n  - " + "\n  - ".join(found))
