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

from typing import Any

import attrs

from trainfold.trainer.args import TrainingArguments

__all__ = ["SFTArguments"]

# SFTConfig settings whose other values trainfold does not do: name -> (the value it does, why)
_REFUSED: dict[str, tuple[Any, str]] = {
    "loss_type": ("nll", "the loss is the causal-LM token mean; for a chunked one set loss_chunk_size"),
    "chat_template_path": (None, "set the tokenizer's chat_template before calling train"),
    "router_aux_loss_coef": (None, "MoE auxiliary losses are not added; compose an objective"),
    "activation_offloading": (False, "activations stay on the device"),
    "trust_remote_code": (False, "load the model yourself and pass the module"),
}
_DEFAULTS = {"learning_rate": 2e-5, "logging_steps": 10, "gradient_checkpointing": True, "max_length": 1024}


def _problems(a: SFTArguments) -> list[str]:
    out = [
        f"{name}={getattr(a, name)!r} is not supported: {why}; set {name}={value!r}"
        for name, (value, why) in _REFUSED.items()
        if getattr(a, name) != value
    ]
    if a.truncation_mode not in ("keep_start", "keep_end"):
        out.append(f"truncation_mode={a.truncation_mode!r} is not one of ['keep_start', 'keep_end']")
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

    model_init_kwargs: dict[str, Any] | None = None  # from_pretrained's keywords when the model is a name or path
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    chat_template_path: str | None = None
    dataset_text_field: str = "text"
    dataset_kwargs: dict[str, Any] | None = None  # {"skip_prepare_dataset": True}: rows are used as given
    dataset_num_proc: int | None = None  # accepted; preparation runs in this process
    eos_token: str | None = None
    truncation_mode: str = "keep_start"
    shuffle_dataset: bool = False
    eval_packing: bool | None = None  # None: as packing
    completion_only_loss: bool | None = None  # None: on for prompt-completion rows
    assistant_only_loss: bool = False
    loss_type: str = "nll"
    activation_offloading: bool = False
    pad_token: str | None = None

    def __init__(self, **kwargs: Any) -> None:
        kwargs = {**_DEFAULTS, "bf16": not kwargs.get("fp16", False), **kwargs}
        super().__init__(**kwargs)

    def __attrs_post_init__(self) -> None:
        sft = _problems(self)
        try:
            super().__attrs_post_init__()
        except ValueError as e:
            raise ValueError("\n  - ".join([str(e).replace("TrainingArguments", "SFTArguments"), *sft])) from None
        if sft:
            raise ValueError("invalid SFTArguments:\n  - " + "\n  - ".join(sft))
