"""The checks of ``TrainingArguments`` settings that work together: optimizer, checkpoints, LLM, FSDP."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["OPTIMIZERS", "FSDP_FULL_SHARD", "optim_problems", "combination_problems"]

from trainfold.step.fsdp import FSDP_OPTIONS, fsdp_problems, fsdp_words
from trainfold.trainer.optimizer import OPTIMIZERS


def optim_problems(args: Any) -> list[str]:
    """Return what is wrong with ``optim_args`` for ``optim`` (``optim`` itself is checked on its field)."""
    if args.optim not in OPTIMIZERS:
        return []
    items = [i for i in (args.optim_args or "").replace(" ", "").split(",") if i]
    bad = [i for i in items if "=" not in i]
    if bad:
        return [f"optim_args must be 'key=value,key=value', got {args.optim_args!r}"]
    keys = [i.split("=", 1)[0] for i in items]
    unknown = [k for k in keys if k not in OPTIMIZERS[args.optim]]
    if unknown:
        return [f"optim_args {unknown} are not taken by optim={args.optim!r} (it takes {list(OPTIMIZERS[args.optim])})"]
    try:
        options = args.optimizer_options
    except ValueError:
        return [f"optim_args values must be numbers (nesterov, centered: true/false), got {args.optim_args!r}"]
    return [
        f"optim_args {k}={v} is not a finite number"
        for k, v in options.items()
        if isinstance(v, float) and not math.isfinite(v)
    ]


def _checkpointing_problems(args: Any) -> list[str]:
    out = []
    a, b = args.activation_checkpointing, args.gradient_checkpointing
    if a is not None and b is not None and a != b:
        out.append(
            f"activation_checkpointing={a!r} and its older name gradient_checkpointing={b!r} disagree; set only it"
        )
    ka, kb = args.activation_checkpointing_kwargs, args.gradient_checkpointing_kwargs
    if ka is not None and kb is not None and ka != kb:
        out.append(
            f"activation_checkpointing_kwargs={ka!r} and its older name gradient_checkpointing_kwargs={kb!r} disagree; "
            "set only activation_checkpointing_kwargs"
        )
    kwargs = args.checkpointing_kwargs
    unknown = sorted(set(kwargs) - {"every_n_layers", "use_reentrant"})
    if unknown:
        out.append(
            f"activation_checkpointing_kwargs {unknown} are not supported (supported: every_n_layers, "
            "use_reentrant=False)"
        )
    if kwargs.get("use_reentrant", False):
        out.append(
            "activation_checkpointing_kwargs use_reentrant=True is not supported: the step takes gradients "
            "with torch.autograd.grad, which needs the non-reentrant checkpoint (the default)"
        )
    every = kwargs.get("every_n_layers", 1)
    if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        out.append(f"activation_checkpointing_kwargs every_n_layers must be an int >= 1, got {every!r}")
    if (args.activation_checkpointing or args.gradient_checkpointing) and args.compile:
        out.append("activation_checkpointing with torch_compile is not supported yet; choose one of the two")
    return out


def _llm_problems(args: Any) -> list[str]:
    out = []
    if (args.packing or args.padding_free) and args.neftune_noise_alpha is not None:
        out.append(
            "neftune_noise_alpha scales its noise by each sequence's length, which packed and padding-free "
            "rows do not carry; turn NEFTune or packing/padding_free off"
        )
    return out


FSDP_FULL_SHARD = FSDP_OPTIONS  # the fsdp= words trainfold takes (torch's fully_shard does each exactly)


def _fsdp_problems(args: Any) -> list[str]:
    out = fsdp_problems(args.fsdp, args.fsdp_config)
    if not fsdp_words(args.fsdp):
        return out
    if args.fp16:
        out.append("fsdp='full_shard' with fp16 (loss scaling) is not supported; use bf16=True")
    if args.compile:
        out.append(
            "fsdp='full_shard' with torch_compile is not supported: the compiled step cannot run FSDP2's hooks; "
            "drop torch_compile for a sharded run"
        )
    return out


def combination_problems(args: Any) -> list[str]:
    out = _checkpointing_problems(args) + _llm_problems(args) + _fsdp_problems(args)
    if args.fp16 and args.bf16:
        out.append("fp16=True and bf16=True: choose one")
    if args.fp16 and args.compile:
        out.append("fp16 (loss scaling) with torch_compile is not supported yet; use bf16 with torch_compile")
    if args.eval_on_start and args.eval_strategy == "no":
        out.append("eval_on_start=True needs eval_strategy 'steps' or 'epoch' (it is 'no')")
    if args.save_strategy == "best" and args.metric_key is None:
        out.append("save_strategy='best' needs metric_for_best_model")
    if args.save_strategy == "best" and args.eval_strategy == "no":
        out.append("save_strategy='best' needs an eval_strategy other than 'no' to measure the metric")
    if args.load_best_model_at_end:
        if args.eval_strategy == "no":
            out.append("load_best_model_at_end=True needs eval_strategy 'steps' or 'epoch'")
        elif args.save_strategy not in (args.eval_strategy, "best"):
            out.append(
                f"load_best_model_at_end=True needs save_strategy to match eval_strategy "
                f"({args.save_strategy!r} vs {args.eval_strategy!r}) or be 'best'"
            )
        elif args.save_strategy == "steps" == args.eval_strategy and args.eval_steps is not None:
            if args.save_steps % args.eval_steps:
                out.append(
                    f"load_best_model_at_end=True needs save_steps ({args.save_steps}) to be a multiple "
                    f"of eval_steps ({args.eval_steps})"
                )
    return out
