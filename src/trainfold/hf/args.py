"""``TrainingArguments``: the HF Trainer's setting names, as one frozen record validated up front.

Every problem is reported at once, unknown names come with the closest known name, and
impossible combinations are refused before any work is done.

>>> args = TrainingArguments(output_dir="runs/x", max_steps=10, learning_rate=1e-3)
>>> args.max_steps, args.per_device_train_batch_size
(10, 8)
>>> TrainingArguments(learnig_rate=1e-3)
Traceback (most recent call last):
...
TypeError: unknown TrainingArguments: 'learnig_rate' (did you mean 'learning_rate'?)
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

import attrs

from trainfold.hf.args_hf import HF_ONLY, hf_only_problem
from trainfold.optim.schedules import SCHEDULE_NAMES, schedule_kwargs_problems

__all__ = ["TrainingArguments", "INTERVALS", "OPTIMIZERS", "SAVE_STRATEGIES", "SAMPLING_STRATEGIES", "SCHEDULERS"]

INTERVALS = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length", "batch_rebalance")
SCHEDULERS = SCHEDULE_NAMES
# optim -> the optim_args it takes (HF's "key=value,key=value" string)
OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "adamw_torch_fused": (),
    "adamw_torch": (),
    "sgd": ("momentum", "dampening", "nesterov"),
}
REPORTERS = ("jsonl", "tensorboard", "trackio", "wandb")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")

_NUM = (int, float)
_OPT_INT = (int, type(None))
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))


@attrs.frozen(init=False)
class TrainingArguments:
    """Settings for ``trainfold.train`` under their HF ``TrainingArguments`` names and defaults.

    >>> args = TrainingArguments(max_steps=5)
    >>> args.replace(learning_rate=1e-3).learning_rate, TrainingArguments.from_dict({"max_steps": 3}).max_steps
    (0.001, 3)
    >>> TrainingArguments(lr_scheduler_type="cosin")
    Traceback (most recent call last):
    ...
    ValueError: invalid TrainingArguments:
      - lr_scheduler_type='cosin' is not one of ['linear', 'cosine', 'cosine_with_min_lr', 'cosine_with_restarts', 'polynomial', 'constant', 'constant_with_warmup', 'inverse_sqrt', 'warmup_stable_decay']
    """

    output_dir: str = "trainer_output"
    overwrite_output_dir: bool = False  # write into an output_dir that holds another run's checkpoints
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] | None = None
    warmup_steps: float = 0
    seed: int = 42
    data_seed: int | None = None
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"
    model_input_name: str = "input_ids"
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_on_start: bool = False
    eval_delay: float = 0
    eval_accumulation_steps: int | None = None
    prediction_loss_only: bool = False
    dataloader_num_workers: int = 0
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_pin_memory: bool = True
    dataloader_drop_last: bool = False
    remove_unused_columns: bool = True
    label_names: tuple[str, ...] = ("labels",)
    neftune_noise_alpha: float | None = None
    label_smoothing_factor: float = 0.0
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    logging_nan_inf_filter: bool = True
    include_num_input_tokens_seen: str | bool = "no"
    report_to: str | tuple[str, ...] = "none"
    run_name: str | None = None
    logging_dir: str | None = None  # HF 4's name (HF 5: $TENSORBOARD_LOGGING_DIR); the TensorBoard directory
    disable_tqdm: bool | None = None
    log_level: str = "passive"  # HF's names; the console shows log lines at passive/info/debug
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    async_save: bool = False  # write checkpoints in a thread from CPU copies (trainfold.ckpt.sharded.Saver)
    save_consolidated_model: bool = False  # sharded runs: also model.safetensors, the full weights (from_pretrained)
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    load_best_model_at_end: bool = False
    enable_jit_checkpoint: bool = False
    use_cpu: bool = False
    bf16: bool = False
    fp16: bool = False
    torch_compile: bool = False
    torch_compile_backend: str | None = None  # setting it turns torch_compile on, as in HF
    torch_compile_mode: str | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_kwargs: dict[str, Any] | None = None
    gradient_checkpointing: bool | None = None  # HF's older name for activation_checkpointing
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    # LLM batches and loss (TRL's SFTConfig names; see trainfold.data.llm)
    packing: bool = False
    packing_strategy: str = "bfd"
    max_length: int | None = None  # tokens per packed row; None: TRL's 1024
    padding_free: bool = False
    pad_to_multiple_of: int | None = (
        None  # TRL's name: collated widths rounded up to a multiple (trainfold.data.columns)
    )
    loss_chunk_size: int = 0  # tokens per chunk of the chunked causal-LM cross-entropy; 0: off
    fsdp: str | tuple[str, ...] | None = None  # HF's name; "full_shard": params and optimizer state as shards

    def __init__(self, **kwargs: Any) -> None:
        known = [f.name for f in attrs.fields(type(self))]
        unknown = [k for k in kwargs if k not in known]
        hf_only = [p for p in (hf_only_problem(k, kwargs[k]) for k in unknown) if p is not None]
        typos = [k for k in unknown if k not in HF_ONLY]
        if typos or hf_only:
            hints = []
            for name in typos:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError("\n".join(([f"unknown TrainingArguments: {', '.join(hints)}"] if hints else []) + hf_only))
        kwargs = {k: v for k, v in kwargs.items() if k in known}  # the rest are HF settings with no effect here
        for key in ("report_to", "label_names", "fsdp"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = tuple(kwargs[key])
        if kwargs.get("fsdp") in ("", ()):  # HF's "off"
            kwargs["fsdp"] = None
        self.__attrs_init__(**kwargs)  # type: ignore[attr-defined]

    def __attrs_post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError("invalid TrainingArguments:\n  - " + "\n  - ".join(problems))

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> TrainingArguments:
        """Build from a mapping (a parsed TOML/JSON config), with the same checks."""
        return cls(**dict(settings))

    def to_dict(self) -> dict[str, Any]:
        """Return the settings as JSON-ready values."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(self).items()}

    def replace(self, **changes: Any) -> TrainingArguments:
        """Return a copy with ``changes`` applied (and checked)."""
        return type(self)(**{**attrs.asdict(self, recurse=False), **changes})

    @property
    def optimizer_options(self) -> dict[str, float | bool]:
        """Return ``optim_args`` parsed: ``"momentum=0.9,nesterov=true"`` -> ``{"momentum": 0.9, "nesterov": True}``."""
        out: dict[str, float | bool] = {}
        for item in (self.optim_args or "").replace(" ", "").split(","):
            if item:
                key, _, value = item.partition("=")
                out[key] = value.lower() in ("true", "1", "yes") if key == "nesterov" else float(value)
        return out

    @property
    def tokens_seen(self) -> str:
        """Return ``include_num_input_tokens_seen`` as ``"no"``, ``"all"`` or ``"non_padding"`` (True is ``"all"``)."""
        value = self.include_num_input_tokens_seen
        return {True: "all", False: "no"}[value] if isinstance(value, bool) else value

    @property
    def compile(self) -> bool | str:
        """Return what ``make_step(compile=...)`` takes: False, True (inductor) or the backend's name."""
        if self.torch_compile_backend is not None:
            return self.torch_compile_backend
        return self.torch_compile or self.torch_compile_mode is not None

    @property
    def full_shard(self) -> bool:
        """Whether ``fsdp`` asks for sharded training (``"full_shard"``, with or without ``auto_wrap``)."""
        return _fsdp_options(self.fsdp) in FSDP_FULL_SHARD

    @property
    def checkpoint_every(self) -> int:
        """Return which blocks activation checkpointing recomputes: 0 (off), or every n-th block."""
        on = self.activation_checkpointing or self.gradient_checkpointing
        return int(self.checkpointing_kwargs.get("every_n_layers", 1)) if on else 0

    @property
    def checkpointing_kwargs(self) -> dict[str, Any]:
        """Return ``activation_checkpointing_kwargs``, or its older name's value, or ``{}``."""
        return self.activation_checkpointing_kwargs or self.gradient_checkpointing_kwargs or {}

    @property
    def reporters(self) -> tuple[str, ...]:
        """Return ``report_to`` as a tuple of reporter names (``"all"`` and ``"none"`` kept as given)."""
        value = self.report_to
        return (value,) if isinstance(value, str) else tuple(value)

    @property
    def metric_key(self) -> str | None:
        """Return the best-model metric as it appears in eval results (``eval_`` prefixed)."""
        metric = self.metric_for_best_model
        if metric is None and self.load_best_model_at_end:
            metric = "loss"
        if metric is None:
            return None
        return metric if metric.startswith("eval_") else f"eval_{metric}"


_TYPES: dict[str, tuple[type, ...]] = {
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
}


def _type_problems(args: TrainingArguments) -> list[str]:
    out = []
    for name, types in _TYPES.items():
        value = getattr(args, name)
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if wrong:
            want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            out.append(f"{name} must be {want}, got {value!r} ({type(value).__name__})")
    return out


def _choice(out: list[str], args: TrainingArguments, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(args, name)
    if isinstance(value, str) and value not in choices:
        out.append(f"{name}={value!r} is not one of {list(choices)}")


def _with_defaults_for_bad_types(args: TrainingArguments, bad: set[str]) -> TrainingArguments:
    """Return a copy whose wrongly typed fields hold their defaults, so other checks can still run."""
    copy = object.__new__(TrainingArguments)
    for f in attrs.fields(TrainingArguments):
        object.__setattr__(copy, f.name, f.default if f.name in bad else getattr(args, f.name))
    return copy


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


def _finite_problems(args: TrainingArguments) -> list[str]:
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


def _problems(args: TrainingArguments) -> list[str]:
    out = _type_problems(args)
    out += _finite_problems(args)
    args = _with_defaults_for_bad_types(args, {p.split(" ", 1)[0].split("=", 1)[0] for p in out})
    out += schedule_kwargs_problems(args.lr_scheduler_type, args.lr_scheduler_kwargs or {})
    out += _optim_problems(args)
    for name, choices in (
        ("train_sampling_strategy", SAMPLING_STRATEGIES),
        ("eval_strategy", INTERVALS),
        ("logging_strategy", INTERVALS),
        ("save_strategy", SAVE_STRATEGIES),
        ("log_level", LOG_LEVELS),
    ):
        _choice(out, args, name, choices)
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) <= 0:
            out.append(f"{name} must be > 0, got {getattr(args, name)}")
    for name in (
        "learning_rate",
        "weight_decay",
        "warmup_steps",
        "max_grad_norm",
        "eval_delay",
        "dataloader_num_workers",
    ):
        if getattr(args, name) < 0:
            out.append(f"{name} must be >= 0, got {getattr(args, name)}")
    for name in ("logging_steps", "save_steps", "eval_steps"):
        value = getattr(args, name)
        if value is not None and (value <= 0 or (value >= 1 and value != int(value))):
            out.append(f"{name} must be a positive int, or a float < 1 (a ratio of total steps), got {value}")
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
    if args.tokens_seen not in ("no", "all", "non_padding"):
        out.append(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} is not one of "
            "'all', 'non_padding', 'no' (or True / False)"
        )
    if not args.logging_nan_inf_filter:
        out.append(
            "logging_nan_inf_filter=False is not supported: logged means always leave out inf/NaN step losses "
            "(state.nonfinite_losses counts them; state.metrics['loss'] holds each step's own value)"
        )
    if not 0 <= args.label_smoothing_factor < 1:
        out.append(f"label_smoothing_factor must be in [0, 1), got {args.label_smoothing_factor}")
    if args.neftune_noise_alpha is not None and args.neftune_noise_alpha <= 0:
        out.append(f"neftune_noise_alpha must be > 0 (or None to turn NEFTune off), got {args.neftune_noise_alpha}")
    if args.torch_compile_mode not in (
        None,
        "default",
        "reduce-overhead",
        "max-autotune",
        "max-autotune-no-cudagraphs",
    ):
        out.append(
            f"torch_compile_mode={args.torch_compile_mode!r} is not one of torch.compile's modes "
            "('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')"
        )
    if args.dataloader_num_workers == 0:
        if args.dataloader_persistent_workers:
            out.append("dataloader_persistent_workers=True needs dataloader_num_workers > 0")
        if args.dataloader_prefetch_factor is not None:
            out.append("dataloader_prefetch_factor needs dataloader_num_workers > 0")
    bad_reporters = [r for r in args.reporters if r not in (*REPORTERS, "all", "none")]
    if bad_reporters:
        out.append(f"report_to has unknown reporters {bad_reporters}; choose from {list(REPORTERS)}, 'all' or 'none'")
    if not args.label_names:
        out.append("label_names must name at least one key, e.g. ('labels',)")
    out += _combination_problems(args)
    return out


def _optim_problems(args: TrainingArguments) -> list[str]:
    if args.optim not in OPTIMIZERS:
        return [f"optim={args.optim!r} is not one of {list(OPTIMIZERS)}"]
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
        return [f"optim_args values must be numbers (nesterov: true/false), got {args.optim_args!r}"]
    return [
        f"optim_args {k}={v} is not a finite number"
        for k, v in options.items()
        if isinstance(v, float) and not math.isfinite(v)
    ]


def _checkpointing_problems(args: TrainingArguments) -> list[str]:
    out = []
    pairs = (
        ("activation_checkpointing", "gradient_checkpointing"),
        ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"),
    )
    for new, old in pairs:
        a, b = getattr(args, new), getattr(args, old)
        if a is not None and b is not None and a != b:
            out.append(f"{new}={a!r} and its older name {old}={b!r} disagree; set only {new}")
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


def _llm_problems(args: TrainingArguments) -> list[str]:
    out = []
    if args.packing_strategy == "wrapped":
        out.append(
            "packing_strategy='wrapped' cuts documents at row ends, so a document's tail would be trained "
            "without its start; use 'bfd' (truncate long documents) or 'bfd_split' (split them)"
        )
    elif args.packing_strategy not in ("bfd", "bfd_split"):
        out.append(f"packing_strategy={args.packing_strategy!r} is not one of ['bfd', 'bfd_split']")
    if args.max_length is not None and args.max_length < 1:
        out.append(f"max_length must be a positive int (tokens per packed row) or None, got {args.max_length}")
    if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
        out.append(f"pad_to_multiple_of must be a positive int or None, got {args.pad_to_multiple_of}")
    if args.loss_chunk_size < 0:
        out.append(f"loss_chunk_size must be >= 0 (tokens per chunk; 0 turns chunking off), got {args.loss_chunk_size}")
    if (args.packing or args.padding_free) and args.neftune_noise_alpha is not None:
        out.append(
            "neftune_noise_alpha scales its noise by each sequence's length, which packed and padding-free "
            "rows do not carry; turn NEFTune or packing/padding_free off"
        )
    return out


FSDP_FULL_SHARD = (("full_shard",), ("auto_wrap", "full_shard"))  # auto_wrap: trainfold gathers per block anyway


def _fsdp_options(value: Any) -> tuple[str, ...]:
    words = value.split() if isinstance(value, str) else list(value or ())
    return tuple(sorted(str(w) for w in words))


def _fsdp_problems(args: TrainingArguments) -> list[str]:
    options = _fsdp_options(args.fsdp)
    if not options:
        return []
    if options not in FSDP_FULL_SHARD:
        other = [o for o in options if o not in ("full_shard", "auto_wrap")]
        return [
            f"fsdp={args.fsdp!r} is not supported ({', '.join(repr(o) for o in other) or 'the combination'}): "
            "trainfold shards params, gradients and optimizer state over all ranks (DTensor Shard(0)) and gathers "
            "one block at a time; write fsdp='full_shard'"
        ]
    out = []
    if args.fp16:
        out.append("fsdp='full_shard' with fp16 (loss scaling) is not supported; use bf16=True")
    if args.compile:
        out.append("fsdp='full_shard' with torch_compile is not supported yet; train the sharded step eagerly")
    return out


def _combination_problems(args: TrainingArguments) -> list[str]:
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
