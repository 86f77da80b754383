"""The HF Trainer's optimizer from ``TrainingArguments``: clipping, then ``optim`` on the schedule.

``OPTIMIZERS`` maps every HF ``optim`` name that torch (or transformers) provides to the
``optim_args`` it takes; ``REFUSED`` names the rest and why (their optimizers live in packages
trainfold does not depend on, or are device-specific).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from trainfold.optim import GradientTransformation, adamw, chain, clip_by_global_norm, decay_mask, from_torch, sgd
from trainfold.optim.schedules import named, warmup_steps_for

__all__ = ["OPTIMIZERS", "REFUSED", "OptimizerSettings", "check_optimizer", "default_optimizer", "refused_optimizer"]

# optim -> the optim_args it takes (HF's "key=value,key=value" string), as HF's Trainer reads them
OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "adamw_torch_fused": (),
    "adamw_torch": (),
    "sgd": ("momentum", "dampening", "nesterov"),
    "adagrad": ("lr_decay", "weight_decay", "eps"),
    "rmsprop": ("momentum", "alpha", "eps", "weight_decay", "centered"),
    "adafactor": (),
}

_PACKAGE = "its optimizer comes from the {} package, which trainfold does not use; "
_FIX = "pass optimizer=trainfold.optim.from_torch(TheOptimizerClass, ...) to train() to use it anyway"
REFUSED: dict[str, str] = {
    **dict.fromkeys(("adamw_torch_xla", "adamw_torch_npu_fused"), "a device-specific fused AdamW; "),
    "adamw_anyprecision": _PACKAGE.format("torchdistx"),
    **dict.fromkeys(("adamw_torch_4bit", "adamw_torch_8bit"), _PACKAGE.format("torchao")),
    **dict.fromkeys(
        (
            "ademamix",
            "adamw_bnb_8bit",
            "adamw_8bit",
            "ademamix_8bit",
            "lion_8bit",
            "lion_32bit",
            "paged_adamw_32bit",
            "paged_adamw_8bit",
            "paged_ademamix_32bit",
            "paged_ademamix_8bit",
            "paged_lion_32bit",
            "paged_lion_8bit",
            "rmsprop_bnb",
            "rmsprop_bnb_8bit",
            "rmsprop_bnb_32bit",
        ),
        _PACKAGE.format("bitsandbytes"),
    ),
    **dict.fromkeys(
        (
            "galore_adamw",
            "galore_adamw_8bit",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
        ),
        _PACKAGE.format("galore-torch"),
    ),
    **dict.fromkeys(("apollo_adamw", "apollo_adamw_layerwise"), _PACKAGE.format("apollo-torch")),
    **dict.fromkeys(("lomo", "adalomo"), "LOMO fuses the update into backward, which a step of gradients cannot; "),
    "grokadamw": _PACKAGE.format("grokadamw"),
    **dict.fromkeys(
        ("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd"), _PACKAGE.format("schedulefree")
    ),
    "stable_adamw": _PACKAGE.format("torch-optimi"),
}


def refused_optimizer(name: str) -> str | None:
    """Return why trainfold refuses HF's ``optim=name`` (None: it supports it, or HF has no such name).

    >>> refused_optimizer("adamw_torch"), refused_optimizer("lion_8bit").split(";")[0]
    (None, 'its optimizer comes from the bitsandbytes package, which trainfold does not use')
    """
    return REFUSED[name] + _FIX if name in REFUSED else None


@attrs.frozen
class OptimizerSettings:
    """The settings the HF Trainer's optimizer is made of (``TrainingArguments.optimizer_settings()`` reads them)."""

    optim: str
    learning_rate: float
    lr_scheduler_type: str
    lr_scheduler_kwargs: dict[str, Any]
    warmup_steps: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    max_grad_norm: float
    optimizer_options: dict[str, Any]  # optim_args, parsed


def default_optimizer(model: nn.Module, args: OptimizerSettings, total_steps: int) -> GradientTransformation:
    """Return the HF Trainer's optimizer: clipping at ``max_grad_norm``, then ``optim`` on the schedule.

    ``optim`` is AdamW (torch's kernels: ``adamw_torch_fused`` the fused one, ``adamw_torch`` AdamW's default),
    ``sgd`` (``optim_args`` momentum, dampening, nesterov), or torch's ``Adagrad`` / ``RMSprop`` or
    transformers' ``Adafactor`` through ``from_torch``, with HF's arguments. Biases and normalisation
    weights are not decayed (by module type and by name).

    >>> import torch
    >>> from trainfold.trainer.args import TrainingArguments
    >>> settings = TrainingArguments(learning_rate=0.1).optimizer_settings()
    >>> [t.name for t in default_optimizer(torch.nn.Linear(2, 1), settings, total_steps=10).parts]
    ['clip_by_global_norm', 'adamw']
    >>> default_optimizer(torch.nn.Linear(2, 1), TrainingArguments(max_grad_norm=0).optimizer_settings(), 10).name
    'adamw'
    >>> settings = TrainingArguments(optim="adagrad", max_grad_norm=0).optimizer_settings()
    >>> default_optimizer(torch.nn.Linear(2, 1), settings, 10).name
    'Adagrad'
    """
    warmup = warmup_steps_for(args.warmup_steps, total_steps)
    schedule = named(
        args.lr_scheduler_type, args.learning_rate, warmup, total_steps, **(args.lr_scheduler_kwargs or {})
    )
    mask = decay_mask(model)
    if args.optim == "sgd":  # HF: torch.optim.SGD with the decay/no-decay groups, options from optim_args
        options = {"weight_decay": args.weight_decay, **args.optimizer_options}
        opt: GradientTransformation = sgd(schedule, mask=mask, **options)
    elif args.optim in ("adamw_torch", "adamw_torch_fused"):
        opt = adamw(
            schedule,
            args.adam_beta1,
            args.adam_beta2,
            args.adam_epsilon,
            args.weight_decay,
            mask=mask,
            fused=True if args.optim == "adamw_torch_fused" else None,
        )
    else:
        opt = from_torch(_torch_class(args.optim), lr=schedule, mask=mask, **_hf_options(args))
    return chain(clip_by_global_norm(args.max_grad_norm), opt) if args.max_grad_norm > 0 else opt


def _torch_class(name: str) -> type[torch.optim.Optimizer]:
    if name == "adafactor":
        try:
            from transformers.optimization import Adafactor
        except ImportError as err:
            raise ImportError("optim='adafactor' is transformers' Adafactor: pip install transformers") from err
        return Adafactor
    return {"adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}[name]


def _hf_options(args: OptimizerSettings) -> dict[str, Any]:
    """Return the keyword arguments HF's Trainer gives the optimizer of ``args.optim`` (beside ``lr``)."""
    options: dict[str, Any] = {"weight_decay": args.weight_decay}
    if args.optim == "adafactor":
        options.update(scale_parameter=False, relative_step=False)
    options.update(args.optimizer_options)
    if "centered" in options:
        options["centered"] = bool(options["centered"])
    return options


def check_optimizer(optimizer: Any) -> None:
    """Refuse a ``torch.optim.Optimizer`` object (its state would live outside the TrainState), naming the fix.

    >>> try:
    ...     check_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    ... except TypeError as err:
    ...     print(str(err).split(";")[0])
    optimizer is a torch.optim.SGD object
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        cls = type(optimizer)
        lr = optimizer.param_groups[0].get("lr", "...") if optimizer.param_groups else "..."
        raise TypeError(
            f"optimizer is a torch.optim.{cls.__name__} object; train takes a trainfold optimizer, whose state lives "
            f"in the TrainState (checkpointed, resumed bitwise): write optimizer=trainfold.optim.from_torch("
            f"{cls.__module__.split('.')[0]}.optim.{cls.__name__}, lr={lr}, ...) with the same keyword arguments "
            "(without the params: from_torch gives it the model's)"
        )
    if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}, not a trainfold optimizer (init/update); pass "
            "trainfold.optim.adamw(...), chain(...), or trainfold.optim.from_torch(torch.optim.X, lr=..., ...)"
        )
