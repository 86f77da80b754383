"""``RewardArguments``: ``TrainingArguments`` plus TRL 1.16 ``RewardConfig``'s settings, with its names and defaults.

``learning_rate`` 1e-4, ``logging_steps`` 10, ``gradient_checkpointing`` on, ``bf16`` on unless ``fp16``,
``max_length`` 1024 (pairs with a longer side are dropped), ``disable_dropout`` on, as ``RewardConfig``.
Each setting is declared once (``trainfold.trainer.setting``); settings trainfold cannot honour are refused
by name.

>>> args = RewardArguments(bf16=False)
>>> args.learning_rate, args.max_length, args.center_rewards_coefficient, args.disable_dropout
(0.0001, 1024, None, True)
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.setting import ONE_PROCESS, redeclared, setting

__all__ = ["RewardArguments"]

_BASE = attrs.fields(TrainingArguments)


@attrs.frozen(init=False)
class RewardArguments(TrainingArguments):
    """``TrainingArguments`` plus ``RewardConfig``'s settings (see the module doc)."""

    # RewardConfig's defaults where they differ from TrainingArguments' (bf16: on unless fp16)
    learning_rate: float = redeclared(_BASE.learning_rate, 1e-4)
    logging_steps: float = redeclared(_BASE.logging_steps, 10)
    gradient_checkpointing: bool | None = redeclared(_BASE.gradient_checkpointing, True)
    max_length: int | None = redeclared(_BASE.max_length, 1024)
    bf16: bool = redeclared(_BASE.bf16, attrs.Factory(lambda self: not self.fp16, takes_self=True))
    model_init_kwargs: dict[str, Any] | None = None  # from_pretrained's keywords when the model is a name or path
    trust_remote_code: bool = setting(False, only=(False, "load the model yourself and pass the module"))
    chat_template_path: str | None = setting(
        None, only=(None, "set the tokenizer's chat_template before calling train")
    )
    disable_dropout: bool = True
    dataset_num_proc: int | None = setting(None, only=(None, ONE_PROCESS))
    eos_token: str | None = None  # appended to each side (None: the tokenizer's)
    center_rewards_coefficient: float | None = setting(None, range="[0, inf)", hint="TRL suggests 0.01")
    activation_offloading: bool = setting(False, only=(False, "activations stay on the device"))
    pad_token: str | None = None  # None: the tokenizer's, else its EOS
