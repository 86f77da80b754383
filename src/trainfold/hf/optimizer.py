"""The HF Trainer's default optimizer from ``TrainingArguments``: clipping, then AdamW or SGD on the schedule."""

from __future__ import annotations

from typing import Any

from torch import nn

from trainfold.optim import GradientTransformation, adamw, chain, clip_by_global_norm, decay_mask, sgd
from trainfold.optim.schedules import named, warmup_steps_for

__all__ = ["default_optimizer"]


def default_optimizer(model: nn.Module, args: Any, total_steps: int) -> GradientTransformation:
    """Return the HF Trainer's optimizer: clipping at ``max_grad_norm``, then ``optim`` on the schedule.

    ``optim`` is AdamW (``adamw_torch_fused``: torch's fused kernel; ``adamw_torch``: foreach ops)
    or ``sgd`` (``optim_args`` momentum, dampening, nesterov). Biases and normalisation weights are
    not decayed (by module type and by name).

    >>> import torch
    >>> from trainfold.hf.args import TrainingArguments
    >>> opt = default_optimizer(torch.nn.Linear(2, 1), TrainingArguments(learning_rate=0.1), total_steps=10)
    >>> [t.name for t in opt.parts]
    ['clip_by_global_norm', 'adamw']
    >>> default_optimizer(torch.nn.Linear(2, 1), TrainingArguments(max_grad_norm=0), total_steps=10).name
    'adamw'
    """
    warmup = warmup_steps_for(args.warmup_steps, total_steps)
    schedule = named(
        args.lr_scheduler_type, args.learning_rate, warmup, total_steps, **(args.lr_scheduler_kwargs or {})
    )
    if args.optim == "sgd":  # HF: torch.optim.SGD with the decay/no-decay groups, options from optim_args
        options = {"weight_decay": args.weight_decay, **args.optimizer_options}
        opt = sgd(schedule, mask=decay_mask(model), **options)
    else:
        opt = adamw(
            schedule,
            args.adam_beta1,
            args.adam_beta2,
            args.adam_epsilon,
            args.weight_decay,
            mask=decay_mask(model),
            implementation="fused" if args.optim == "adamw_torch_fused" else "foreach",
        )
    return chain(clip_by_global_norm(args.max_grad_norm), opt) if args.max_grad_norm > 0 else opt
