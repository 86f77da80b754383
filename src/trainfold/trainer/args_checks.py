"""The checks of single ``TrainingArguments`` settings (type, finiteness, range, vocabulary), one by one."""

from __future__ import annotations

import math
from typing import Any

import attrs

from trainfold.ckpt.policy import SAVE_STRATEGIES
from trainfold.data import loader_errors
from trainfold.data.samplers import STRATEGIES as SAMPLING_STRATEGIES
from trainfold.evaluation.schedule import EVAL_STRATEGIES
from trainfold.observe import LOGGING_STRATEGIES, TOKEN_COUNTS
from trainfold.observe.reporters import LOG_LEVELS, REPORTERS
from trainfold.optim.schedules import schedule_kwargs_problems
from trainfold.trainer.args_features import combination_problems, optim_problems

__all__ = ["TYPES", "problems"]

_NUM = (int, float)
_OPT_INT = (int, type(None))
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))

TYPES: dict[str, tuple[type, ...]] = {
    "output_dir": (str,),
    "overwrite_output_dir": (bool,),
    "num_train_epochs": _NUM,
    "max_steps": (int,),
    "per_device_train_batch_size": (int,),
    "per_device_eval_batch_size": (int,),
    "gradient_accumulation_steps": (int,),
    "learning_rate": _NUM,
    "weight_decay": _NUM,
    "adam_beta1": _NUM,
    "adam_beta2": _NUM,
    "adam_epsilon": _NUM,
    "max_grad_norm": _NUM,
    "optim": (str,),
    "optim_args": _OPT_STR,
    "lr_scheduler_type": (str,),
    "lr_scheduler_kwargs": (dict, type(None)),
    "warmup_steps": _NUM,
    "seed": (int,),
    "data_seed": _OPT_INT,
    "train_sampling_strategy": (str,),
    "length_column_name": (str,),
    "model_input_name": (str,),
    "eval_strategy": (str,),
    "eval_steps": _OPT_NUM,
    "eval_on_start": (bool,),
    "eval_delay": _NUM,
    "eval_accumulation_steps": _OPT_INT,
    "prediction_loss_only": (bool,),
    "include_for_metrics": (tuple,),
    "dataloader_num_workers": (int,),
    "dataloader_persistent_workers": (bool,),
    "dataloader_prefetch_factor": _OPT_INT,
    "dataloader_pin_memory": (bool,),
    "dataloader_drop_last": (bool,),
    "remove_unused_columns": (bool,),
    "label_names": (tuple,),
    "neftune_noise_alpha": _OPT_NUM,
    "label_smoothing_factor": _NUM,
    "logging_strategy": (str,),
    "logging_steps": _NUM,
    "logging_first_step": (bool,),
    "logging_nan_inf_filter": (bool,),
    "include_num_input_tokens_seen": (str, bool),
    "report_to": (str, tuple),
    "run_name": _OPT_STR,
    "logging_dir": _OPT_STR,
    "disable_tqdm": (bool, type(None)),
    "log_level": (str,),
    "save_strategy": (str,),
    "save_steps": _NUM,
    "save_total_limit": _OPT_INT,
    "save_only_model": (bool,),
    "async_save": (bool,),
    "save_consolidated_model": (bool,),
    "metric_for_best_model": _OPT_STR,
    "greater_is_better": (bool, type(None)),
    "load_best_model_at_end": (bool,),
    "enable_jit_checkpoint": (bool,),
    "restore_callback_states_from_checkpoint": (bool,),
    "use_cpu": (bool,),
    "bf16": (bool,),
    "fp16": (bool,),
    "torch_compile": (bool,),
    "torch_compile_backend": _OPT_STR,
    "torch_compile_mode": _OPT_STR,
    "activation_checkpointing": (bool, type(None)),
    "activation_checkpointing_kwargs": (dict, type(None)),
    "gradient_checkpointing": (bool, type(None)),
    "gradient_checkpointing_kwargs": (dict, type(None)),
    "packing": (bool,),
    "packing_strategy": (str,),
    "max_length": _OPT_INT,
    "padding_free": (bool,),
    "loss_chunk_size": (int,),
    "pad_to_multiple_of": _OPT_INT,
    "fsdp": (str, tuple, type(None)),
    "fsdp_config": (dict, type(None)),
}


def _type_problems(args: Any) -> list[str]:
    out = []
    for name, types in TYPES.items():
        value = getattr(args, name)
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if wrong:
            want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            out.append(f"{name} must be {want}, got {value!r} ({type(value).__name__})")
    return out


# Numeric settings that must be finite, and how to say what the user likely meant instead.
_FINITE: dict[str, str] = {
    "num_train_epochs": "set a number of epochs, or max_steps",
    "learning_rate": "e.g. 5e-5",
    "weight_decay": "0 turns decay off",
    "adam_beta1": "e.g. 0.9",
    "adam_beta2": "e.g. 0.999",
    "adam_epsilon": "e.g. 1e-8",
    "max_grad_norm": "0 turns clipping off",
    "warmup_steps": "0 for no warmup",
    "eval_steps": "None uses logging_steps",
    "eval_delay": "0 for no delay",
    "logging_steps": "e.g. 500",
    "save_steps": "e.g. 500",
    "label_smoothing_factor": "0 turns smoothing off",
    "neftune_noise_alpha": "None turns NEFTune off",
}
_SEED_MAX = 2**63 - 1  # the seed is a 64-bit counter in the state (torch.Generator takes the same range)


def _finite_problems(args: Any) -> list[str]:
    """Name every numeric setting that is inf or NaN, and seeds that do not fit the state's int64."""
    out = []
    for name, hint in _FINITE.items():
        value = getattr(args, name)
        if isinstance(value, float) and not math.isfinite(value):
            out.append(f"{name}={value} is not a finite number ({hint})")
    kwargs = args.lr_scheduler_kwargs if isinstance(args.lr_scheduler_kwargs, dict) else {}
    out += [
        f"lr_scheduler_kwargs {k}={v} is not a finite number"
        for k, v in kwargs.items()
        if isinstance(v, float) and not math.isfinite(v)
    ]
    for name in ("seed", "data_seed"):
        value = getattr(args, name)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= _SEED_MAX:
            out.append(f"{name}={value} is out of range: a seed is an int in [0, 2**63 - 1]")
    return out


def _with_defaults_for_bad_types(args: Any, bad: set[str]) -> Any:
    """Return a copy whose wrongly typed fields hold their defaults, so other checks can still run."""
    cls = type(args)
    copy = object.__new__(cls)
    for f in attrs.fields(cls):
        object.__setattr__(copy, f.name, f.default if f.name in bad else getattr(args, f.name))
    return copy


def problems(args: Any) -> list[str]:
    """Return every problem of ``args`` (a ``TrainingArguments``), each naming the setting, its value and the fix."""
    out = _type_problems(args)
    out += _finite_problems(args)
    args = _with_defaults_for_bad_types(args, {p.split(" ", 1)[0].split("=", 1)[0] for p in out})
    out += schedule_kwargs_problems(args.lr_scheduler_type, args.lr_scheduler_kwargs or {})
    out += optim_problems(args)
    out += _choice_problems(args)
    out += _range_problems(args)
    out += _option_problems(args)
    out += loader_errors(
        args.dataloader_num_workers, args.dataloader_persistent_workers, args.dataloader_prefetch_factor
    )
    bad_reporters = [r for r in args.reporters if r not in (*REPORTERS, "all", "none")]
    if bad_reporters:
        out.append(f"report_to has unknown reporters {bad_reporters}; choose from {list(REPORTERS)}, 'all' or 'none'")
    if not args.label_names:
        out.append("label_names must name at least one key, e.g. ('labels',)")
    out += combination_problems(args)
    return out


# setting -> its vocabulary, each from the module that owns it
_CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train_sampling_strategy", SAMPLING_STRATEGIES),
    ("eval_strategy", EVAL_STRATEGIES),
    ("logging_strategy", LOGGING_STRATEGIES),
    ("save_strategy", SAVE_STRATEGIES),
    ("log_level", LOG_LEVELS),
)


def _choice_problems(args: Any) -> list[str]:
    return [
        f"{name}={getattr(args, name)!r} is not one of {list(choices)}"
        for name, choices in _CHOICES
        if isinstance(getattr(args, name), str) and getattr(args, name) not in choices
    ]


def _range_problems(args: Any) -> list[str]:
    """Name the counts that must be positive, the amounts that must not be negative, and the intervals."""
    out = []
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) <= 0:
            out.append(f"{name} must be > 0, got {getattr(args, name)}")
    for name in ("learning_rate", "weight_decay", "warmup_steps", "max_grad_norm", "eval_delay"):
        if getattr(args, name) < 0:
            out.append(f"{name} must be >= 0, got {getattr(args, name)}")
    for name in ("logging_steps", "save_steps", "eval_steps"):
        value = getattr(args, name)
        if value is not None and (value <= 0 or (value >= 1 and value != int(value))):
            out.append(f"{name} must be a positive int, or a float < 1 (a ratio of total steps), got {value}")
    for name in sorted(set(args.include_for_metrics) - {"inputs"}):
        out.append(
            f"include_for_metrics has {name!r}; it takes 'inputs' (EvalPrediction.inputs, as HF)"
            + (
                ": HF's 'loss' gives each sample its batch's mean loss, which trainfold does not make; compute a "
                "per-sample loss in compute_metrics, or use trainfold.evaluation.evaluate_batches(include_for_metrics="
                "['loss']) for each sample's own"
                if name == "loss"
                else ""
            )
        )
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        out.append("training needs max_steps > 0 or num_train_epochs > 0")
    if args.adam_epsilon <= 0:
        out.append(f"adam_epsilon must be > 0 (it keeps Adam's division by sqrt(v) finite), got {args.adam_epsilon}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            out.append(f"{name} must be in [0, 1), got {getattr(args, name)}")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        out.append(f"save_total_limit must be >= 1 or None, got {args.save_total_limit}")
    if args.eval_accumulation_steps is not None and args.eval_accumulation_steps < 1:
        out.append(f"eval_accumulation_steps must be >= 1 or None, got {args.eval_accumulation_steps}")
    if not 0 <= args.label_smoothing_factor < 1:
        out.append(f"label_smoothing_factor must be in [0, 1), got {args.label_smoothing_factor}")
    if args.neftune_noise_alpha is not None and args.neftune_noise_alpha <= 0:
        out.append(f"neftune_noise_alpha must be > 0 (or None to turn NEFTune off), got {args.neftune_noise_alpha}")
    return out


_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _option_problems(args: Any) -> list[str]:
    """Name the settings whose value is not one trainfold supports."""
    out = []
    if args.tokens_seen not in ("no", *TOKEN_COUNTS):
        out.append(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} is not one of "
            "'all', 'non_padding', 'no' (or True / False)"
        )
    if not args.logging_nan_inf_filter:
        out.append(
            "logging_nan_inf_filter=False is not supported: logged means always leave out inf/NaN step losses "
            "(state.nonfinite_losses counts them; state.metrics['loss'] holds each step's own value)"
        )
    if args.torch_compile_mode not in _COMPILE_MODES:
        out.append(
            f"torch_compile_mode={args.torch_compile_mode!r} is not one of torch.compile's modes "
            "('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')"
        )
    return out
