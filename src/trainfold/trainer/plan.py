"""A run's plan, built from ``TrainingArguments`` before any step: sampler, schedule, step, eval, saves, stops.

Each piece is a frozen record made by its own function, so it can be built and checked without training:

>>> from trainfold.trainer.args import TrainingArguments
>>> args = TrainingArguments(max_steps=0, num_train_epochs=2, per_device_train_batch_size=2,
...                          gradient_accumulation_steps=2, train_sampling_strategy="sequential")
>>> sampler = sampler_for(args, list(range(10)))
>>> sampler.strategy, sampler.global_batch_size, schedule_for(args, sampler)
('sequential', 4, RunLength(total_steps=6, steps_per_epoch=3, num_epochs=2, micro_per_step=2.5))

An epoch of 5 micro-batches in steps of 2 is 3 steps, the last short: a log after step 2 says epoch 0.8 (4 of
5 micro-batches, as HF), ``epoch_span`` 2.5.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from trainfold.ckpt.run_identity import RunSettings
from trainfold.core.collective import Collective
from trainfold.core.fold import max_steps as max_steps_stop
from trainfold.data.samplers import Sampler, make_sampler
from trainfold.distributed.distributed import agreed_stop
from trainfold.observe import LoggingPlan, logging_plan
from trainfold.observe.stopping import EarlyStopping, patience_exhausted
from trainfold.step.amp import LossScaling
from trainfold.step.fsdp import FullShard
from trainfold.step.make import Execution
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.evaluating import EvalPlan

__all__ = [
    "RunLength",
    "sampler_for",
    "schedule_for",
    "StepOptions",
    "step_options",
    "CheckpointPlan",
    "ReporterPlan",
    "StopRules",
    "stop_rules",
    "StreamOptions",
    "STOPPING_RULES",
    "Plan",
]

Stop = Callable[[Any], bool]


def sampler_for(args: TrainingArguments, train_dataset: Any, *, world_size: int = 1, rank: int = 0) -> Sampler:
    """Return the sampler of ``train_sampling_strategy`` over ``train_dataset`` (``data_seed``, else ``seed``)."""
    return make_sampler(
        args.train_sampling_strategy,
        train_dataset,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        world_size=world_size,
        rank=rank,
        drop_last=args.dataloader_drop_last,
        seed=args.data_seed if args.data_seed is not None else args.seed,
        length_column_name=args.length_column_name,
        model_input_name=args.model_input_name,
    )


@attrs.frozen
class RunLength:
    """How long the run is: its optimizer steps, the steps of one epoch (None: unknown), the epochs to stream."""

    total_steps: int
    steps_per_epoch: int | None
    num_epochs: int | None  # None: max_steps ends the run
    micro_per_step: float | None = None  # an epoch's micro-batches / accumulation: what a logged epoch counts (HF's)

    @property
    def epoch_steps(self) -> int:
        """Return the steps of one epoch, or the run's when the dataset has no length."""
        return self.steps_per_epoch or self.total_steps

    @property
    def epoch_span(self) -> float:
        """Return what a logged ``epoch`` divides the steps done in the epoch by (as HF: micro-batches done / all)."""
        return self.micro_per_step or self.epoch_steps


def schedule_for(args: TrainingArguments, sampler: Sampler, stream: Any = None) -> RunLength:
    """Return the run's ``RunLength``: ``max_steps``, or ``num_train_epochs`` of the sampler's (or stream's) epoch.

    >>> from trainfold.trainer.args import TrainingArguments
    >>> schedule_for(TrainingArguments(max_steps=5), sampler_for(TrainingArguments(), list(range(4))))
    RunLength(total_steps=5, steps_per_epoch=1, num_epochs=None, micro_per_step=1.0)
    """
    steps_per_epoch = sampler.steps_per_epoch() if sampler.num_samples is not None else None
    if stream is not None:  # the steps are made from the state (GRPO): the stream knows its epoch
        steps_per_epoch = stream.steps_per_epoch
    if args.max_steps > 0:
        total_steps = args.max_steps
    elif steps_per_epoch is None:
        raise ValueError(
            "a train_dataset without __len__ needs max_steps > 0 (the number of epochs gives no step count)"
        )
    else:
        total_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
    epochs = None if args.max_steps > 0 else math.ceil(args.num_train_epochs)
    return RunLength(total_steps, steps_per_epoch, epochs, None if stream is not None else _micro_per_step(sampler))


def _micro_per_step(sampler: Sampler) -> float | None:
    # HF's epoch is micro-batches done / the epoch's: a share of steps but in a short last step (one process)
    if sampler.num_samples is None or sampler.world_size > 1 or sampler.strategy == "batch_rebalance":
        return None
    n, size = sampler.num_samples, sampler.per_device_train_batch_size
    micro = n // size if sampler.drop_last else -(-n // size)
    return micro / sampler.gradient_accumulation_steps if micro else None


@attrs.frozen
class StepOptions:
    """The settings ``make_step`` takes from ``TrainingArguments`` (mixed precision, compiling, recompute)."""

    label_key: str = "labels"
    execution: Execution = Execution()  # autocast (fp16 with loss scaling), compiling, recomputed blocks
    fsdp: FullShard | None = None  # fsdp="full_shard": the model is wrapped with fully_shard first (step.fsdp)
    neftune_noise_alpha: float | None = None


def step_options(args: TrainingArguments, label_key: str = "labels") -> StepOptions:
    """Return the step's options: ``bf16``/``fp16`` autocast (fp16 with loss scaling), ``torch_compile``...

    >>> from trainfold.trainer.args import TrainingArguments
    >>> [step_options(TrainingArguments(**a)).execution.autocast for a in ({"bf16": True}, {})]
    [torch.bfloat16, None]
    """
    execution = Execution(
        autocast=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
        loss_scaling=LossScaling() if args.fp16 else None,
        compile=args.compile,
        compile_mode=args.torch_compile_mode,
        gradient_checkpointing=args.checkpoint_every,
    )
    return StepOptions(
        label_key=label_key,
        execution=execution,
        fsdp=args.fsdp_plan,
        neftune_noise_alpha=args.neftune_noise_alpha,
    )


@attrs.frozen
class CheckpointPlan:
    """When the run saves and how (HF's ``save_*`` settings; ``ckpt.policy`` decides)."""

    output_dir: str
    strategy: str = "steps"
    steps: float = 500
    total_limit: int | None = None
    save_only_model: bool = False
    async_save: bool = False
    consolidated: bool = True
    processing_class: Any = None  # the tokenizer or processor: its files go into every checkpoint
    load_best: bool = False  # load_best_model_at_end: the module ends with the best checkpoint's weights
    jit: bool = False  # enable_jit_checkpoint: SIGTERM/SIGINT save a checkpoint and end the run (preempted)
    overwrite: bool = False  # overwrite_output_dir: another run's checkpoints there are replaced, not refused

    @classmethod
    def from_args(cls, args: TrainingArguments, processing_class: Any = None) -> CheckpointPlan:
        """Return the plan of ``args``' ``save_strategy``, ``save_steps``, ``save_total_limit``..."""
        return cls(
            args.output_dir,
            args.save_strategy,
            args.save_steps,
            args.save_total_limit,
            args.save_only_model,
            args.async_save,
            args.save_consolidated_model,
            processing_class,
            args.load_best_model_at_end,
            args.enable_jit_checkpoint,
            args.overwrite_output_dir,
        )


@attrs.frozen
class ReporterPlan:
    """Where logs go: the reporters of ``report_to`` (on the writer rank) and the console's progress."""

    names: tuple[str, ...]
    output_dir: str
    run_name: str | None
    logging_dir: str | None
    log_level: str = "passive"
    bar: bool | None = None  # None: tqdm's own choice (HF's disable_tqdm=None)

    @classmethod
    def from_args(cls, args: TrainingArguments, *, writer: bool = True) -> ReporterPlan:
        """Return the plan of ``report_to``, ``run_name``, ``logging_dir``, ``log_level``, ``disable_tqdm``."""
        bar = None if args.disable_tqdm is None else not args.disable_tqdm
        names = args.reporters if writer else ("none",)
        return cls(names, args.output_dir, args.run_name, args.logging_dir, args.log_level, bar)


@attrs.frozen
class StreamOptions:
    """How the run streams its training batches (the loader's workers, pinned memory) and counts their tokens."""

    num_workers: int = 0
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    pin_memory: bool = False  # dataloader_pin_memory, on a CUDA device only
    tokens_seen: str = "no"  # include_num_input_tokens_seen: "no", or how the input tokens are counted
    model_input_name: str = "input_ids"

    @classmethod
    def from_args(cls, args: TrainingArguments, device: torch.device) -> StreamOptions:
        """Return the options of ``args``' ``dataloader_*`` and ``include_num_input_tokens_seen`` settings."""
        return cls(
            args.dataloader_num_workers,
            args.dataloader_persistent_workers,
            args.dataloader_prefetch_factor,
            args.dataloader_pin_memory and device.type == "cuda",
            args.tokens_seen,
            args.model_input_name,
        )

    def loader_kwargs(self) -> dict[str, Any]:
        """Return the ``dataloader_*`` keywords of ``data.stream``."""
        return dict(
            dataloader_num_workers=self.num_workers,
            dataloader_persistent_workers=self.persistent_workers,
            dataloader_prefetch_factor=self.prefetch_factor,
            dataloader_pin_memory=self.pin_memory,
        )


# The rules whose firing before the last step ends a run as "stopped" (max_steps completes it).
STOPPING_RULES = ("early_stopping", "stop", "callbacks")


@attrs.frozen
class StopRules:
    """The run's stop predicates by name, in the order they are asked; the first that holds is recorded."""

    rules: tuple[tuple[str, Stop], ...]

    def including(self, name: str, stop: Stop | None) -> StopRules:
        """Return the rules with ``stop`` asked last under ``name`` (unchanged for None)."""
        return self if stop is None else StopRules((*self.rules, (name, stop)))

    @property
    def names(self) -> tuple[str, ...]:
        """Return the rules' names in order."""
        return tuple(name for name, _ in self.rules)

    def predicate(self, fired: list[str]) -> Stop:
        """Return the run's stop predicate; it appends the name of the rule that held to ``fired``.

        >>> rules = StopRules((("max_steps", lambda s: s >= 3), ("stop", lambda s: s == 2)))
        >>> fired = []
        >>> [rules.predicate(fired)(s) for s in (1, 2)], fired
        ([False, True], ['stop'])
        """

        def stop(state: Any) -> bool:
            for name, rule in self.rules:
                if rule(state):
                    fired.append(name)
                    return True
            return False

        return stop


def stop_rules(
    total_steps: int,
    early: EarlyStopping | None = None,
    stop: Stop | None = None,
    collective: Collective | None = None,
) -> StopRules:
    """Return the stop rules known before the run: ``max_steps``, early stopping, the user's ``stop``.

    A user's predicate may differ between ranks: with a collective, the ranks agree on it.

    >>> stop_rules(10, stop=lambda state: False).names
    ('max_steps', 'stop')
    """
    rules = StopRules((("max_steps", max_steps_stop(total_steps)),))
    rules = rules.including("early_stopping", patience_exhausted(early) if early is not None else None)
    return rules.including("stop", agreed(stop, collective))


def agreed(stop: Stop | None, collective: Collective | None) -> Stop | None:
    """Return ``stop`` agreed on by every rank (``dist.agreed_stop``) when there is a collective."""
    return agreed_stop(stop, collective) if stop is not None and collective is not None else stop


@attrs.frozen(eq=False)
class Plan:
    """Everything a run is, before it runs: built by ``trainfold.trainer.planning.plan_for`` from its arguments."""

    model: nn.Module
    device: torch.device
    rank: int
    world_size: int
    collective: Collective | None
    inputs: Any  # hf.inputs.RunInputs
    sampler: Sampler
    schedule: RunLength
    optimizer: Any
    step_options: StepOptions
    step: Callable[..., Any]
    sharding: Any  # the DeviceMesh of a fully_shard module (fsdp), else None
    evals: EvalPlan
    logging: LoggingPlan
    checkpoints: CheckpointPlan
    reporters: ReporterPlan
    stops: StopRules
    early: EarlyStopping | None
    metric_key: str | None
    extras: dict[str, Any]
    run_settings: RunSettings  # the settings a checkpoint records and a resume judges (with the world size)
    seed: int
    streaming: StreamOptions
    callbacks: tuple[Any, ...] = ()
    callback_args: Any = None  # the TrainingArguments each TrainerCallback event is handed (HF's callback API)
    restore_callback_states: bool = False  # restore_callback_states_from_checkpoint
    observers: tuple[Callable[..., None], ...] = ()
    stream: Any = None  # a data.StateStream, which replaces sampler and stream

    @property
    def settings(self) -> dict[str, Any]:
        """Return the run's settings by name (``TrainingArguments.to_dict()`` and the world size)."""
        return self.run_settings.values

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes the run's files (rank 0)."""
        return self.rank == 0

    def with_early_stopping(self, early: EarlyStopping) -> Plan:
        """Return the plan with ``early`` as its early stopping (settings a resume restored), its stop rule too."""
        rules = tuple((n, patience_exhausted(early) if n == "early_stopping" else r) for n, r in self.stops.rules)
        return attrs.evolve(self, early=early, stops=StopRules(rules))

    @property
    def samples_per_step(self) -> int | None:
        """Return the samples of one optimizer step over all ranks (None: the stream does not know)."""
        return self.sampler.global_batch_size if self.stream is None else self.stream.samples_per_step


def logging_for(args: TrainingArguments, total_steps: int) -> LoggingPlan:
    """Return the run's ``LoggingPlan`` (``logging_strategy``, ``logging_steps``, ``logging_first_step``)."""
    return logging_plan(args.logging_strategy, args.logging_steps, args.logging_first_step, total_steps=total_steps)
