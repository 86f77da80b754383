"""``train(model, args, train_dataset, ...)``: the HF Trainer's features, wired from the functional parts.

``train`` owns no logic of its own beyond the wiring: the sampler and stream come from
``samplers``/``data``, the step from ``step``, evaluation from ``evaluation``, logging from
``observe``/``reporters``, checkpoints from ``checkpoint``/``preempt``. Each part works alone;
``train`` composes them from ``TrainingArguments`` and returns a ``TrainResult``. Nothing passed
in is changed: the model only lends its forward function, and the trained tensors are in
``result.state`` (``result.apply_to(model)`` copies them into a module when you want that).
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from trainfold import checkpoint as ckpt
from trainfold import checkpoint_policy as policy
from trainfold.amp import SCALER, LossScaling, initial_scaler
from trainfold.args import TrainingArguments
from trainfold.data import KeyedCollate, StepBatch, keyed, pad_collate, stream
from trainfold.determinism import warm_up_kernels
from trainfold.distributed import agreed_stop, evaluate_sharded, shard
from trainfold.eval_schedule import check_eval_schedule, should_evaluate
from trainfold.evaluation import evaluate as evaluate_batches, predict as predict_batches
from trainfold.fold import any_of, max_steps as max_steps_stop, trajectory
from trainfold.losses import causal_lm, label_smoothed
from trainfold.neftune import neftune_objective
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
from trainfold.stopping import EarlyStopping, patience_exhausted, record_evaluation
from trainfold.optim import GradientTransformation, adamw, chain, clip_by_global_norm, decay_mask, sgd
from trainfold.preempt import JIT_SIGNALS, guarded, jit_checkpoint, preemption_guard
from trainfold.reporters import make_reporters, progress as make_progress
from trainfold.samplers import make_sampler
from trainfold.schedules import named, warmup_steps_for
from trainfold.state import TrainState, init_state, split_module
from trainfold.step import Collective, make_step

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
    status: str  # "completed", "stopped" (a stop predicate or early stopping) or "preempted"
    metrics: dict[str, float]
    log_history: list[dict[str, Any]]
    best_checkpoint: Path | None = None
    last_checkpoint: Path | None = None
    signal: int | None = None  # the signal that preempted the run (SIGTERM, SIGINT): exit 128 + it

    @property
    def global_step(self) -> int:
        """Return the optimizer steps done."""
        return int(self.state.step)

    def apply_to(self, model: nn.Module) -> nn.Module:
        """Copy the trained tensors into ``model`` (in place; the one explicit mutation) and return it."""
        weights = ckpt.model_weights(self.state, model)
        model.load_state_dict(weights, strict=False)
        return model


def default_optimizer(model: nn.Module, args: TrainingArguments, total_steps: int) -> GradientTransformation:
    """Return the HF Trainer's optimizer: clipping at ``max_grad_norm``, then ``optim`` on the schedule.

    ``optim`` is AdamW (``adamw_torch_fused``: torch's fused kernel; ``adamw_torch``: foreach ops)
    or ``sgd`` (``optim_args`` momentum, dampening, nesterov). Biases and normalisation weights are
    not decayed (by module type and by name).

    >>> import torch
    >>> opt = default_optimizer(torch.nn.Linear(2, 1), TrainingArguments(learning_rate=0.1), total_steps=10)
    >>> [t.spec["name"] for t in opt.spec["transforms"]]
    ['clip_by_global_norm', 'adamw']
    >>> default_optimizer(torch.nn.Linear(2, 1), TrainingArguments(max_grad_norm=0), total_steps=10).spec["name"]
    'adamw'
    """
    warmup = warmup_steps_for(args.warmup_steps, total_steps)
    schedule = named(args.lr_scheduler_type, args.learning_rate, warmup, total_steps, **(args.lr_scheduler_kwargs or {}))
    if args.optim == "sgd":  # HF: torch.optim.SGD with the decay/no-decay groups, options from optim_args
        options = {"weight_decay": args.weight_decay, **args.optimizer_options}
        opt = sgd(schedule, mask=decay_mask(model), **options)
    else:
        opt = adamw(schedule, args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay, mask=decay_mask(model),
                    implementation="fused" if args.optim == "adamw_torch_fused" else "foreach")
    return chain(clip_by_global_norm(args.max_grad_norm), opt) if args.max_grad_norm > 0 else opt


# -- inputs ----------------------------------------------------------------------------------------


def _accepted_keys(model: nn.Module, args: TrainingArguments) -> frozenset[str] | None:
    """Return the batch keys the model's forward takes (plus labels), or None when it takes any."""
    if not args.remove_unused_columns:
        return None
    params = inspect.signature(model.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params) | set(args.label_names)


def _drop_unused(items: Sequence[Any], keep: frozenset[str] | None) -> list[Any]:
    if keep is None:
        return list(items)
    return [{k: v for k, v in item.items() if k in keep} if isinstance(item, Mapping) else item for item in items]


@attrs.frozen
class _Columns:
    """A collator that drops the keys the model does not take (HF's ``remove_unused_columns``)."""

    collate: Callable[[list[Any]], Any]
    keep: frozenset[str] | None

    def __call__(self, items: list[Any]) -> Any:
        return self.collate(_drop_unused(items, self.keep))


@attrs.frozen
class _KeyedColumns:
    """``_Columns`` for a keyed collator ``fn(items, keys)``."""

    collate: Callable[[list[Any], Sequence[int]], Any]
    keep: frozenset[str] | None

    def __call__(self, items: list[Any], keys: Sequence[int]) -> Any:
        return self.collate(_drop_unused(items, self.keep), keys)


def _columns(collate: Callable[..., Any] | None, keep: frozenset[str] | None) -> Callable[..., Any]:
    """Wrap ``collate`` (default: padding) so it drops unused keys, keeping it keyed when it is."""
    collate = collate or pad_collate()
    if isinstance(collate, KeyedCollate):
        return keyed(_KeyedColumns(collate.fn, keep))
    return _Columns(collate, keep)


def _eval_collate(collate: Callable[..., Any] | None, keep: frozenset[str] | None) -> Callable[[list[Any]], Any]:
    """Return the collator for evaluation: a keyed collator gets fixed keys (evaluation draws nothing new)."""
    wrapped = _columns(collate, keep)
    if isinstance(wrapped, KeyedCollate):
        return lambda items: wrapped(items, [0] * len(items))
    return wrapped


def _to_device(batches: Iterable[StepBatch], device: torch.device) -> Iterator[StepBatch]:
    if device.type == "cpu":
        yield from batches
        return
    for b in batches:
        moved = [{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in b]
        yield StepBatch(moved, b.cursor, getattr(b, "indices", ()))


def _eval_batches(dataset: Any, collate: Callable[[list[Any]], Any], batch_size: int, device: torch.device) -> Iterator[Any]:
    """Yield eval batches in dataset order (never length-grouped)."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        chunks: Iterable[list[Any]] = (
            [dataset[i] for i in range(s, min(s + batch_size, len(dataset)))] for s in range(0, len(dataset), batch_size)
        )
    else:
        def chunked() -> Iterator[list[Any]]:
            buf: list[Any] = []
            for item in dataset:
                buf.append(item)
                if len(buf) == batch_size:
                    yield buf
                    buf = []
            if buf:
                yield buf

        chunks = chunked()
    for items in chunks:
        batch = collate(items)
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


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
    eval_batches: Callable[[TrainState], Iterable[Any]] | None
    compute_metrics: Callable[..., Any] | None
    preprocess_logits_for_metrics: Callable[..., Any] | None
    reporters: Any
    observers: Sequence[Callable[[TrainState, Mapping[str, Any]], None]]
    history: list[dict[str, Any]]
    total_steps: int
    steps_per_epoch: int
    settings: dict[str, Any]
    metric_key: str | None
    early: EarlyStopping | None
    is_writer: bool
    collective: Collective | None = None  # set when evaluation is sharded across ranks


def _evaluate_state(run: _Run, state: TrainState) -> dict[str, float]:
    assert run.eval_batches is not None
    return evaluate_sharded(
        run.model, state.params, run.eval_batches(state), collective=run.collective, loss=run.loss, buffers=state.buffers,
        compute_metrics=None if run.args.prediction_loss_only else run.compute_metrics, preprocess_logits_for_metrics=run.preprocess_logits_for_metrics,
        eval_accumulation_steps=run.args.eval_accumulation_steps, prediction_loss_only=run.args.prediction_loss_only,
    )


def _record_eval(run: _Run, state: TrainState, metrics: Mapping[str, Any], *, track: bool = True) -> tuple[TrainState, bool]:
    """Log an evaluation, track the best metric and early stopping; return (state, new best?).

    ``track=False`` (``eval_on_start``) only logs: there is no checkpoint of step 0 to call best.
    """
    entry = eval_entry(metrics, state, steps_per_epoch=run.steps_per_epoch)
    run.history.append(entry)
    run.reporters.log(entry, int(state.step))
    notify(run.observers, state, entry)
    new_best = False
    if not track:
        return state, new_best
    if run.metric_key is not None:
        if run.metric_key not in metrics:
            raise KeyError(
                f"metric_for_best_model {run.args.metric_for_best_model!r} is not among the eval metrics "
                f"{sorted(metrics)}; name one of them (without or with the 'eval_' prefix)"
            )
        best, new_best = policy.update_best(state.extras[BEST], metrics[run.metric_key], int(state.step))
        state = attrs.evolve(state, extras={**state.extras, BEST: best})
    if run.early is not None:
        state = record_evaluation(run.early, state, metrics)
    return state, new_best


def _save(run: _Run, state: TrainState, *, jit: bool = False) -> Path:
    best: policy.BestMetric | None = state.extras.get(BEST)
    metadata = {
        "log_history": run.history,
        "best_metric": None if best is None or int(best.step) < 0 else float(best.value),
        "best_step": None if best is None or int(best.step) < 0 else int(best.step),
    }
    options = dict(model=run.model, metadata=metadata, settings=run.settings, save_only_model=run.args.save_only_model)
    if jit:
        return jit_checkpoint(state, run.args.output_dir, **options)
    path = ckpt.save(state, ckpt.checkpoint_path(run.args.output_dir, int(state.step)), **options)
    keep = [path]
    if best is not None and int(best.step) >= 0:
        keep.append(ckpt.checkpoint_path(run.args.output_dir, int(best.step)))
    policy.rotate(run.args.output_dir, run.args.save_total_limit, keep=keep)
    return path


def _after_step(run: _Run, saved: list[Path]) -> Callable[[TrainState], TrainState]:
    """Return the side effects after each step as ``state -> state``: log, evaluate, save."""
    args = run.args
    plan = logging_plan(args.logging_strategy, args.logging_steps, args.logging_first_step, total_steps=run.total_steps)

    class _History:
        def log(self, entry: Mapping[str, Any], step: int) -> None:
            run.history.append(dict(entry))
            run.reporters.log(entry, step)

    history, window = _History(), MetricWindow()

    def after(state: TrainState) -> TrainState:
        step = int(state.step)
        epoch_end = int(state.cursor.position) == 0
        last = step >= run.total_steps
        window.add(state)
        state = log_if_due(state, plan, [history], run.observers, steps_per_epoch=run.steps_per_epoch,
                           epoch_end=epoch_end, last=last, window=window)
        new_best = False
        if run.eval_batches is not None and should_evaluate(
            step, epoch_end, eval_strategy=args.eval_strategy, eval_steps=args.eval_steps,
            logging_steps=args.logging_steps, eval_delay=args.eval_delay, max_steps=run.total_steps,
            epoch=step / run.steps_per_epoch,
        ):
            state, new_best = _record_eval(run, state, _evaluate_state(run, state))
        if run.is_writer and policy.should_save(step, save_strategy=args.save_strategy, save_steps=args.save_steps,
                                              epoch_end=epoch_end, max_steps=run.total_steps, new_best=new_best):
            saved.append(_save(run, state))
        return state

    return after


def _initial_state(model: nn.Module, optimizer: GradientTransformation, args: TrainingArguments,
                   metric_key: str | None, early: EarlyStopping | None, device: torch.device) -> TrainState:
    extras = initial_extras(*([early] if early is not None else []), tokens_seen=args.tokens_seen != "no")
    if args.fp16:
        extras[SCALER] = initial_scaler(LossScaling())
    if metric_key is not None:
        extras[BEST] = policy.best_metric(policy.greater_is_better_for(metric_key, args.greater_is_better))
    state = init_state(model, optimizer, seed=args.seed, extras=extras)
    if device.type != "cpu":
        move = lambda t: {k: v.to(device) for k, v in t.items()}  # noqa: E731
        state = attrs.evolve(state, params=move(state.params), buffers=move(state.buffers),
                             opt_state=_retarget(state.opt_state, device))
    return state


def _retarget(node: Any, device: torch.device) -> Any:
    """Return a record with every tensor on ``device``, except integer counters (they stay on the CPU)."""
    if isinstance(node, torch.Tensor):
        return node if node.dim() == 0 and not node.is_floating_point() else node.to(device)
    if attrs.has(type(node)):
        return attrs.evolve(node, **{f.name: _retarget(getattr(node, f.name), device) for f in attrs.fields(type(node)) if f.init})
    if isinstance(node, Mapping):
        return {k: _retarget(v, device) for k, v in node.items()}
    if isinstance(node, tuple):
        return tuple(_retarget(v, device) for v in node)
    return node


@guarded(lambda call: call["args"].enable_jit_checkpoint)  # the guard is up from the first line (issue 23)
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
) -> TrainResult:
    """Train ``model`` on ``train_dataset`` as ``args`` say; return the final state and the run's record.

    ``compute_loss_func(outputs, labels, num_items_in_batch)`` is the loss (default: causal LM);
    ``objective`` replaces the forward pass and loss together. ``optimizer`` replaces the default
    (clipping + AdamW on ``lr_scheduler_type``). ``observers`` are called ``(state, logs)`` on every
    log. ``early_stopping`` (from ``trainfold.stopping.early_stopping``) and ``stop(state)`` end the
    run early (status ``stopped``); a SIGTERM with ``enable_jit_checkpoint`` ends it at the next step
    boundary with a checkpoint (status ``preempted``).

    >>> import tempfile, torch
    >>> from trainfold.models import TinyLM, TinyLMConfig
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
    world_size = getattr(collective, "world_size", 1) if collective is not None else 1
    loss = compute_loss_func or causal_lm
    if args.label_smoothing_factor:
        if objective is not None:
            raise ValueError("label_smoothing_factor smooths the loss, but an objective replaces it; smooth inside "
                             "the objective, or set label_smoothing_factor=0")
        loss = label_smoothed(loss, args.label_smoothing_factor)  # names the fix for a custom loss
    collate = _columns(data_collator, _accepted_keys(model, args))
    sampler = make_sampler(
        args.train_sampling_strategy, train_dataset, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=world_size, rank=rank,
        drop_last=args.dataloader_drop_last, seed=args.data_seed if args.data_seed is not None else args.seed,
        length_column_name=args.length_column_name, model_input_name=args.model_input_name,
    )
    steps_per_epoch = sampler.steps_per_epoch() if sampler.num_samples is not None else None
    if args.max_steps > 0:
        total_steps = args.max_steps
    elif steps_per_epoch is None:
        raise ValueError("a train_dataset without __len__ needs max_steps > 0 (the number of epochs gives no step count)")
    else:
        total_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
    num_epochs = None if args.max_steps > 0 else math.ceil(args.num_train_epochs)
    check_eval_schedule(
        eval_strategy=args.eval_strategy, eval_steps=args.eval_steps, logging_steps=args.logging_steps,
        eval_delay=args.eval_delay, eval_on_start=args.eval_on_start, has_eval_data=eval_dataset is not None,
        max_steps=total_steps,
    )
    if args.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(f"eval_strategy={args.eval_strategy!r} needs an eval_dataset; pass one or set eval_strategy='no'")
    metric_key = args.metric_key
    if early_stopping is not None and metric_key is None:
        metric_key = early_stopping.metric if early_stopping.metric.startswith("eval_") else f"eval_{early_stopping.metric}"
    optimizer = optimizer or default_optimizer(model, args, total_steps)
    if args.neftune_noise_alpha is not None:
        if objective is not None:
            objective = neftune_objective(model, args.neftune_noise_alpha, loss, objective=objective)
        else:
            objective = neftune_objective(model, args.neftune_noise_alpha, loss)
    step = make_step(model, loss, optimizer, objective=objective, collective=collective,
                     autocast=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
                     compile=args.compile, compile_mode=args.torch_compile_mode,
                     gradient_checkpointing=args.checkpoint_every, loss_scaling=LossScaling() if args.fp16 else None)

    state = _initial_state(model, optimizer, args, metric_key, early_stopping, device)
    history: list[dict[str, Any]] = []
    settings = _settings(args, world_size)
    source = ckpt.resume_checkpoint(resume_from_checkpoint, args.output_dir)
    if source is not None:
        meta = ckpt.read_metadata(source)
        policy.check_compatible(meta.get("settings", {}), settings, source=source)
        if weights_only_warm_start:
            state = ckpt.warm_start(source, like=state)
        else:
            state = ckpt.load(source, like=state)
            history = list(meta.get("metadata", {}).get("log_history", []))

    eval_collate = _eval_collate(data_collator, _accepted_keys(model, args))
    eval_batches = None
    # Under several ranks each scores a contiguous slice; sums, counts and predictions are merged exactly.
    shard_eval = (collective is not None and world_size > 1 and hasattr(eval_dataset, "__getitem__")
                  and hasattr(eval_dataset, "__len__") and len(eval_dataset) >= world_size)
    eval_source = shard(eval_dataset, rank, world_size) if shard_eval else eval_dataset
    if eval_dataset is not None:
        eval_batches = lambda _state: _eval_batches(eval_source, eval_collate, args.per_device_eval_batch_size, device)  # noqa: E731
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    saved: list[Path] = []
    start_state, started = state, time.monotonic()
    with make_reporters(args.reporters if rank == 0 else "none", args.output_dir, args.run_name, settings) as reporters:
        run = _Run(model, args, loss, eval_batches, compute_metrics, preprocess_logits_for_metrics, reporters,
                   tuple(observers), history, total_steps, steps_per_epoch or total_steps, settings, metric_key,
                   early_stopping, rank == 0, collective if shard_eval else None)
        if args.eval_on_start and source is None:
            state, _ = _record_eval(run, state, _evaluate_state(run, state), track=False)
        batches = _to_device(
            stream(train_dataset, sampler, collate, start=state.cursor, num_epochs=num_epochs, max_steps=None,
                   dataloader_num_workers=args.dataloader_num_workers,
                   dataloader_persistent_workers=args.dataloader_persistent_workers,
                   dataloader_prefetch_factor=args.dataloader_prefetch_factor,
                   dataloader_pin_memory=args.dataloader_pin_memory and device.type == "cuda"),
            device,
        )
        stops = [max_steps_stop(total_steps)]
        if early_stopping is not None:
            stops.append(patience_exhausted(early_stopping))
        if stop is not None:  # a user's predicate may differ between ranks: agree on it
            stops.append(agreed_stop(stop, collective) if collective is not None else stop)
        status = "completed"
        guard = preemption_guard(JIT_SIGNALS, collective=collective) if args.enable_jit_checkpoint else _no_guard()
        show = args.disable_tqdm is not True and rank == 0
        with guard as preemption, make_progress(total_steps, initial=int(state.step), enabled=None if show else False) as bar:
            all_stops = any_of(*stops, preemption.stop) if preemption is not None else any_of(*stops)
            counted = step if args.tokens_seen == "no" else counting_input_tokens(
                step, args.tokens_seen, args.model_input_name, collective)
            looped = observing(counted, _after_step(run, saved), tap(bar.update))
            for state in trajectory(looped, state, batches, all_stops):  # noqa: B007
                pass
            if preemption is not None and preemption.requested():
                # A signal after the last step (during the final save) ends nothing: the run is complete.
                done, here = int(state.step) >= total_steps, ckpt.checkpoint_path(args.output_dir, int(state.step))
                status = "completed" if done else "preempted"
                if rank == 0 and int(state.step) > int(start_state.step) and not (done and here in saved):
                    saved.append(_save(run, state, jit=True))  # none when no step ran here (a signal during setup)
            elif int(state.step) < total_steps and any(s(state) for s in stops[1:]):
                status = "stopped"
        samples = (int(state.step) - int(start_state.step)) * sampler.global_batch_size
        summary = train_summary(state, start_state, time.monotonic() - started, samples, steps_per_epoch=steps_per_epoch)
        history.append(summary)
        reporters.log(summary, int(state.step))
    best_path = None
    if BEST in state.extras and int(state.extras[BEST].step) >= 0:
        best_path = policy.best_checkpoint(args.output_dir, state.extras[BEST])
        if args.load_best_model_at_end and best_path is not None and status != "preempted":
            state = ckpt.load_weights(best_path, like=state)
    return TrainResult(state, status, summary, history, best_path, saved[-1] if saved else None,
                       preemption.signal if status == "preempted" and preemption is not None else None)


class _no_guard:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def evaluate(model: nn.Module, args: TrainingArguments, eval_dataset: Any, *, state: TrainState | None = None,
             data_collator: Callable[[list[Any]], Any] | None = None, compute_loss_func: Callable[..., Any] | None = None,
             compute_metrics: Callable[..., Any] | None = None, preprocess_logits_for_metrics: Callable[..., Any] | None = None,
             metric_key_prefix: str = "eval") -> dict[str, float]:
    """Evaluate ``state``'s params (default: the model's own) on ``eval_dataset``, in dataset order.

    >>> import tempfile, torch
    >>> from trainfold.models import TinyLM, TinyLMConfig
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
    params, buffers, batches = _eval_inputs(model, args, eval_dataset, state, data_collator)
    return evaluate_batches(
        model, params, batches, loss=compute_loss_func or causal_lm, buffers=buffers,
        compute_metrics=None if args.prediction_loss_only else compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics, eval_accumulation_steps=args.eval_accumulation_steps,
        prediction_loss_only=args.prediction_loss_only, metric_key_prefix=metric_key_prefix,
    )


def predict(model: nn.Module, args: TrainingArguments, test_dataset: Any, *, state: TrainState | None = None,
            data_collator: Callable[[list[Any]], Any] | None = None, compute_loss_func: Callable[..., Any] | None = None,
            compute_metrics: Callable[..., Any] | None = None, preprocess_logits_for_metrics: Callable[..., Any] | None = None,
            metric_key_prefix: str = "test") -> Any:
    """Return predictions, labels (dataset order) and metrics of ``state``'s params on ``test_dataset``.

    >>> import tempfile, torch
    >>> from trainfold.models import TinyLM, TinyLMConfig
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
    params, buffers, batches = _eval_inputs(model, args, test_dataset, state, data_collator)
    return predict_batches(
        model, params, batches, loss=compute_loss_func or causal_lm, buffers=buffers, compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics, eval_accumulation_steps=args.eval_accumulation_steps,
        metric_key_prefix=metric_key_prefix,
    )


def _eval_inputs(model: nn.Module, args: TrainingArguments, dataset: Any, state: TrainState | None,
                 data_collator: Callable[..., Any] | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """Return ``(params, buffers, batches)`` for ``evaluate``/``predict``: the state's tensors or the model's."""
    device = _device(args)
    if state is None:
        params, buffers = split_module(model)
        state_tensors = ({k: v.to(device) for k, v in params.items()}, {k: v.to(device) for k, v in buffers.items()})
    else:
        state_tensors = (state.params, state.buffers)
    collate = _eval_collate(data_collator, _accepted_keys(model, args))
    return (*state_tensors, _eval_batches(dataset, collate, args.per_device_eval_batch_size, device))
