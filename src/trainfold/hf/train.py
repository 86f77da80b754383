"""``train(model, args, train_dataset, ...)``: the HF Trainer's features, wired from the functional parts.

``train`` owns no logic of its own beyond the wiring: the sampler and stream come from
``samplers``/``data``, the step from ``step``, evaluation from ``evaluation``, logging from
``observe``/``reporters``, checkpoints from ``checkpoint``/``preempt``. Each part works alone;
``train`` composes them from ``TrainingArguments`` and returns a ``TrainResult``. As in HF, the
module given to ``train`` ends holding the final weights (the best ones with
``load_best_model_at_end``; the state at the end when the run is stopped or preempted), so
``model.save_pretrained()`` after ``train`` saves the trained model; the same tensors are in
``result.state``. ``train`` keeps one copy of the weights: it lends the module's own parameter
storage to the state (``init_state(..., copy=False)``) and donates every state to the next step, so
the update runs in place on the module's tensors. Hence the rule: the module holds the weights of
the latest state, whatever the status — a diverged run leaves it with the inf/NaN ones of
``result.state`` (load ``result.last_checkpoint`` for the last finite weights), a run that raises
leaves it with the weights of the last step that completed. The other parts never change a
module they are not lent (``result.apply_to(other)`` copies a result into another module).
"""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from trainfold import ckpt
from trainfold.ckpt import elastic_args, policy, run_dir
from trainfold.ckpt.preempt import JIT_SIGNALS, guarded, jit_checkpoint, preemption_guard
from trainfold.ckpt.sharded import Saver, is_sharded
from trainfold.core.collective import Collective
from trainfold.core.determinism import warm_up_kernels
from trainfold.core.fold import any_of, trajectory
from trainfold.core.fold import max_steps as max_steps_stop
from trainfold.core.losses import default_loss_for, label_smoothed, refuse_unlabelled
from trainfold.core.state import TrainState, counters, init_state, lend, split_module
from trainfold.data import StateStream, StepBatch, close_loader, eval_loader, stream
from trainfold.data.columns import Columns, columns_for, eval_collate, padded_to_multiple, with_columns
from trainfold.data.llm import lm_inputs
from trainfold.data.samplers import make_sampler
from trainfold.dist.distributed import agreed_stop, joins_torchrun, shard
from trainfold.eval import evaluate_sharded
from trainfold.eval.evaluation import eval_sets
from trainfold.eval.evaluation import evaluate as evaluate_batches
from trainfold.eval.evaluation import predict as predict_batches
from trainfold.eval.schedule import check_eval_schedule, should_evaluate
from trainfold.hf import callbacks as hf_callbacks
from trainfold.hf.args import TrainingArguments
from trainfold.observe import (
    MetricWindow,
    counting_input_tokens,
    eval_entry,
    initial_extras,
    log_if_due,
    logging_plan,
    notify,
    observing,
    tap,
    train_summary,
)
from trainfold.observe import history as log_file
from trainfold.observe.divergence import DIVERGED, diverged, divergence_message
from trainfold.observe.reporters import make_reporters
from trainfold.observe.reporters import progress as make_progress
from trainfold.observe.stopping import EarlyStopping, patience_exhausted, record_evaluation
from trainfold.optim import GradientTransformation, adamw, chain, clip_by_global_norm, decay_mask, sgd
from trainfold.optim.schedules import named, warmup_steps_for
from trainfold.recipes.neftune import neftune_objective
from trainfold.step import make_step, sharded
from trainfold.step.amp import SCALER, LossScaling, initial_scaler

__all__ = ["TrainResult", "train", "evaluate", "predict", "default_optimizer", "BEST"]

BEST = "best_metric"  # the key of the best-metric tracker in state.extras


@attrs.frozen(eq=False)
class TrainResult:
    """What ``train`` returns: the final state, its status and the record of the run.

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> model = torch.nn.Linear(2, 1)
    >>> state = init_state(torch.nn.Linear(2, 1), sgd(0.1))   # stands for a trained state
    >>> result = TrainResult(state, "completed", {"train_loss": 0.5}, [])
    >>> result.global_step, result.status
    (0, 'completed')
    >>> torch.equal(result.apply_to(model).weight, state.params["weight"])  # copy the tensors into a module
    True
    """

    state: TrainState
    # "completed", "stopped" (a stop predicate or early stopping), "preempted", or "diverged": the params
    # turned inf/NaN (``metrics["diverged_at_step"]`` says after which step); nothing non-finite was saved,
    # so ``last_checkpoint`` is the last finite one, and ``state`` holds the non-finite params (or the best
    # ones with ``load_best_model_at_end``)
    status: str
    metrics: dict[str, float]
    log_history: Sequence[dict[str, Any]]  # read lazily from output_dir/log_history.jsonl on the writer rank
    best_checkpoint: Path | None = None
    last_checkpoint: Path | None = None
    signal: int | None = None  # the signal that preempted the run (SIGTERM, SIGINT): exit 128 + it

    @property
    def global_step(self) -> int:
        """Return the optimizer steps done."""
        return int(self.state.step)

    def apply_to(self, model: nn.Module) -> nn.Module:
        """Copy the trained tensors into ``model`` (in place; the one explicit mutation) and return it.

        Every parameter (trainable or frozen, a tied one once) and every buffer, persistent or not,
        gets the state's value of the same name, on the module's own device and dtype.
        """
        tensors = {**self.state.buffers, **sharded.full_params(self.state.params)}  # shards: gathered (every rank)
        targets = [*model.named_parameters(), *model.named_buffers()]
        missing = [name for name, _ in targets if name not in tensors]
        if missing:
            raise KeyError(
                f"the model's {missing[:5]} are not in the state (params and buffers); pass the model "
                "the state was made from (init_state(model, ...))"
            )
        with torch.no_grad():
            for name, target in targets:
                if target.data_ptr() != tensors[name].data_ptr() or target.shape != tensors[name].shape:
                    target.copy_(tensors[name])  # a lent tensor already is the module's own
        return model


def default_optimizer(model: nn.Module, args: TrainingArguments, total_steps: int) -> GradientTransformation:
    """Return the HF Trainer's optimizer: clipping at ``max_grad_norm``, then ``optim`` on the schedule.

    ``optim`` is AdamW (``adamw_torch_fused``: torch's fused kernel; ``adamw_torch``: foreach ops)
    or ``sgd`` (``optim_args`` momentum, dampening, nesterov). Biases and normalisation weights are
    not decayed (by module type and by name).

    >>> import torch
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


# -- inputs ----------------------------------------------------------------------------------------


def _columns_of(
    model: nn.Module,
    args: TrainingArguments,
    data_collator: Callable[..., Any] | None,
    *,
    labels_required: bool = False,
    objective: Any = None,
) -> Columns:
    """Return which columns reach ``model`` (HF's ``remove_unused_columns``, ``label_names``; ``trainfold.data.columns``)."""
    return columns_for(
        model,
        label_names=args.label_names,
        remove_unused_columns=args.remove_unused_columns,
        length_column_name=args.length_column_name,
        default_collator=data_collator is None,
        labels_required=labels_required,
        reads=(*getattr(objective, "columns", ()), *getattr(data_collator, "columns", ())),
    )


def _to_device(batches: Iterable[StepBatch], device: torch.device) -> Iterator[StepBatch]:
    if device.type == "cpu":
        yield from batches
        return
    for b in batches:
        moved = [
            {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
            for mb in b
        ]
        yield StepBatch(moved, b.cursor, getattr(b, "indices", ()))


@attrs.frozen
class _EvalSet:
    """One eval set of a run: its metric prefix, its DataLoader, and the collective when it is sharded."""

    prefix: str
    loader: Any
    collective: Collective | None = None


def _eval_loader(
    dataset: Any, collate: Callable[[list[Any]], Any], args: TrainingArguments, device: torch.device
) -> Any:
    """Return the eval DataLoader in dataset order (never length-grouped), with HF's eval DataLoader settings."""
    return eval_loader(
        dataset,
        collate,
        args.per_device_eval_batch_size,
        dataloader_drop_last=args.dataloader_drop_last,
        dataloader_num_workers=args.dataloader_num_workers,
        dataloader_persistent_workers=args.dataloader_persistent_workers,
        dataloader_prefetch_factor=args.dataloader_prefetch_factor,
        dataloader_pin_memory=args.dataloader_pin_memory and device.type == "cuda",
    )


def _eval_set(
    prefix: str,
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    args: TrainingArguments,
    device: torch.device,
    collective: Collective | None,
) -> _EvalSet:
    """Return an eval set; under several ranks each scores a contiguous slice (sums, counts, predictions merged)."""
    world = getattr(collective, "world_size", 1) if collective is not None else 1
    whole = args.per_device_eval_batch_size * world if args.dataloader_drop_last else 1  # HF: whole global batches
    sharded = (
        collective is not None
        and world > 1
        and hasattr(dataset, "__getitem__")
        and hasattr(dataset, "__len__")
        and len(dataset) // whole * whole >= world
    )
    if sharded:
        mine = shard(dataset, collective.rank, world, whole)
        return _EvalSet(prefix, _eval_loader(mine, collate, args, device), collective)
    return _EvalSet(prefix, _eval_loader(dataset, collate, args, device))


def _device(args: TrainingArguments) -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() and not args.use_cpu else torch.device("cpu")


def _settings(args: TrainingArguments, world_size: int) -> dict[str, Any]:
    return {**args.to_dict(), "world_size": world_size}


# -- the run -----------------------------------------------------------------------------------------


@attrs.frozen
class _Run:
    """Everything a run closes over: its configuration and the side-effect targets."""

    model: nn.Module
    args: TrainingArguments
    loss: Callable[..., Any]
    eval_batches: tuple[_EvalSet, ...] | None
    compute_metrics: Callable[..., Any] | None
    preprocess_logits_for_metrics: Callable[..., Any] | None
    reporters: Any
    observers: Sequence[Callable[[TrainState, Mapping[str, Any]], None]]
    history: Any  # a history.HistoryFile on the writer rank, a list elsewhere: .append(entry)
    total_steps: int
    steps_per_epoch: int
    settings: dict[str, Any]
    metric_key: str | None
    early: EarlyStopping | None
    is_writer: bool
    collective: Collective | None = None  # the run's (None alone); each eval set holds its own
    label_key: str = "labels"  # label_names[0]
    diverged: list[int] = attrs.Factory(list)  # the step after which the params turned inf/NaN, if any
    run_id: run_dir.RunIdentity | None = None
    window: MetricWindow = attrs.field(factory=MetricWindow)
    objective: Callable[..., Any] | None = None  # the user's: evaluation scores eval batches with it (no NEFTune)
    evaluator: Callable[[TrainState], Mapping[str, float]] | None = None  # a StateStream's own evaluation
    saver: Saver = attrs.field(factory=Saver)  # sync or async (async_save); sharded states: every rank writes
    all_ranks_save: bool = False  # the state is sharded (DTensors): every rank takes part in each save


def _evaluate_state(run: _Run, state: TrainState) -> list[dict[str, float]]:
    """Return the metrics of each eval set (one; or each set of a dict, named ``eval_{name}_*``, as HF)."""
    assert run.eval_batches is not None
    if run.evaluator is not None:
        return [dict(run.evaluator(state))]
    if run.objective is not None:  # single process (train refuses a sharded objective evaluation)
        return [
            evaluate_batches(
                run.model,
                state.params,
                s.loader,
                objective=run.objective,
                buffers=state.buffers,
                compute_metrics=None if run.args.prediction_loss_only else run.compute_metrics,
                preprocess_logits_for_metrics=run.preprocess_logits_for_metrics,
                label_key=run.label_key,
                eval_accumulation_steps=run.args.eval_accumulation_steps,
                prediction_loss_only=run.args.prediction_loss_only,
                metric_key_prefix=s.prefix,
            )
            for s in run.eval_batches
        ]
    return [
        evaluate_sharded(
            run.model,
            sharded.full_params(state.params),
            s.loader,
            collective=s.collective,
            loss=run.loss,
            buffers=state.buffers,
            compute_metrics=None if run.args.prediction_loss_only else run.compute_metrics,
            preprocess_logits_for_metrics=run.preprocess_logits_for_metrics,
            eval_accumulation_steps=run.args.eval_accumulation_steps,
            prediction_loss_only=run.args.prediction_loss_only,
            label_key=run.label_key,
            metric_key_prefix=s.prefix,
        )
        for s in run.eval_batches
    ]


def _record_eval(
    run: _Run, state: TrainState, results: Sequence[Mapping[str, Any]], *, track: bool = True
) -> tuple[TrainState, bool]:
    """Log an evaluation (an entry per eval set, as HF), track the best metric and early stopping; (state, new best?).

    ``track=False`` (``eval_on_start``) only logs: there is no checkpoint of step 0 to call best.
    """
    metrics: dict[str, Any] = {}
    for one in results:
        entry = eval_entry(one, state, steps_per_epoch=run.steps_per_epoch)
        run.history.append(entry)
        run.reporters.log(entry, int(state.step))
        notify(run.observers, state, entry)
        metrics.update(one)
    new_best = False
    if not track:
        return state, new_best
    if run.metric_key is not None:
        if run.metric_key not in metrics:
            raise KeyError(
                f"metric_for_best_model {run.metric_key!r} is not among the eval metrics "
                f"{sorted(metrics)}; name one of them (without or with the 'eval_' prefix)"
                + (
                    "; with a dict eval_dataset each set's metrics are named eval_{name}_*"
                    if any(s.prefix != "eval" for s in run.eval_batches or ())
                    else ""
                )
            )
        best, new_best = policy.update_best(state.extras[BEST], metrics[run.metric_key], int(state.step))
        state = attrs.evolve(state, extras={**state.extras, BEST: best})
    if run.early is not None:
        state = record_evaluation(run.early, state, metrics)
    return state, new_best


def _save(run: _Run, state: TrainState, *, jit: bool = False) -> Path:
    best: policy.BestMetric | None = state.extras.get(BEST)
    if run.is_writer:  # the sidecar is rank 0's (the other ranks of a sharded save write their shards)
        run.history.sync()  # the entries the sidecar's offset covers are on disk first
    metadata = {
        "log": run.history.position() if run.is_writer else None,
        "window": log_file.window_state(run.window),
        "best_metric": None if best is None or int(best.step) < 0 else float(best.value),
        "best_step": None if best is None or int(best.step) < 0 else int(best.step),
    }
    identity = run.run_id.as_dict() if run.run_id is not None else None
    options = dict(
        model=run.model,
        metadata=metadata,
        settings=run.settings,
        save_only_model=run.args.save_only_model,
        run=identity,
    )
    if jit:
        run.saver.wait()  # an async save in flight is complete (or raised) first
        here = ckpt.checkpoint_path(run.args.output_dir, int(state.step))
        if run_dir.already_saved(here, identity, int(state.step), run.args.save_only_model):
            return ckpt.mark_jit(here) if run.is_writer else here  # the same state is there, complete: mark it
        if run.all_ranks_save:
            return run.saver.save(state, here, jit=True, wait=True, **options)
        return jit_checkpoint(state, run.args.output_dir, **options)
    path = ckpt.checkpoint_path(run.args.output_dir, int(state.step))
    keep = [path]
    if best is not None and int(best.step) >= 0:
        keep.append(ckpt.checkpoint_path(run.args.output_dir, int(best.step)))
    rotate = functools.partial(
        policy.rotate,
        run.args.output_dir,
        run.args.save_total_limit,
        keep=keep,
        run_id=identity["id"] if identity is not None else None,
    )
    return run.saver.save(state, path, on_commit=lambda _: rotate(), **options)  # rotates once it is complete


def _after_step(
    run: _Run, saved: list[Path], epoch_closed: Callable[[TrainState], TrainState] | None = None
) -> Callable[[TrainState], TrainState]:
    """Return the side effects after each step as ``state -> state``: log, evaluate, save.

    With ``epoch_closed`` (the HF callbacks' ``on_epoch_end``), an epoch's last step runs as HF's: its
    step-driven log/evaluation/save, then ``epoch_closed``, then those by epoch (``*_strategy="epoch"``).
    """
    args = run.args
    plan = logging_plan(args.logging_strategy, args.logging_steps, args.logging_first_step, total_steps=run.total_steps)
    late = hf_callbacks.by_epoch(args) if epoch_closed is not None else {}

    class _History:
        def log(self, entry: Mapping[str, Any], step: int) -> None:
            run.history.append(dict(entry))
            run.reporters.log(entry, step)

    history, window = _History(), run.window

    def after(state: TrainState) -> TrainState:
        step = int(state.step)
        epoch_end = int(state.cursor.position) == 0
        last = step >= run.total_steps
        window.add(state)
        if diverged(state):  # log the window that ended in it, then stop: no evaluation, no save
            run.diverged.append(step)
            last = True
        new_best = False
        for by_epoch in (False, True):
            if by_epoch:
                if epoch_closed is None or not (epoch_end or last):
                    break
                state = epoch_closed(state)
            if late.get("log", False) is by_epoch:
                state = log_if_due(
                    state,
                    plan,
                    [history],
                    run.observers,
                    steps_per_epoch=run.steps_per_epoch,
                    epoch_end=epoch_end,
                    last=last,
                    window=window,
                )
            if run.diverged:
                continue
            if (
                late.get("eval", False) is by_epoch
                and run.eval_batches is not None
                and should_evaluate(
                    step,
                    epoch_end,
                    eval_strategy=args.eval_strategy,
                    eval_steps=args.eval_steps,
                    logging_steps=args.logging_steps,
                    eval_delay=args.eval_delay,
                    max_steps=run.total_steps,
                    epoch=step / run.steps_per_epoch,
                    last=last,
                )
            ):
                state, new_best = _record_eval(run, state, _evaluate_state(run, state))
                if run.early is not None and patience_exhausted(run.early)(state):  # HF ends the epoch here: its
                    epoch_end = True  # on_epoch_end logs and saves by epoch at this step
                    state = log_if_due(
                        state,
                        plan,
                        [history],
                        run.observers,
                        steps_per_epoch=run.steps_per_epoch,
                        epoch_end=True,
                        last=True,
                        window=window,
                    )
            if (
                late.get("save", False) is by_epoch
                and (run.is_writer or run.all_ranks_save)
                and policy.should_save(
                    step,
                    save_strategy=args.save_strategy,
                    save_steps=args.save_steps,
                    epoch_end=epoch_end,
                    max_steps=run.total_steps,
                    new_best=new_best,
                    last=last,
                )
            ):
                if diverged(state, confirm=True):  # never write inf/NaN params over the finite checkpoints
                    run.diverged.append(step)
                    return state
                saved.append(_save(run, state))
        return state

    return after


def _callback_adapter(
    callbacks: Sequence[Any], run: _Run, saved: list[Path], state: TrainState, device: torch.device, rank: int
) -> tuple[_Run, hf_callbacks.HFCallbacks | None]:
    """Return the run whose reporters include the HF ``TrainerCallback`` adapter (begun), and the adapter."""
    if not callbacks:
        return run, None
    evaluate = (
        None if run.eval_batches is None else (lambda s: _record_eval(run, s, _evaluate_state(run, s))[0])
    )  # the run below, which reports to the adapter
    hf = hf_callbacks.HFCallbacks(
        callbacks,
        run.args,
        total_steps=run.total_steps,
        steps_per_epoch=run.steps_per_epoch,
        use_cpu=device.type == "cpu",
        saved=saved,
        evaluate=evaluate,
        history=run.history.history() if isinstance(run.history, log_file.HistoryFile) else run.history,
        save=lambda s: saved.append(_save(run, s)) if run.is_writer or run.all_ranks_save else None,
        rank=rank,
        best_key=BEST,
    )
    run = attrs.evolve(run, reporters=run.reporters.including(hf))
    hf.begin(state)
    return run, hf


def _initial_state(
    model: nn.Module,
    optimizer: GradientTransformation,
    args: TrainingArguments,
    metric_key: str | None,
    early: EarlyStopping | None,
    device: torch.device,
) -> TrainState:
    extras = initial_extras(*([early] if early is not None else []), tokens_seen=args.tokens_seen != "no")
    if args.fp16:
        extras[SCALER] = initial_scaler(LossScaling())
    if metric_key is not None:
        extras[BEST] = policy.best_metric(policy.greater_is_better_for(metric_key, args.greater_is_better))
    state = init_state(model, optimizer, seed=args.seed, extras=extras, copy=False)  # lent: one copy of the weights
    if device.type != "cpu":
        move = lambda t: {k: v.to(device) for k, v in t.items()}  # noqa: E731
        state = attrs.evolve(
            state, params=move(state.params), buffers=move(state.buffers), opt_state=_retarget(state.opt_state, device)
        )
    return state


def _retarget(node: Any, device: torch.device) -> Any:
    """Return a record with every tensor on ``device``, except integer counters (they stay on the CPU)."""
    if isinstance(node, torch.Tensor):
        return node if node.dim() == 0 and not node.is_floating_point() else node.to(device)
    if attrs.has(type(node)):
        return attrs.evolve(
            node, **{f.name: _retarget(getattr(node, f.name), device) for f in attrs.fields(type(node)) if f.init}
        )
    if isinstance(node, Mapping):
        return {k: _retarget(v, device) for k, v in node.items()}
    if isinstance(node, tuple):
        return tuple(_retarget(v, device) for v in node)
    return node


@guarded(lambda call: call["args"].enable_jit_checkpoint)  # the guard is up from the first line (issue 23)
@joins_torchrun  # under torchrun without collective=: join the process group for the run (issue 15, item 2)
def train(
    model: nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    eval_dataset: Any = None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    compute_loss_func: Callable[..., Any] | None = None,
    objective: Callable[..., Any] | None = None,
    compute_metrics: Callable[..., Any] | None = None,
    preprocess_logits_for_metrics: Callable[..., Any] | None = None,
    optimizer: GradientTransformation | None = None,
    observers: Sequence[Callable[[TrainState, Mapping[str, Any]], None]] = (),
    resume_from_checkpoint: bool | str | os.PathLike | None = None,
    *,
    early_stopping: EarlyStopping | None = None,
    stop: Callable[[TrainState], bool] | None = None,
    collective: Collective | None = None,
    weights_only_warm_start: bool = False,
    callbacks: Sequence[Any] = (),
    train_stream: StateStream | None = None,
) -> TrainResult:
    """Train ``model`` on ``train_dataset`` as ``args`` say; return the final state and the run's record.

    ``compute_loss_func(outputs, labels, num_items_in_batch)`` is the loss (default: the model's task's
    loss, ``losses.default_loss_for``: causal LM, classification, regression...);
    ``objective`` replaces the forward pass and loss together. ``eval_dataset`` may be a dict of
    named sets: each is evaluated on its own and logged with metrics ``eval_{name}_*``, as in HF.
    ``optimizer`` replaces the default (clipping + AdamW on ``lr_scheduler_type``). ``observers``
    are called ``(state, logs)`` on every log. ``early_stopping`` (from
    ``trainfold.observe.stopping.early_stopping``) and ``stop(state)`` end the run early (status
    ``stopped``); a SIGTERM with ``enable_jit_checkpoint`` ends it at the next step boundary with a
    checkpoint (status ``preempted``). A run whose parameters turn inf/NaN stops there (status
    ``diverged``, a warning, ``metrics["diverged_at_step"]``) without saving them; a float16 step
    that loss scaling skipped is not divergence. ``callbacks`` take ``transformers.TrainerCallback``
    objects (``trainfold.hf.callbacks``). Under ``torchrun`` it joins the process group itself
    (``collective=`` overrides), so N processes of batch B train as one of batch N×B. At the end
    ``model`` holds the final weights (the best ones with ``load_best_model_at_end``), as after
    HF's ``trainer.train()`` (train the module's own storage: see the module docstring for the rule on
    divergence and failure). ``train_stream`` (a
    ``data.StateStream``) replaces the sampler and stream with steps made from the state they start
    from: ``trainfold.recipes.grpo.train`` runs GRPO through it.

    >>> import tempfile, torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]
    >>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2,
    ...                          learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True,
    ...                          save_strategy="no")
    >>> result = train(model, args, rows)
    >>> result.status, result.global_step, round(result.log_history[0]["learning_rate"], 4)
    ('completed', 3, 0.01)
    >>> sorted(k for k in result.metrics if k.startswith("train_"))
    ['train_loss', 'train_runtime', 'train_samples_per_second', 'train_steps_per_second']
    """
    warm_up_kernels(dtypes=(torch.float32, torch.bfloat16) if args.bf16 else (torch.float32,))  # see determinism
    device = _device(args)
    rank = collective.rank if collective is not None else 0
    hf_callbacks.set_transformers_verbosity(args.log_level, main_process=rank == 0)  # as the HF Trainer's __init__
    world_size = getattr(collective, "world_size", 1) if collective is not None else 1
    args = elastic_args(args, resume_from_checkpoint, world_size)  # another world: the saved global batch
    loss = compute_loss_func or default_loss_for(model, defer=objective is not None)
    if args.label_smoothing_factor:
        if objective is not None:
            raise ValueError(
                "label_smoothing_factor smooths the loss, but an objective replaces it; smooth inside "
                "the objective, or set label_smoothing_factor=0"
            )
        loss = label_smoothed(loss, args.label_smoothing_factor)  # names the fix for a custom loss
    if objective is None:
        refuse_unlabelled(train_dataset, loss)  # a fully masked dataset would train nothing, forever
    elif eval_dataset is not None and world_size > 1:
        raise NotImplementedError(
            "evaluating an objective across ranks is not supported yet; evaluate after training "
            "in one process (trainfold.evaluate(..., objective=...)), or drop eval_dataset"
        )
    columns = _columns_of(model, args, data_collator, labels_required=objective is None, objective=objective)
    if getattr(objective, "prepare", None) is not None:  # DPO: precomputed reference log-probs, cached in output_dir
        objective, train_dataset, eval_dataset = objective.prepare(
            model, args, train_dataset, eval_dataset, padded_to_multiple(data_collator, args.pad_to_multiple_of), device
        )
    eval_objective = objective  # evaluation scores with the (prepared) user's objective: no NEFTune noise
    lm = lm_inputs(model, args, train_dataset, data_collator, compute_loss_func, objective)  # packing, chunked loss
    train_dataset, objective = lm.train_dataset, lm.objective
    collate = with_columns(padded_to_multiple(lm.data_collator, args.pad_to_multiple_of), columns)  # not for eval
    sampler = make_sampler(
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
    steps_per_epoch = sampler.steps_per_epoch() if sampler.num_samples is not None else None
    if train_stream is not None:  # the steps are made from the state (GRPO): the stream knows its epoch
        steps_per_epoch = train_stream.steps_per_epoch
    if args.max_steps > 0:
        total_steps = args.max_steps
    elif steps_per_epoch is None:
        raise ValueError(
            "a train_dataset without __len__ needs max_steps > 0 (the number of epochs gives no step count)"
        )
    else:
        total_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
    num_epochs = None if args.max_steps > 0 else math.ceil(args.num_train_epochs)
    check_eval_schedule(
        eval_strategy=args.eval_strategy,
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps,
        eval_delay=args.eval_delay,
        eval_on_start=args.eval_on_start,
        has_eval_data=eval_dataset is not None,
        max_steps=total_steps,
    )
    if args.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(
            f"eval_strategy={args.eval_strategy!r} needs an eval_dataset; pass one or set eval_strategy='no'"
        )
    hf_callbacks.check_observers(observers)
    if callbacks:  # an EarlyStoppingCallback becomes trainfold's early stopping; the others are checked
        callbacks, early_stopping = hf_callbacks.split_early_stopping(callbacks, args, early_stopping)
    metric_key = args.metric_key
    if early_stopping is not None and metric_key is None:
        metric_key = (
            early_stopping.metric if early_stopping.metric.startswith("eval_") else f"eval_{early_stopping.metric}"
        )
    optimizer = optimizer or default_optimizer(model, args, total_steps)
    if args.neftune_noise_alpha is not None:
        if objective is not None:
            objective = neftune_objective(model, args.neftune_noise_alpha, loss, objective=objective)
        else:
            objective = neftune_objective(model, args.neftune_noise_alpha, loss)
    step = make_step(
        model,
        loss,
        optimizer,
        objective=objective,
        collective=collective,
        label_key=columns.label_key,
        autocast=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
        compile=args.compile,
        compile_mode=args.torch_compile_mode,
        gradient_checkpointing=args.checkpoint_every,
        loss_scaling=LossScaling() if args.fp16 else None,
        sharding=(sharding := sharded.sharding_for(args.full_shard, collective)),
    )

    state = _initial_state(model, optimizer, args, metric_key, early_stopping, device)
    if train_stream is not None:  # what its prepare keeps in the state (a generation buffer) is in the template
        state = attrs.evolve(state, extras={**state.extras, **train_stream.extras})
    if sharding is not None:  # before the resume: a sharded checkpoint loads each rank's slab only
        state = sharded.shard_state(state, sharding.mesh)
    settings = _settings(args, world_size)
    claim = run_dir.claim(
        args.output_dir,
        resume_from_checkpoint,
        settings,
        run_dir.fingerprint(settings, run_dir.model_signature(state)),
        overwrite_output_dir=args.overwrite_output_dir,
        writer=rank == 0,
    )
    with claim.releasing_on_error():  # the lock is held until the run ends (the `with claim` below)
        source, window, meta = claim.source, MetricWindow(), None
        if source is not None:
            meta = ckpt.read_metadata(source)
            run_dir.check_step(meta, source, total_steps)
            policy.check_compatible(meta.get("settings", {}), settings, source=source)
            if weights_only_warm_start:
                state = ckpt.warm_start(source, like=state)
            else:
                state = ckpt.load(source, like=state)
                if "window" in meta["metadata"]:
                    log_file.restore_window(window, meta["metadata"]["window"], source)
            if not is_sharded(state):  # the loaded tensors go into the module's own: one copy again
                state = lend(model, state)
        resumed = source is not None and not weights_only_warm_start
        history = log_file.start(
            args.output_dir, source if resumed else None, meta["metadata"] if resumed else None, writer=rank == 0
        )
        if isinstance(history, log_file.HistoryFile):
            claim.on_release(history.close)
        if sharding is not None:  # a replicated checkpoint resumed sharded: its tensors are distributed
            state = sharded.shard_state(state, sharding.mesh)

    eval_collator = eval_collate(padded_to_multiple(data_collator, args.pad_to_multiple_of), columns)
    eval_batches = (
        tuple(
            _eval_set(prefix, dataset, eval_collator, args, device, collective)
            for prefix, dataset in eval_sets(eval_dataset).items()
        )
        or None
    )
    for eval_set in eval_batches or ():  # persistent eval workers stop with the run, also when it raises
        claim.on_release(functools.partial(close_loader, eval_set.loader))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    saved: list[Path] = []
    start_state, started = counters(state), time.monotonic()  # no second copy of the weights for the summary
    bar = make_progress(
        total_steps,
        initial=int(state.step),
        enabled=rank == 0,
        log_level=args.log_level,
        bar=None if args.disable_tqdm is None else not args.disable_tqdm,
    )  # the console
    with (
        claim,
        make_reporters(
            args.reporters if rank == 0 else "none",
            args.output_dir,
            args.run_name,
            settings,
            logging_dir=args.logging_dir,
        ) as reporters,
    ):  # claim first: released if this raises
        reporters = reporters.including(bar)  # the console shows each log, evaluation and the summary
        run = _Run(
            model,
            args,
            loss,
            eval_batches,
            compute_metrics,
            preprocess_logits_for_metrics,
            reporters,
            tuple(observers),
            history,
            total_steps,
            steps_per_epoch or total_steps,
            settings,
            metric_key,
            early_stopping,
            rank == 0,
            collective,
            label_key=columns.label_key,
            run_id=claim.run,
            window=window,
            objective=eval_objective,
            evaluator=train_stream.evaluate if train_stream is not None else None,
            saver=Saver(args.async_save, args.save_consolidated_model),
            all_ranks_save=is_sharded(state),
        )
        run, hf = _callback_adapter(callbacks, run, saved, state, device, rank)  # HF TrainerCallbacks, or None
        reporters = run.reporters
        if args.eval_on_start and source is None:
            state, _ = _record_eval(run, state, _evaluate_state(run, state), track=False)
        batches = (
            _to_device(
                stream(
                    train_dataset,
                    sampler,
                    collate,
                    start=state.cursor,
                    num_epochs=num_epochs,
                    max_steps=None,
                    dataloader_num_workers=args.dataloader_num_workers,
                    dataloader_persistent_workers=args.dataloader_persistent_workers,
                    dataloader_prefetch_factor=args.dataloader_prefetch_factor,
                    dataloader_pin_memory=args.dataloader_pin_memory and device.type == "cuda",
                ),
                device,
            )
            if train_stream is None
            else train_stream.steps(state.cursor)
        )
        stops = [max_steps_stop(total_steps)]
        if early_stopping is not None:
            stops.append(patience_exhausted(early_stopping))
        if stop is not None:  # a user's predicate may differ between ranks: agree on it
            stops.append(agreed_stop(stop, collective) if collective is not None else stop)
        if hf is not None:
            stops.append(agreed_stop(hf.stop, collective) if collective is not None else hf.stop)
        stops.append(lambda _state: bool(run.diverged))
        status = "completed"
        guard = preemption_guard(JIT_SIGNALS, collective=collective) if args.enable_jit_checkpoint else _no_guard()
        with guard as preemption:
            all_stops = any_of(*stops, preemption.stop) if preemption is not None else any_of(*stops)
            counted = (
                step.donating
                if args.tokens_seen == "no"
                else counting_input_tokens(  # never reuses a state
                    step.donating, args.tokens_seen, args.model_input_name, collective
                )
            )
            looped = observing(counted, _after_step(run, saved), tap(bar.update))
            if hf is not None:  # on_step_begin before the step, on_step_end before its log/eval/save
                looped = observing(
                    hf.wrap(counted), hf.step_end, _after_step(run, saved, hf.epoch_closed), hf.after, tap(bar.update)
                )
            if train_stream is not None:  # each step's batch is made from the state it starts from
                looped = _prepared(train_stream.prepare, looped)
            for state in trajectory(looped, state, batches, all_stops):  # noqa: B007
                pass
            run.saver.wait()  # the last async save is complete (its error raised) before the run reports
            if run.diverged or diverged(state, confirm=True):
                status = DIVERGED
                warnings.warn(divergence_message(state, saved[-1] if saved else None), RuntimeWarning, stacklevel=2)
            elif preemption is not None and preemption.requested():
                # A signal after the last step (during the final save) ends nothing: the run is complete.
                done, here = int(state.step) >= total_steps, ckpt.checkpoint_path(args.output_dir, int(state.step))
                status = "completed" if done else "preempted"
                if (
                    (rank == 0 or run.all_ranks_save)
                    and int(state.step) > int(start_state.step)
                    and not (done and here in saved)
                ):
                    saved.append(_save(run, state, jit=True))  # none when no step ran here (a signal during setup)
            elif int(state.step) < total_steps and any(s(state) for s in stops[1:]):
                status = "stopped"
        per_step = sampler.global_batch_size if train_stream is None else train_stream.samples_per_step
        samples = (int(state.step) - int(start_state.step)) * per_step if per_step is not None else None
        summary = train_summary(
            state, start_state, time.monotonic() - started, samples, steps_per_epoch=steps_per_epoch
        )
        if status == DIVERGED:
            summary["diverged_at_step"] = int(state.step)
        history.append(summary)
        reporters.log(summary, int(state.step))
        bar.close()
        if isinstance(history, log_file.HistoryFile):
            history.close()
            history = history.history()
    best_path = None
    if BEST in state.extras and int(state.extras[BEST].step) >= 0:
        best_path = policy.best_checkpoint(args.output_dir, state.extras[BEST])
        if args.load_best_model_at_end and best_path is not None and status != "preempted":
            state = ckpt.load_weights(best_path, like=state)
    result = TrainResult(
        state,
        status,
        summary,
        history,
        best_path,
        saved[-1] if saved else None,
        preemption.signal if status == "preempted" and preemption is not None else None,
    )
    result.apply_to(model)  # as HF: the module ends with the final (or best) weights; lent ones are already there
    return result


def _prepared(
    prepare: Callable[[TrainState, Any], tuple[TrainState, Any]], step: Callable[[TrainState, Any], TrainState]
) -> Callable[[TrainState, Any], TrainState]:
    return lambda state, item: step(*prepare(state, item))


class _no_guard:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def evaluate(
    model: nn.Module,
    args: TrainingArguments,
    eval_dataset: Any,
    *,
    state: TrainState | None = None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    compute_loss_func: Callable[..., Any] | None = None,
    compute_metrics: Callable[..., Any] | None = None,
    preprocess_logits_for_metrics: Callable[..., Any] | None = None,
    metric_key_prefix: str = "eval",
    objective: Callable[..., Any] | None = None,
) -> dict[str, float]:
    """Evaluate ``state``'s params (default: the model's own) on ``eval_dataset``, in dataset order.

    ``objective`` (e.g. the ``dpo_objective`` of the run) scores the batches and adds its metrics
    (``eval_rewards/chosen``...), as during ``train`` (``trainfold.eval.evaluation.evaluate``).

    >>> import tempfile, torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]
    >>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2,
    ...                          learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True,
    ...                          save_strategy="no")
    >>> before = evaluate(model, args, rows)
    >>> after = evaluate(model, args, rows, state=train(model, args, rows).state)
    >>> sorted(after), after["eval_loss"] < before["eval_loss"]
    (['eval_loss', 'eval_runtime', 'eval_samples_per_second', 'eval_steps_per_second'], True)
    """
    metrics: dict[str, float] = {}
    for prefix, dataset in eval_sets(eval_dataset, metric_key_prefix).items():  # a dict: each set, as HF
        params, buffers, batches, label_key = _eval_inputs(model, args, dataset, state, data_collator, objective)
        try:
            metrics.update(
                evaluate_batches(
                    model,
                    params,
                    batches,
                    loss=compute_loss_func or default_loss_for(model, defer=True),
                    buffers=buffers,
                    label_key=label_key,
                    objective=objective,
                    compute_metrics=None if args.prediction_loss_only else compute_metrics,
                    preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                    eval_accumulation_steps=args.eval_accumulation_steps,
                    prediction_loss_only=args.prediction_loss_only,
                    metric_key_prefix=prefix,
                )
            )
        finally:
            close_loader(batches)  # persistent workers end with the call
    return metrics


def predict(
    model: nn.Module,
    args: TrainingArguments,
    test_dataset: Any,
    *,
    state: TrainState | None = None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    compute_loss_func: Callable[..., Any] | None = None,
    compute_metrics: Callable[..., Any] | None = None,
    preprocess_logits_for_metrics: Callable[..., Any] | None = None,
    metric_key_prefix: str = "test",
    objective: Callable[..., Any] | None = None,
) -> Any:
    """Return predictions, labels (dataset order) and metrics of ``state``'s params on ``test_dataset``.

    >>> import tempfile, torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]
    >>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2,
    ...                          learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True,
    ...                          save_strategy="no")
    >>> out = predict(model, args, rows[:3])
    >>> out.predictions.shape, out.label_ids.tolist()[2], "test_loss" in out.metrics
    ((3, 4, 16), [2, 3, 4, 5], True)
    """
    if isinstance(test_dataset, dict):
        raise TypeError("predict takes one dataset, not a dict of them (as HF's Trainer.predict); call it per set")
    params, buffers, batches, label_key = _eval_inputs(model, args, test_dataset, state, data_collator, objective)
    try:
        return predict_batches(
            model,
            params,
            batches,
            loss=compute_loss_func or default_loss_for(model, defer=True),
            buffers=buffers,
            objective=objective,
            compute_metrics=compute_metrics,
            label_key=label_key,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            eval_accumulation_steps=args.eval_accumulation_steps,
            metric_key_prefix=metric_key_prefix,
        )
    finally:
        close_loader(batches)  # persistent workers end with the call


def _eval_inputs(
    model: nn.Module,
    args: TrainingArguments,
    dataset: Any,
    state: TrainState | None,
    data_collator: Callable[..., Any] | None,
    objective: Any = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any, str]:
    """Return ``(params, buffers, batches, label_key)`` for ``evaluate``/``predict``: the state's or the model's."""
    device = _device(args)
    if state is None:
        params, buffers = split_module(model)
        state_tensors = ({k: v.to(device) for k, v in params.items()}, {k: v.to(device) for k, v in buffers.items()})
    else:
        state_tensors = (state.params, state.buffers)
    columns = _columns_of(model, args, data_collator, objective=objective)  # keeps the columns it reads
    collate = eval_collate(padded_to_multiple(data_collator, args.pad_to_multiple_of), columns)
    return (*state_tensors, _eval_loader(dataset, collate, args, device), columns.label_key)
