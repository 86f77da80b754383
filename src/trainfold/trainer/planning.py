"""``plan_for``: a run's ``Plan`` from ``train``'s arguments, each piece from its own small function.

>>> import tempfile, torch
>>> from trainfold.trainer.args import TrainingArguments
>>> model = torch.nn.Linear(2, 1)
>>> rows = [{"x": [1.0, 2.0], "labels": 0.5}] * 8
>>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=2,
...                          gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2)
>>> call = TrainCall(model, rows, rows, compute_loss_func=lambda outputs, labels, n: outputs.sum())
>>> plan = plan_for(args, call)
>>> plan.sampler.gradient_accumulation_steps, plan.schedule.total_steps, plan.stops.names
(2, 4, ('max_steps',))
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from trainfold.ckpt import read_metadata
from trainfold.ckpt.listing import catalog
from trainfold.ckpt.run_identity import RunSettings
from trainfold.core.collective import Collective
from trainfold.core.determinism import warm_up_kernels
from trainfold.core.neftune import neftune_objective
from trainfold.core.state import TrainState
from trainfold.data.global_batch import BATCH_KEYS, global_batch, split_global_batch
from trainfold.observe.logging import set_verbosity
from trainfold.observe.stopping import EarlyStopping
from trainfold.step import make_step
from trainfold.step.fsdp import fully_shard_model, make_mesh
from trainfold.step.plan import is_fully_sharded
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.callback_checks import check_observers, set_transformers_verbosity, split_early_stopping
from trainfold.trainer.evaluating import EvalPlan, eval_plan_for
from trainfold.trainer.extras import run_extras
from trainfold.trainer.inputs import RunInputs, device_for, own_loss_objective, run_inputs
from trainfold.trainer.optimizer import default_optimizer
from trainfold.trainer.plan import (
    CheckpointPlan,
    Plan,
    ReporterPlan,
    StepOptions,
    StreamOptions,
    logging_for,
    sampler_for,
    schedule_for,
    step_options,
    stop_rules,
)
from trainfold.trainer.validate import checked_loss

__all__ = ["TrainCall", "plan_for", "process_settings", "elastic_args", "world_of", "early_stopping_for", "step_for"]


def world_of(collective: Collective | None) -> tuple[int, int]:
    """Return ``(rank, world_size)`` of the run: ``(0, 1)`` alone."""
    if collective is None:
        return 0, 1
    return collective.rank, getattr(collective, "world_size", 1)


def early_stopping_for(
    args: TrainingArguments, callbacks: Sequence[Any], early_stopping: EarlyStopping | None
) -> tuple[tuple[Any, ...], EarlyStopping | None, str | None]:
    """Return ``(callbacks, early stopping, best-model metric)``: an ``EarlyStoppingCallback`` becomes the record.

    Without ``metric_for_best_model`` the early stopper's metric is tracked as best.
    """
    if callbacks:  # an EarlyStoppingCallback becomes trainfold's early stopping; the others are checked
        callbacks, early_stopping = split_early_stopping(callbacks, args, early_stopping)
    metric_key = args.metric_key
    if early_stopping is not None and metric_key is None:
        metric = early_stopping.metric
        metric_key = metric if metric.startswith("eval_") else f"eval_{metric}"
    return tuple(callbacks), early_stopping, metric_key


def step_for(
    model: nn.Module, inputs: RunInputs, optimizer: Any, options: StepOptions, collective: Collective | None
) -> tuple[Callable[..., Any], Any]:
    """Return ``(step, mesh)``: ``make_step`` with the run's loss, objective (NEFTune's noise) and options.

    ``fsdp="full_shard"`` wraps ``model`` with ``fully_shard`` first (``step.fsdp``; in place, before its
    state is made); ``mesh`` is the mesh of a fully-sharded module (None otherwise).
    """
    mesh = None
    if options.fsdp is not None and not is_fully_sharded(model):
        mesh = make_mesh(getattr(collective, "group", None))
        fully_shard_model(model, mesh, options.fsdp)
    elif is_fully_sharded(model):  # the user's own fully_shard: its params carry their mesh
        mesh = next(p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh"))
    objective = inputs.objective
    if options.neftune_noise_alpha is not None:
        objective = neftune_objective(model, options.neftune_noise_alpha, inputs.loss, objective=objective)
    step = make_step(
        model, inputs.loss, optimizer, objective=objective, label_key=options.label_key, collective=collective,
        execution=options.execution,
    )  # fmt: skip
    return step, mesh


@attrs.frozen(eq=False)
class TrainCall:
    """What a ``train`` call gives beside its ``TrainingArguments`` (``train``'s own names and defaults): the model
    and data, the parts that replace the defaults, what watches or ends the run, and where it resumes from."""

    model: nn.Module
    train_dataset: Any
    eval_dataset: Any = None
    data_collator: Callable[[list[Any]], Any] | None = None
    compute_loss_func: Callable[..., Any] | None = None
    objective: Callable[..., Any] | None = None
    compute_metrics: Callable[..., Any] | None = None
    preprocess_logits_for_metrics: Callable[..., Any] | None = None
    optimizer: Any = None
    observers: Sequence[Callable[[TrainState, Mapping[str, Any]], None]] = ()
    resume_from_checkpoint: bool | str | os.PathLike | None = None
    early_stopping: EarlyStopping | None = None
    stop: Callable[[TrainState], bool] | None = None
    collective: Collective | None = None
    weights_only_warm_start: bool = False
    callbacks: Sequence[Any] = ()
    train_stream: Any = None  # a data.StateStream: replaces the sampler and stream
    processing_class: Any = None


def plan_for(args: TrainingArguments, call: TrainCall) -> Plan:
    """Return the run ``train`` makes of ``args`` and ``call``, checked, before any step; nothing else happens
    (``process_settings`` sets the process's, ``elastic_args`` the batch split of a resume, before it)."""
    device, (rank, world_size), model = device_for(args), world_of(call.collective), call.model
    loss = checked_loss(call.compute_loss_func)  # a result that is not a 0-d tensor is refused by name
    given = (call.data_collator, loss, own_loss_objective(model, loss, call.objective))  # a task with no own loss
    where = dict[str, Any](world_size=world_size, device=device, processing_class=call.processing_class)
    inputs = run_inputs(model, args, call.train_dataset, call.eval_dataset, *given, **where)
    sampler = sampler_for(args, inputs.train_dataset, world_size=world_size, rank=rank)
    schedule = schedule_for(args, sampler, call.train_stream)
    evals = _evals(args, inputs, schedule.total_steps, device, call)
    check_observers(call.observers)
    callbacks, early, metric_key = early_stopping_for(args, call.callbacks, call.early_stopping)
    optimizer = call.optimizer or default_optimizer(model, args.optimizer_settings(), schedule.total_steps)
    options = step_options(args, inputs.columns.label_key)
    step, sharding = step_for(model, inputs, optimizer, options, call.collective)
    stream = call.train_stream
    return Plan(
        model=model,
        device=device,
        rank=rank,
        world_size=world_size,
        collective=call.collective,
        inputs=inputs,
        sampler=sampler,
        schedule=schedule,
        optimizer=optimizer,
        step_options=options,
        step=step,
        sharding=sharding,
        evals=evals,
        early=early,
        metric_key=metric_key,
        extras=run_extras(args, metric_key=metric_key, early=early, stream_extras=stream and stream.extras),
        run_settings=RunSettings.of(args, world_size=world_size),
        seed=args.seed,
        streaming=StreamOptions.from_args(args, device),
        callbacks=callbacks,
        callback_args=args,
        restore_callback_states=args.restore_callback_states_from_checkpoint,
        observers=tuple(call.observers),
        stream=stream,
        logging=logging_for(args, schedule.total_steps),
        checkpoints=CheckpointPlan.from_args(args, call.processing_class),
        reporters=ReporterPlan.from_args(args, writer=rank == 0),
        stops=stop_rules(schedule.total_steps, early, call.stop, call.collective),
    )


def process_settings(args: TrainingArguments, main_process: bool) -> None:
    """Set what ``args`` say of this process, where a run starts: the kernels warmed up (see determinism) and the
    verbosity of the transformers and trainfold loggers (events once, from rank 0), as the HF Trainer's __init__."""
    warm_up_kernels(dtypes=(torch.float32, torch.bfloat16) if args.bf16 else (torch.float32,))
    set_transformers_verbosity(args.log_level, main_process=main_process)
    set_verbosity(args.log_level, main_process=main_process)


def _evals(args: TrainingArguments, inputs: RunInputs, total_steps: int, device: Any, call: TrainCall) -> EvalPlan:
    return eval_plan_for(
        args,
        inputs.eval_dataset,
        inputs.eval_collate,
        total_steps=total_steps,
        loss=inputs.loss,
        device=device,
        collective=call.collective,
        objective=inputs.eval_objective,
        label_key=inputs.columns.label_key,
        evaluator=call.train_stream.evaluate if call.train_stream is not None else None,
        compute_metrics=call.compute_metrics,
        preprocess_logits_for_metrics=call.preprocess_logits_for_metrics,
    )


def _split_only(here: RunSettings, saved: Mapping[str, Any]) -> bool:
    """Say whether the settings ``saved`` (a checkpoint's) differ from ``here`` in the batch split alone."""
    return all(k in BATCH_KEYS or v == here.values.get(k) for k, v in here.trajectory(saved).items())


def elastic_args(args: TrainingArguments, resume_from_checkpoint: Any, world_size: int) -> TrainingArguments:
    """Return ``args`` with the batch split (``split_global_batch``, said in a warning) that keeps the resumed run's
    global batch on ``world_size`` ranks, read from the checkpoint the resume takes (never ``trainfold-run.json``,
    which each start rewrites); ``args`` themselves when not resuming or when they already make that batch."""
    here, found = RunSettings.of(args, world_size=world_size), []
    with contextlib.suppress(OSError, ValueError):  # one unreadable (or gone since listed): claim names what is wrong
        if resume_from_checkpoint is True:  # the newest checkpoint of this run but for the split: claim resumes it
            found = [meta["settings"] for _, meta in catalog(args.output_dir)]
        elif resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            found = [read_metadata(resume_from_checkpoint)["settings"]]
    saved = next((s for s in reversed(found) if _split_only(here, s)), None)
    batch = global_batch(saved or {})
    # whenever the global batch differs, not only on another world size: a run of 2 ranks resumed on 1 saves its
    # later checkpoints with the adjusted split (1 rank), and the same 1-process command resumes those again
    if saved is None or batch is None or batch == global_batch(here.values):
        return args
    size, steps = split_global_batch(batch, world_size=world_size, per_device=args.per_device_train_batch_size)
    warnings.warn(
        f"resuming a run of {saved['world_size']} ranks on {world_size}: per_device_train_batch_size "
        f"{args.per_device_train_batch_size} -> {size}, gradient_accumulation_steps {args.gradient_accumulation_steps} "
        f"-> {steps} keep its global batch of {batch} samples per step (trainfold.data.global_batch)",
        stacklevel=3,
    )
    return args.replace(per_device_train_batch_size=size, gradient_accumulation_steps=steps)
