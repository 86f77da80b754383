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
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from trainfold.ckpt.policy import SAVE_STRATEGIES
from trainfold.ckpt.run_identity import BOOKKEEPING, RUN_LENGTH, SAMPLE_ORDER
from trainfold.data.samplers import STRATEGIES as SAMPLING_STRATEGIES
from trainfold.evaluation.schedule import EVAL_STRATEGIES
from trainfold.hf.args_checks import problems
from trainfold.hf.args_convert import settings_from_hf
from trainfold.hf.args_features import FSDP_FULL_SHARD, OPTIMIZERS
from trainfold.hf.args_hf import HF_ONLY, REMOVED, hf_only_problem
from trainfold.observe.reporters import LOG_LEVELS
from trainfold.optim.schedules import SCHEDULE_NAMES
from trainfold.step.fsdp import FullShard, fsdp_words

__all__ = [
    "TrainingArguments",
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
_Args = TypeVar("_Args", bound="TrainingArguments")  # replace() returns the subclass it is called on


# kw_only: __attrs_init__ is called with keywords alone, so a subclass that overrides a default (moving the
# field to the end) keeps a compatible signature
@attrs.frozen(init=False, kw_only=True)
class TrainingArguments:
    """Settings for ``trainfold.train`` under their HF ``TrainingArguments`` names and defaults.

    A setting that does not change which states a run goes through (logging, saving, evaluation,
    data-loader plumbing) says so on its field (``metadata=BOOKKEEPING``; ``RUN_LENGTH`` for
    ``max_steps``/``num_train_epochs``): the run's fingerprint leaves it out (``trainfold.ckpt.run_identity``).
    One that fixes which samples form each step says ``metadata=SAMPLE_ORDER``: no resume may change it.

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

    output_dir: str = attrs.field(default="trainer_output", metadata=BOOKKEEPING)
    # write into an output_dir that holds another run's checkpoints
    overwrite_output_dir: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    num_train_epochs: float = attrs.field(default=3.0, metadata=RUN_LENGTH)
    max_steps: int = attrs.field(default=-1, metadata=RUN_LENGTH)
    per_device_train_batch_size: int = attrs.field(default=8, metadata=SAMPLE_ORDER)
    per_device_eval_batch_size: int = attrs.field(default=8, metadata=BOOKKEEPING)
    gradient_accumulation_steps: int = attrs.field(default=1, metadata=SAMPLE_ORDER)
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
    seed: int = attrs.field(default=42, metadata=SAMPLE_ORDER)
    data_seed: int | None = attrs.field(default=None, metadata=SAMPLE_ORDER)
    train_sampling_strategy: str = attrs.field(default="random", metadata=SAMPLE_ORDER)
    length_column_name: str = "length"
    model_input_name: str = "input_ids"
    eval_strategy: str = attrs.field(default="no", metadata=BOOKKEEPING)
    eval_steps: float | None = attrs.field(default=None, metadata=BOOKKEEPING)
    eval_on_start: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    eval_delay: float = attrs.field(default=0, metadata=BOOKKEEPING)
    eval_accumulation_steps: int | None = attrs.field(default=None, metadata=BOOKKEEPING)
    prediction_loss_only: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    include_for_metrics: tuple[str, ...] = attrs.field(default=(), metadata=BOOKKEEPING)  # ("inputs",): as HF
    dataloader_num_workers: int = attrs.field(default=0, metadata=BOOKKEEPING)
    dataloader_persistent_workers: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    dataloader_prefetch_factor: int | None = attrs.field(default=None, metadata=BOOKKEEPING)
    dataloader_pin_memory: bool = attrs.field(default=True, metadata=BOOKKEEPING)
    dataloader_drop_last: bool = attrs.field(default=False, metadata=SAMPLE_ORDER)
    remove_unused_columns: bool = True
    label_names: tuple[str, ...] = ("labels",)
    neftune_noise_alpha: float | None = None
    label_smoothing_factor: float = 0.0
    logging_strategy: str = attrs.field(default="steps", metadata=BOOKKEEPING)
    logging_steps: float = attrs.field(default=500, metadata=BOOKKEEPING)
    logging_first_step: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    logging_nan_inf_filter: bool = attrs.field(default=True, metadata=BOOKKEEPING)
    include_num_input_tokens_seen: str | bool = "no"
    report_to: str | tuple[str, ...] = attrs.field(default="none", metadata=BOOKKEEPING)
    run_name: str | None = attrs.field(default=None, metadata=BOOKKEEPING)
    logging_dir: str | None = None  # HF 4's name (HF 5: $TENSORBOARD_LOGGING_DIR); the TensorBoard directory
    disable_tqdm: bool | None = attrs.field(default=None, metadata=BOOKKEEPING)
    log_level: str = "passive"  # HF's names; the console shows log lines at passive/info/debug
    save_strategy: str = attrs.field(default="steps", metadata=BOOKKEEPING)
    save_steps: float = attrs.field(default=500, metadata=BOOKKEEPING)
    save_total_limit: int | None = attrs.field(default=None, metadata=BOOKKEEPING)
    save_only_model: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    # write checkpoints in a thread from CPU copies (trainfold.ckpt.sharded.Saver)
    async_save: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    # sharded runs: also model.safetensors, the full weights (from_pretrained); False saves rank 0 the gather
    save_consolidated_model: bool = attrs.field(default=True, metadata=BOOKKEEPING)
    metric_for_best_model: str | None = attrs.field(default=None, metadata=BOOKKEEPING)
    greater_is_better: bool | None = attrs.field(default=None, metadata=BOOKKEEPING)
    load_best_model_at_end: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    enable_jit_checkpoint: bool = attrs.field(default=False, metadata=BOOKKEEPING)
    # a resume takes the EarlyStoppingCallback's patience and threshold from the checkpoint, as HF (the counters
    # are in the state record: always restored)
    restore_callback_states_from_checkpoint: bool = attrs.field(default=False, metadata=BOOKKEEPING)  # not the run's
    use_cpu: bool = False
    bf16: bool = False
    fp16: bool = False
    torch_compile: bool = False
    torch_compile_backend: str | None = None  # setting it turns torch_compile on, as in HF
    torch_compile_mode: str | None = None
    activation_checkpointing: bool | None = attrs.field(default=None, metadata=BOOKKEEPING)
    activation_checkpointing_kwargs: dict[str, Any] | None = attrs.field(default=None, metadata=BOOKKEEPING)
    # HF's older name for activation_checkpointing
    gradient_checkpointing: bool | None = attrs.field(default=None, metadata=BOOKKEEPING)
    gradient_checkpointing_kwargs: dict[str, Any] | None = attrs.field(default=None, metadata=BOOKKEEPING)
    # LLM batches and loss (TRL's SFTConfig names; see trainfold.data.llm)
    packing: bool = False
    packing_strategy: str = "bfd"
    max_length: int | None = None  # tokens per packed row; None: TRL's 1024
    padding_free: bool = False
    pad_to_multiple_of: int | None = (
        None  # TRL's name: collated widths rounded up to a multiple (trainfold.data.columns)
    )
    loss_chunk_size: int = 0  # tokens per chunk of the chunked causal-LM cross-entropy; 0: off
    # HF's names; "full_shard": torch's fully_shard per block (step.fsdp); fsdp_config: transformer_layer_cls_to_wrap...
    fsdp: str | tuple[str, ...] | None = attrs.field(default=None, metadata=BOOKKEEPING)
    fsdp_config: dict[str, Any] | None = attrs.field(default=None, metadata=BOOKKEEPING)

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
        for key in ("report_to", "label_names", "fsdp", "include_for_metrics"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = tuple(kwargs[key])
        if kwargs.get("fsdp") in ("", ()):  # HF's "off"
            kwargs["fsdp"] = None
        self.__attrs_init__(**kwargs)  # type: ignore[attr-defined]

    def __attrs_post_init__(self) -> None:
        found = problems(self)
        if found:
            raise ValueError("invalid TrainingArguments:\n  - " + "\n  - ".join(found))

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> TrainingArguments:
        """Build from a mapping (a parsed TOML/JSON config), with the same checks."""
        return cls(**dict(settings))

    @classmethod
    def from_hf(cls, config: Any, **changes: Any) -> TrainingArguments:
        """Build from a parsed ``transformers.TrainingArguments`` (or a TRL config) as is, then apply ``changes``.

        Keeps every setting trainfold has (as transformers resolved it), ignores the fields that are at
        their defaults or belong to the script (``resume_from_checkpoint``, ``model_init_kwargs``...),
        and refuses by name, all at once, the ones trainfold cannot honour (``trainfold.hf.args_convert``).

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
        )
        return cls(**{**cls.resolved_from_hf(settings, config), **changes})

    @classmethod
    def checked_from_hf(cls) -> dict[str, Callable[[Any], str | None]]:
        """Return judges of foreign fields this class knows about (none here; GRPO: TRL's): value -> why refused."""
        return {}

    @classmethod
    def resolved_from_hf(cls, settings: dict[str, Any], config: Any) -> dict[str, Any]:
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
