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
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias, TypeVar

import attrs

from trainfold.ckpt.policy import SAVE_STRATEGIES
from trainfold.data import loader_errors
from trainfold.data.samplers import STRATEGIES as SAMPLING_STRATEGIES
from trainfold.evaluation.schedule import EVAL_STRATEGIES
from trainfold.observe import LOGGING_STRATEGIES, TOKEN_COUNTS
from trainfold.observe.reporters import LOG_LEVELS
from trainfold.optim.schedules import SCHEDULE_NAMES, schedule_kwargs_problems
from trainfold.step.fsdp import FSDP_OPTIONS, FullShard, fsdp_problems, fsdp_words
from trainfold.trainer.args_checks import (
    COMPILE_MODES,
    NAN_INF_FILTER,
    REFUSED_OPTIMIZERS,
    SEED_MAX,
    WRAPPED,
    finite_values,
    interval_steps,
    known_reporters,
    metrics_inputs,
    not_empty,
    problems,
)
from trainfold.trainer.args_convert import PeerArguments, settings_from_hf, turned_off
from trainfold.trainer.args_hf import HF_ONLY, REMOVED, hf_only_problem
from trainfold.trainer.optimizer import OPTIMIZERS, OptimizerSettings
from trainfold.trainer.setting import as_declared, setting

__all__ = [
    "TrainingArguments",
    "GivenArguments",
    "PeerArguments",
    "INTERVALS",
    "OPTIMIZERS",
    "SAVE_STRATEGIES",
    "SAMPLING_STRATEGIES",
    "SCHEDULERS",
    "LOG_LEVELS",
    "FSDP_FULL_SHARD",
]

# The vocabularies, each owned by the module that acts on it (re-exported here under the names args used)
INTERVALS = EVAL_STRATEGIES  # eval_strategy's (logging_strategy's are observe.observers.LOGGING_STRATEGIES)
SCHEDULERS = SCHEDULE_NAMES
FSDP_FULL_SHARD = FSDP_OPTIONS  # the fsdp= words trainfold takes (torch's fully_shard does each exactly)


def _auto_is_none(value: Any) -> Any:
    return None if value == "auto" else value


_Args = TypeVar("_Args", bound="TrainingArguments")  # replace() returns the subclass it is called on


# kw_only: __attrs_init__ is called with keywords alone, so a subclass that overrides a default (moving the
# field to the end) keeps a compatible signature
@attrs.frozen(init=False, kw_only=True)
class TrainingArguments:
    """Settings for ``trainfold.train`` under their HF ``TrainingArguments`` names and defaults.

    Each setting is declared once, on its field (``trainfold.trainer.setting``): its annotation is its type, and
    ``setting(...)`` gives its range, choices, refused values, HF name and what it is for the run's identity:
    one that does not change which states a run goes through (logging, saving, evaluation, data-loader
    plumbing) says ``trajectory=False``, ``max_steps``/``num_train_epochs`` say ``"length"``, and one that
    fixes which samples form each step says ``"samples"``: no resume may change it (``trainfold.ckpt.run_identity``).

    >>> args = TrainingArguments(max_steps=5)
    >>> args.replace(learning_rate=1e-3).learning_rate, TrainingArguments.from_dict({"max_steps": 3}).max_steps
    (0.001, 3)
    >>> TrainingArguments(lr_scheduler_type="cosin")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: invalid TrainingArguments:
      - lr_scheduler_type='cosin' is not one of ['linear', 'cosine', 'cosine_with_min_lr', 'cosine_warmup_with_min_lr',
      'cosine_with_restarts', 'polynomial', 'constant', 'constant_with_warmup', 'inverse_sqrt', 'warmup_stable_decay']
    """

    output_dir: str = setting("trainer_output", trajectory=False)
    # write into an output_dir that holds another run's checkpoints (HF 4's name)
    overwrite_output_dir: bool = setting(False, trajectory=False)
    num_train_epochs: float = setting(3.0, trajectory="length", hint="set a number of epochs, or max_steps")
    max_steps: int = setting(-1, trajectory="length")
    per_device_train_batch_size: int = setting(8, range="(0, inf)", trajectory="samples")
    per_device_eval_batch_size: int = setting(8, range="(0, inf)", trajectory=False)
    gradient_accumulation_steps: int = setting(1, range="(0, inf)", trajectory="samples")
    learning_rate: float = setting(5e-5, range="[0, inf)", hint="e.g. 5e-5")
    weight_decay: float = setting(0.0, range="[0, inf)", hint="0 turns decay off")
    adam_beta1: float = setting(0.9, range="[0, 1)", hint="e.g. 0.9")
    adam_beta2: float = setting(0.999, range="[0, 1)", hint="e.g. 0.999")
    adam_epsilon: float = setting(1e-8, range="(0, inf)", hint="it keeps Adam's division by sqrt(v) finite; e.g. 1e-8")
    max_grad_norm: float = setting(1.0, range="[0, inf)", hint="0 turns clipping off")
    optim: str = setting("adamw_torch_fused", choices=tuple(OPTIMIZERS), refuse=REFUSED_OPTIMIZERS)
    optim_args: str | None = None  # "momentum=0.9,nesterov=true": the optimizer's own keywords
    lr_scheduler_type: str = "linear"  # its vocabulary and kwargs: trainfold.optim.schedules
    lr_scheduler_kwargs: dict[str, Any] | None = setting(None, check=finite_values)
    warmup_steps: float = setting(0, range="[0, inf)", hint="0 for no warmup")
    seed: int = setting(42, range=f"[0, {SEED_MAX}]", trajectory="samples", hint="a seed is the state's int64")
    data_seed: int | None = setting(None, range=f"[0, {SEED_MAX}]", trajectory="samples")
    train_sampling_strategy: str = setting("random", choices=SAMPLING_STRATEGIES, trajectory="samples")
    length_column_name: str = "length"
    model_input_name: str = setting("input_ids")
    eval_strategy: str = setting("no", choices=EVAL_STRATEGIES, trajectory=False)
    eval_steps: float | None = setting(None, check=interval_steps, trajectory=False, hint="None uses logging_steps")
    eval_on_start: bool = setting(False, trajectory=False)
    eval_delay: float = setting(0, range="[0, inf)", trajectory=False, hint="0 for no delay")
    eval_accumulation_steps: int | None = setting(None, range="[1, inf)", trajectory=False)
    prediction_loss_only: bool = setting(False, trajectory=False)
    include_for_metrics: tuple[str, ...] = setting((), check=metrics_inputs, trajectory=False)  # ("inputs",): as HF
    dataloader_num_workers: int = setting(0, trajectory=False)  # with the two below: data.loader_errors
    dataloader_persistent_workers: bool = setting(False, trajectory=False)
    dataloader_prefetch_factor: int | None = setting(None, trajectory=False)
    dataloader_pin_memory: bool = setting(True, trajectory=False)
    dataloader_drop_last: bool = setting(False, trajectory="samples")
    remove_unused_columns: bool = True
    label_names: tuple[str, ...] = setting(("labels",), check=not_empty, hint="e.g. ('labels',)")
    neftune_noise_alpha: float | None = setting(None, range="(0, inf)", hint="None turns NEFTune off")
    label_smoothing_factor: float = setting(0.0, range="[0, 1)", hint="0 turns smoothing off")
    logging_strategy: str = setting("steps", choices=LOGGING_STRATEGIES, trajectory=False)
    logging_steps: float = setting(500, check=interval_steps, trajectory=False, hint="e.g. 500")
    logging_first_step: bool = setting(False, trajectory=False)
    logging_nan_inf_filter: bool = setting(True, trajectory=False, only=(True, NAN_INF_FILTER))
    include_num_input_tokens_seen: str | bool = setting("no", choices=("no", *TOKEN_COUNTS, True, False))
    report_to: str | tuple[str, ...] = setting("none", check=known_reporters, trajectory=False)
    run_name: str | None = setting(None, trajectory=False)
    # HF 4's name (HF 5: $TENSORBOARD_LOGGING_DIR); the TensorBoard directory
    logging_dir: str | None = setting(None, trajectory=False)
    disable_tqdm: bool | None = setting(None, trajectory=False)
    # HF's names; the console shows log lines at passive/info/debug
    log_level: str = setting("passive", choices=LOG_LEVELS, trajectory=False)
    save_strategy: str = setting("steps", choices=SAVE_STRATEGIES, trajectory=False)
    save_steps: float = setting(500, check=interval_steps, trajectory=False, hint="e.g. 500")
    save_total_limit: int | None = setting(None, range="[1, inf)", trajectory=False)
    save_only_model: bool = setting(False, trajectory=False)
    # write checkpoints in a thread from CPU copies (trainfold.ckpt.sharded.Saver)
    async_save: bool = setting(False, trajectory=False, hf=None)
    # sharded runs: also model.safetensors, the full weights (from_pretrained); False saves rank 0 the gather
    save_consolidated_model: bool = setting(True, trajectory=False, hf=None)
    metric_for_best_model: str | None = setting(None, trajectory=False)
    greater_is_better: bool | None = setting(None, trajectory=False)
    load_best_model_at_end: bool = setting(False, trajectory=False)
    enable_jit_checkpoint: bool = setting(False, trajectory=False)
    # a resume takes the EarlyStoppingCallback's patience and threshold from the checkpoint, as HF (the counters
    # are in the state record: always restored)
    restore_callback_states_from_checkpoint: bool = setting(False, trajectory=False)  # a resume's, not the run's
    use_cpu: bool = False
    bf16: bool = False
    fp16: bool = False
    torch_compile: bool = False
    torch_compile_backend: str | None = None  # setting it turns torch_compile on, as in HF
    torch_compile_mode: str | None = setting(None, choices=COMPILE_MODES)
    activation_checkpointing: bool | None = setting(None, trajectory=False)
    activation_checkpointing_kwargs: dict[str, Any] | None = setting(None, trajectory=False)
    # HF's older name for activation_checkpointing
    gradient_checkpointing: bool | None = setting(None, trajectory=False)
    gradient_checkpointing_kwargs: dict[str, Any] | None = setting(None, trajectory=False)
    # LLM batches and loss (TRL's SFTConfig names; see trainfold.data.llm)
    packing: bool = setting(False)
    packing_strategy: str = setting("bfd", choices=("bfd", "bfd_split"), refuse={"wrapped": WRAPPED})
    # tokens per packed row (None: TRL's 1024); without packing, rows of token ids are cut to it as TRL's SFTTrainer
    # cuts them (data.llm.truncated; None: not cut)
    max_length: int | None = setting(None, range="[1, inf)")
    padding_free: bool = setting(False)
    # collated widths rounded up to a multiple (trainfold.data.columns); TRL's "auto" (128 on Neuron only) is None
    pad_to_multiple_of: int | None = setting(None, range="[1, inf)", converter=_auto_is_none)
    # tokens per chunk of the chunked causal-LM cross-entropy; 0: off
    loss_chunk_size: int = setting(0, range="[0, inf)", hf=None)
    # HF's names; "full_shard": torch's fully_shard per block (step.fsdp); fsdp_config: transformer_layer_cls_to_wrap...
    fsdp: str | tuple[str, ...] | None = setting(None, trajectory=False, converter=lambda v: v or None)
    fsdp_config: dict[str, Any] | None = setting(None, trajectory=False)

    def __init__(self, **kwargs: Any) -> None:
        known = [f.name for f in attrs.fields(type(self))]
        unknown = [k for k in kwargs if k not in known]
        hf_only = [p for p in (hf_only_problem(k, kwargs[k]) for k in unknown) if p is not None]
        typos = [k for k in unknown if k not in HF_ONLY and k not in REMOVED]
        if typos or hf_only:
            hints = []
            for name in typos:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError("\n".join(([f"unknown TrainingArguments: {', '.join(hints)}"] if hints else []) + hf_only))
        kwargs = {k: v for k, v in kwargs.items() if k in known}  # the rest are HF settings with no effect here
        kwargs = as_declared(type(self), kwargs)  # lists as the fields' tuples
        self.__attrs_init__(**kwargs)  # type: ignore[attr-defined]

    def __attrs_post_init__(self) -> None:
        found = problems(self)
        if found:
            raise ValueError(f"invalid {type(self).__name__}:\n  - " + "\n  - ".join(found))

    @classmethod
    def combined_checks(cls) -> tuple[Callable[[Any], list[str]], ...]:
        """Return the checks of settings taken together (each field's own are declared on it): args -> problems."""
        return (training_problems,)

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> TrainingArguments:
        """Build from a mapping (a parsed TOML/JSON config), with the same checks."""
        return cls(**dict(settings))

    @classmethod
    def from_hf(cls: type[_Args], config: PeerArguments, **changes: Any) -> _Args:
        """Build from a parsed ``transformers.TrainingArguments`` (or a TRL config) as is, then apply ``changes``.

        Keeps every setting trainfold has (as transformers resolved it), ignores the fields that are at
        their defaults or belong to the script (``resume_from_checkpoint``, ``model_init_kwargs``...),
        and refuses by name, all at once, the ones trainfold cannot honour (``trainfold.trainer.args_convert``).
        A keyword in ``changes`` always wins over the config's field, even one that would be refused.

        >>> import transformers
        >>> hf = transformers.TrainingArguments(output_dir="out", learning_rate=1e-3, report_to="none")
        >>> args = TrainingArguments.from_hf(hf, overwrite_output_dir=True)
        >>> args.learning_rate, args.lr_scheduler_type, args.overwrite_output_dir
        (0.001, 'linear', True)
        >>> try:
        ...     TrainingArguments.from_hf(transformers.TrainingArguments(output_dir="out", push_to_hub=True))
        ... except TypeError as e:
        ...     print(str(e).splitlines()[1].split(":")[0])
          - push_to_hub=True is a transformers.TrainingArguments setting that trainfold does not take
        """
        fields = attrs.fields(cls)
        settings = settings_from_hf(
            config,
            known={f.name for f in fields},
            defaults={f.name: f.default for f in fields},
            checked=cls.checked_from_hf(),
            overridden=set(changes),  # a keyword wins over the config's value, refused or not
        )
        names = {f.name for f in fields}
        changes = {k: v for k, v in changes.items() if k in names or not turned_off(k, v)}  # nothing left to do
        return cls(**{**cls.resolved_from_hf(settings, config), **changes})

    @classmethod
    def checked_from_hf(cls) -> dict[str, Callable[[Any], str | None]]:
        """Return judges of foreign fields this class knows about (none here; GRPO: TRL's): value -> why refused."""
        return {}

    @classmethod
    def resolved_from_hf(cls, settings: dict[str, Any], config: PeerArguments) -> dict[str, Any]:
        """Return ``settings`` with what ``config``'s ``__post_init__`` derived undone where this class derives it."""
        return settings

    def to_dict(self) -> dict[str, Any]:
        """Return the settings as JSON-ready values."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(self).items()}

    def replace(self: _Args, **changes: Any) -> _Args:
        """Return a copy with ``changes`` applied (and checked)."""
        return type(self)(**{**attrs.asdict(self, recurse=False), **changes})

    @property
    def optimizer_options(self) -> dict[str, float | bool]:
        """Return ``optim_args`` parsed: ``"momentum=0.9,nesterov=true"`` -> ``{"momentum": 0.9, "nesterov": True}``."""
        out: dict[str, float | bool] = {}
        for item in (self.optim_args or "").replace(" ", "").split(","):
            if item:
                key, _, value = item.partition("=")
                out[key] = value.lower() in ("true", "1", "yes") if key in ("nesterov", "centered") else float(value)
        return out

    def optimizer_settings(self) -> OptimizerSettings:
        """Return the settings the default optimizer is made of (``trainer.optimizer.default_optimizer``)."""
        return OptimizerSettings(
            self.optim,
            self.learning_rate,
            self.lr_scheduler_type,
            dict(self.lr_scheduler_kwargs or {}),
            self.warmup_steps,
            self.weight_decay,
            self.adam_beta1,
            self.adam_beta2,
            self.adam_epsilon,
            self.max_grad_norm,
            self.optimizer_options,
        )

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
        """Whether ``fsdp`` asks for sharded training (``"full_shard"``, with or without ``auto_wrap``, ``offload``)."""
        return "full_shard" in fsdp_words(self.fsdp)

    @property
    def fsdp_plan(self) -> FullShard | None:
        """Return how ``fsdp``/``fsdp_config`` (and ``bf16``) wrap the model with ``fully_shard`` (None: off)."""
        return FullShard.from_args(self.fsdp, self.fsdp_config, bf16=self.bf16) if self.full_shard else None

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


# -- the checks of settings taken together (``combined_checks``) --------------------------------------------------


# What a user may hand in as ``args``: a trainfold Arguments record, or the script's own transformers/TRL arguments
# object (``from_hf`` converts it). ``train`` and the Trainer-shaped facades take it (they: ``None`` too, the defaults).
GivenArguments: TypeAlias = TrainingArguments | PeerArguments


def training_problems(args: TrainingArguments) -> list[str]:
    """Return the problems of ``TrainingArguments``' settings taken together."""
    out = schedule_kwargs_problems(args.lr_scheduler_type, args.lr_scheduler_kwargs or {})
    out += _optim_problems(args)
    out += loader_errors(
        args.dataloader_num_workers, args.dataloader_persistent_workers, args.dataloader_prefetch_factor
    )
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        out.append("training needs max_steps > 0 or num_train_epochs > 0")
    return out + _combination_problems(args)


def _optim_problems(args: TrainingArguments) -> list[str]:
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


def _checkpointing_problems(args: TrainingArguments) -> list[str]:
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


def _llm_problems(args: TrainingArguments) -> list[str]:
    out = []
    if (args.packing or args.padding_free) and args.neftune_noise_alpha is not None:
        out.append(
            "neftune_noise_alpha scales its noise by each sequence's length, which packed and padding-free "
            "rows do not carry; turn NEFTune or packing/padding_free off"
        )
    return out


def _fsdp_problems(args: TrainingArguments) -> list[str]:
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
