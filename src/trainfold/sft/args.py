"""``SFTArguments``: ``TrainingArguments`` plus TRL 1.16 ``SFTConfig``'s settings, with its names and defaults.

``packing``, ``packing_strategy``, ``padding_free``, ``pad_to_multiple_of`` and ``max_length`` are
``TrainingArguments``' own (``trainfold.data.llm``); ``SFTArguments`` gives ``max_length`` TRL's default
1024, ``learning_rate`` 2e-5, ``logging_steps`` 10, ``gradient_checkpointing`` on and ``bf16`` on unless
``fp16``, as ``SFTConfig`` does. Settings trainfold cannot honour are refused by name.

>>> args = SFTArguments(bf16=False, gradient_checkpointing=False)
>>> args.max_length, args.learning_rate, args.completion_only_loss, args.dataset_text_field
(1024, 2e-05, None, 'text')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.setting import ONE_PROCESS, redeclared, setting

__all__ = ["SFTArguments"]

_BASE = attrs.fields(TrainingArguments)


def _packing_problems(a: SFTArguments) -> list[str]:
    out = []
    if a.padding_free and not a.packing and a.max_length is not None:
        out.append(
            "padding_free=True without packing does not enforce max_length (as TRL refuses it): enable packing, "
            "or set max_length=None with rows already short enough"
        )
    if a.packing and a.max_length is None:
        out.append("packing=True needs max_length (the packed row length)")
    return out


@attrs.frozen(init=False)
class SFTArguments(TrainingArguments):
    """``TrainingArguments`` plus ``SFTConfig``'s data and loss settings (see the module doc).

    >>> SFTArguments(fp16=True, gradient_checkpointing=False).bf16
    False
    """

    # SFTConfig's defaults where they differ from TrainingArguments' (bf16: on unless fp16)
    learning_rate: float = redeclared(_BASE.learning_rate, 2e-5)
    logging_steps: float = redeclared(_BASE.logging_steps, 10)
    gradient_checkpointing: bool | None = redeclared(_BASE.gradient_checkpointing, True)
    max_length: int | None = redeclared(_BASE.max_length, 1024)
    bf16: bool = redeclared(_BASE.bf16, attrs.Factory(lambda self: not self.fp16, takes_self=True))
    # from_pretrained's keywords when the model is a name or path
    model_init_kwargs: dict[str, Any] | None = None
    trust_remote_code: bool = setting(False, only=(False, "load the model yourself and pass the module"))
    router_aux_loss_coef: float | None = setting(
        None, only=(None, "MoE auxiliary losses are not added; compose an objective")
    )
    chat_template_path: str | None = setting(
        None, only=(None, "set the tokenizer's chat_template before calling train")
    )
    dataset_text_field: str = "text"
    dataset_kwargs: dict[str, Any] | None = None  # {"skip_prepare_dataset": True}: rows are used as given
    dataset_num_proc: int | None = setting(None, only=(None, ONE_PROCESS))
    eos_token: str | None = None
    truncation_mode: str = setting("keep_start", choices=("keep_start", "keep_end"))
    shuffle_dataset: bool = False
    eval_packing: bool | None = None  # None: as packing
    completion_only_loss: bool | None = None  # None: on for prompt-completion rows
    assistant_only_loss: bool = False
    loss_type: str = setting(
        "nll", only=("nll", "the loss is the causal-LM token mean; for a chunked one set loss_chunk_size")
    )
    activation_offloading: bool = setting(False, only=(False, "activations stay on the device"))
    pad_token: str | None = None

    @classmethod
    def combined_checks(cls) -> tuple[Callable[[Any], list[str]], ...]:
        """Return ``TrainingArguments``' checks of settings together, and SFT's packing ones."""
        return (*super().combined_checks(), _packing_problems)
