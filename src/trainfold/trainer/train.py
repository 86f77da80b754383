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

The arguments: ``compute_loss_func(outputs, labels, num_items_in_batch)`` is the loss (default: the
model's task's loss, ``losses.default_loss_for``: causal LM, classification, regression...);
``objective`` replaces the forward pass and loss together. ``eval_dataset`` may be a dict of named
sets: each is evaluated on its own and logged with metrics ``eval_{name}_*``, as in HF. ``optimizer``
replaces the default (clipping + AdamW on ``lr_scheduler_type``). ``observers`` are called
``(state, logs)`` on every log. ``early_stopping`` (from ``trainfold.observe.stopping.early_stopping``)
and ``stop(state)`` end the run early (status ``stopped``); a SIGTERM with ``enable_jit_checkpoint``
ends it at the next step boundary with a checkpoint (status ``preempted``). A run whose parameters
turn inf/NaN stops there (status ``diverged``, a warning, ``metrics["diverged_at_step"]``) without
saving them; a float16 step that loss scaling skipped is not divergence. ``callbacks`` take
``transformers.TrainerCallback`` objects (``trainfold.trainer.callbacks``). Under ``torchrun`` it joins the
process group itself (``collective=`` overrides), so N processes of batch B train as one of batch N×B.
``processing_class`` (a tokenizer or processor, as HF's) pads the default collator's batches with its pad
id and is saved into every checkpoint (``AutoTokenizer.from_pretrained(checkpoint)`` loads it).
``train_stream`` (a ``data.StateStream``) replaces the sampler and stream with steps made from the
state they start from: ``trainfold.grpo.train`` runs GRPO through it.

The run is a ``Plan`` (``trainer.plan``), built before any step by ``trainer.planning.plan_for`` from these
arguments: the sampler, schedule, optimizer, step, eval plan (``trainer.evaluating``), checkpoint policy,
reporters and stop rules, each a record of its own; ``trainer.run`` holds the side effects after each
step, ``trainer.resume`` the first state.

>>> import tempfile, torch
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> _ = torch.manual_seed(0)
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]
>>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2,
...                          learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True,
...                          save_strategy="no")
>>> result = train(model, args, rows)
>>> result.status, result.global_step, result.log_history[0]["learning_rate"], "train_loss" in result.metrics
('completed', 3, 0.01, True)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from trainfold import ckpt
from trainfold.ckpt import policy
from trainfold.ckpt.sharded import Saver, is_sharded
from trainfold.core.collective import Collective
from trainfold.core.preempt import JIT_SIGNALS, guarded, preemption_guard
from trainfold.core.state import TrainState, counters
from trainfold.data import StateStream, is_stream_source, source_steps, stream
from trainfold.distributed.distributed import joins_torchrun
from trainfold.loop.directory import RunDir, open_run_dir
from trainfold.loop.run import run as loop_run
from trainfold.observe import TOKENS_SEEN, counting_input_tokens, train_summary
from trainfold.observe import history as log_file
from trainfold.observe.divergence import DIVERGED, diverged, divergence_message
from trainfold.observe.reporters import make_reporters
from trainfold.observe.reporters import progress as make_progress
from trainfold.observe.stopping import EarlyStopping
from trainfold.optim import GradientTransformation
from trainfold.step.fsdp import placed_like
from trainfold.trainer import validate as checks
from trainfold.trainer.args import GivenArguments, TrainingArguments
from trainfold.trainer.callbacks import HFCallbacks, resumed_callback_states
from trainfold.trainer.evaluating import evaluate, predict
from trainfold.trainer.extras import BEST
from trainfold.trainer.inputs import to_device
from trainfold.trainer.optimizer import default_optimizer
from trainfold.trainer.plan import STOPPING_RULES, Plan, agreed
from trainfold.trainer.planning import TrainCall, elastic_args, plan_for, process_settings, world_of
from trainfold.trainer.resume import Lookahead, Start, continuing_global_rng, initial_state, start_run
from trainfold.trainer.run import Run, callback_adapter, evaluate_and_record, run_hooks, save_checkpoint

_log = logging.getLogger(__name__)

__all__ = ["TrainResult", "train", "evaluate", "predict", "default_optimizer", "BEST"]


@attrs.frozen(eq=False)
class TrainResult:
    """What ``train`` returns: the final state, its status and the record of the run.

    >>> import torch
    >>> from trainfold.core.state import init_state
    >>> from trainfold.optim.base import sgd
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
    log_history: list[dict[str, Any]]  # every log entry of the run (a resumed one: from its start), a plain list
    best_checkpoint: Path | None = None
    last_checkpoint: Path | None = None
    signal: int | None = None  # the signal that preempted the run (SIGTERM, SIGINT): exit 128 + it

    @property
    def global_step(self) -> int:
        """Return the optimizer steps done."""
        return int(self.state.step)

    @property
    def exit_code(self) -> int:
        """Return the process exit status the run calls for: ``128 + signal`` when preempted (143: SIGTERM), else 0.

        >>> import signal
        >>> from trainfold.core.state import init_state
        >>> from trainfold.optim.base import sgd
        >>> state = init_state(torch.nn.Linear(2, 1), sgd(0.1))
        >>> TrainResult(state, "preempted", {}, [], signal=signal.SIGTERM).exit_code
        143
        >>> TrainResult(state, "completed", {}, []).exit_code
        0
        """
        if self.status != "preempted":
            return 0
        return 128 + int(self.signal if self.signal is not None else signal.SIGTERM)

    def exit_if_preempted(self) -> None:
        """Exit the process with ``exit_code`` (143 after SIGTERM) if the run was preempted; else return.

        Call it right after ``train``, before evaluating or saving: a preempted run is half-trained, its
        checkpoint is saved, and the scheduler (torchrun, SLURM, Kubernetes) must see a failure to requeue it.
        """
        if self.status == "preempted":
            sys.stdout.flush()
            raise SystemExit(self.exit_code)

    def apply_to(self, model: nn.Module) -> nn.Module:
        """Copy the trained tensors into ``model`` (in place; the one explicit mutation) and return it.

        Every parameter (trainable or frozen, a tied one once) and every buffer, persistent or not,
        gets the state's value of the same name, on the module's own device and dtype.
        """
        tensors = {**self.state.buffers, **self.state.params}
        targets = [*model.named_parameters(), *model.named_buffers()]
        missing = [name for name, _ in targets if name not in tensors]
        if missing:
            raise KeyError(
                f"the model's {missing[:5]} are not in the state (params and buffers); pass the model "
                "the state was made from (init_state(model, ...))"
            )
        with torch.no_grad():
            for name, target in targets:
                if tensors[name] is not target:  # a lent tensor already is the module's own
                    target.copy_(placed_like(tensors[name], target))
        return model


@checks.refusing_trainer_keywords  # optimizers=, model_init=, tokenizer= ...: named, with the fix
@guarded(lambda call: getattr(call["args"], "enable_jit_checkpoint", False))  # up from the first line (issue 23)
@joins_torchrun  # under torchrun without collective=: join the process group for the run (issue 15, item 2)
def train(
    model: nn.Module,
    args: GivenArguments,
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
    processing_class: Any = None,
) -> TrainResult:
    """Train ``model`` on ``train_dataset`` as ``args`` say; return the final state and the run's record (the
    module's docstring shows a run and says what each argument does)."""
    args = checks.trainfold_arguments(args)  # a transformers.TrainingArguments: TrainingArguments.from_hf, exactly
    parts: tuple[Any, ...] = (data_collator, compute_loss_func, objective, compute_metrics)
    run: tuple[Any, ...] = (preprocess_logits_for_metrics, optimizer, observers, resume_from_checkpoint, early_stopping)
    rest: tuple[Any, ...] = (stop, collective, weights_only_warm_start, callbacks, train_stream, processing_class)
    call = TrainCall(model, train_dataset, eval_dataset, *parts, *run, *rest)
    _check(args, call)  # every problem named before any work
    rank, world_size = world_of(collective)
    process_settings(args, main_process=rank == 0)  # kernels warmed up, the loggers' verbosity: as HF's __init__
    plan = plan_for(elastic_args(args, resume_from_checkpoint, world_size), call)  # elastic: the saved global batch
    state = initial_state(plan)
    with _open(plan, state, resume_from_checkpoint) as directory:  # the lock is held until the run ends
        begin = start_run(plan, directory, state, weights_only_warm_start=weights_only_warm_start)
        plan, begin = resumed_callback_states(plan, begin, callbacks)  # an EarlyStoppingCallback's, as HF's
        _log_start(plan, begin)
        result = _session(plan, begin, directory)
    return _ending(plan, result)


def _check(args: TrainingArguments, call: TrainCall) -> None:
    """Refuse what ``args`` and ``call`` cannot run, every problem named before any work."""
    data = checks.data_to_check(
        call.train_dataset, call.eval_dataset, call.data_collator, call.train_stream, call.optimizer, call.objective
    )
    resume, scores = call.resume_from_checkpoint, call.compute_metrics or call.objective
    checks.check_train_call(call.model, args, resume, scores, **data)


def _open(plan: Plan, state: TrainState, resume: bool | str | os.PathLike | None) -> ContextManager[RunDir]:
    """Claim the run's directory (``loop.directory``): its lock and identity, and the checkpoint a resume takes."""
    output_dir, settings = plan.checkpoints.output_dir, plan.run_settings
    return open_run_dir(
        output_dir, state, resume=resume, settings=settings, overwrite=plan.checkpoints.overwrite, writer=plan.is_writer
    )


def _log_start(plan: Plan, begin: Start) -> None:
    total, output_dir = plan.schedule.total_steps, plan.checkpoints.output_dir
    if begin.source is None:
        _log.info("training %d optimizer steps into %s", total, output_dir)
    else:
        _log.info("resuming from %s at step %d of %d", begin.source, int(begin.state.step), total)


def _session(plan: Plan, begin: Start, directory: RunDir) -> TrainResult:
    """Run the plan from ``begin``: open the reporters, evaluate on start, step until a stop rule holds, report."""
    state, start_state, started = begin.state, counters(begin.state), time.monotonic()  # no second weight copy
    bar = make_progress(
        plan.schedule.total_steps,
        initial=int(state.step),
        enabled=plan.is_writer,
        log_level=plan.reporters.log_level,
        bar=plan.reporters.bar,
    )  # the console
    names = plan.reporters.names if plan.is_writer else "none"
    with make_reporters(
        names, plan.reporters.output_dir, plan.reporters.run_name, plan.settings, logging_dir=plan.reporters.logging_dir
    ) as reporters:
        run = Run(
            plan,
            reporters=reporters.including(bar),  # the console shows each log, evaluation and the summary
            history=begin.history,
            window=begin.window,
            directory=directory,
            saver=Saver(plan.checkpoints.async_save, plan.checkpoints.consolidated),
            all_ranks_save=is_sharded(state),
            session=(started, int(state.extras[TOKENS_SEEN])) if TOKENS_SEEN in state.extras else None,
            global_rng=begin.global_rng,
            lookahead=Lookahead(begin.global_rng_ahead),
        )
        run, hf = callback_adapter(run, state)  # HF TrainerCallbacks, or None
        if plan.evals.on_start and begin.source is None:
            state, _ = evaluate_and_record(run, state, track=False)
        state, status, signal = _trained(run, hf, state, start_state, bar)
        summary = _summary(run, state, start_state, started, status)
        bar.close()
        history = run.history
        if isinstance(history, log_file.HistoryFile):  # read back once: the result holds a plain list
            history.close()
            history = list(history.history())
    metrics = {k: v for k, v in summary.items() if k != "step"}  # HF's TrainOutput.metrics: the step is not one
    last = run.record.saved[-1] if run.record.saved else None
    return TrainResult(state, status, metrics, history, None, last, signal)


def _summary(run: Run, state: TrainState, start_state: TrainState, started: float, status: str) -> dict[str, Any]:
    """Log and return the run's last entry: HF's ``train_runtime``, ``train_samples_per_second``, ``train_loss``..."""
    plan = run.plan
    per_step = plan.samples_per_step
    samples = (int(state.step) - int(start_state.step)) * per_step if per_step is not None else None
    epoch = plan.schedule.steps_per_epoch and plan.schedule.epoch_span
    summary = train_summary(state, start_state, time.monotonic() - started, samples, steps_per_epoch=epoch)
    summary.update(run.window.pending)  # as TRL's end-of-training entry: a window no step log was due for
    if status == DIVERGED:
        summary["diverged_at_step"] = int(state.step)
    run.history.append(summary)
    run.reporters.log(summary, int(state.step))
    return summary


def _trained(
    run: Run, hf: HFCallbacks | None, state: TrainState, start_state: TrainState, bar: Any
) -> tuple[TrainState, str, int | None]:
    """Step from ``state`` with ``loop.run`` until a stop rule holds; return the last state, status and signal."""
    plan, total = run.plan, run.plan.schedule.total_steps
    fired: list[str] = []  # the name of the stop rule that ended the loop
    stops = plan.stops.including("callbacks", agreed(hf.stop, plan.collective) if hf is not None else None)
    guard = preemption_guard(JIT_SIGNALS, collective=plan.collective) if plan.checkpoints.jit else None
    with guard or contextlib.nullcontext() as preemption:
        stops = stops.including("preempted", preemption.stop if preemption is not None else None)
        status = functools.partial(_status, run, start_state, fired, preemption)
        state, log = loop_run(
            _step(run, hf),
            state,
            continuing_global_rng(_batches(plan, state, run.lookahead), run.global_rng, plan.rank, run.lookahead),
            hooks=run_hooks(run, hf, bar),
            stop=stops.predicate(fired),
            epoch_closed=lambda s: int(s.cursor.position) == 0 or int(s.step) >= total,  # HF: the last step too
            status=status,
            log=run.record,
        )
    return state, log.status, preemption.signal if log.status == "preempted" and preemption is not None else None


def _step(run: Run, hf: HFCallbacks | None) -> Callable[[TrainState, Any], TrainState]:
    """Return the run's step (donating: the run never reuses a state): token counting, HF's on_step_begin."""
    plan, streaming = run.plan, run.plan.streaming
    counted = plan.step.donating  # type: ignore[attr-defined]  # make_step's steps carry it (with_donation)
    if streaming.tokens_seen != "no":  # never reuses a state
        counted = counting_input_tokens(counted, streaming.tokens_seen, streaming.model_input_name, plan.collective)
    if hf is not None:  # on_epoch_begin, on_step_begin before the step
        counted = hf.wrap(counted)
    if plan.stream is not None:  # each step's batch is made from the state it starts from
        prepare, stepped = plan.stream.prepare, counted
        return lambda state, item: stepped(*prepare(state, item))
    return counted


def _batches(plan: Plan, state: TrainState, lookahead: Lookahead | None = None) -> Iterable[Any]:
    """Return the run's steps of data from the state's cursor: the sampler's stream, or the plan's StateStream.

    The sampler's stream draws as HF's loop: one number at each epoch's start, and the epoch's next micro-batch
    collated before each step (accelerate's loader), the generators' states there kept in ``lookahead``.
    """
    if plan.stream is not None:
        return plan.stream.steps(state.cursor)
    source = is_stream_source(plan.inputs.train_dataset)  # files(...): its cursor
    hf_draws = functools.partial(
        stream,
        epoch_draws=True,
        collate_ahead=True if lookahead is None else lookahead.note,
        after_first=None if lookahead is None else lookahead.after_first,
    )
    batches = (source_steps if source else hf_draws)(
        plan.inputs.train_dataset,
        plan.sampler,
        plan.inputs.collate,
        start=state.cursor,
        num_epochs=plan.schedule.num_epochs,
        max_steps=None,
        **plan.streaming.loader_kwargs(),
    )
    return to_device(
        checks.checking_first(batches, functools.partial(checks.check_first_batch, plan.model)), plan.device
    )


def _status(run: Run, start_state: TrainState, fired: list[str], preemption: Any, state: TrainState, _: Any) -> str:
    """Return how the run ended, from the stop rule that held: diverged, preempted, stopped or completed."""
    run.saver.wait()  # the last async save is complete (its error raised) before the run reports
    total = run.plan.schedule.total_steps
    if run.record.diverged_at is not None or diverged(state, confirm=True):
        _log.error(divergence_message(state, run.record.saved[-1] if run.record.saved else None))
        return DIVERGED
    if preemption is not None and preemption.requested():
        # A signal after the last step (during the final save) ends nothing: the run is complete.
        done, here = int(state.step) >= total, ckpt.checkpoint_path(run.plan.checkpoints.output_dir, int(state.step))
        if int(state.step) > int(start_state.step) and not (done and here in run.record.saved):  # every rank
            # none when no step ran here (a signal during setup)
            run.record.saved.append(save_checkpoint(run, state, jit=True))
        return "completed" if done else "preempted"
    if int(state.step) < total and fired and fired[-1] in STOPPING_RULES:
        return "stopped"
    return "completed"


def _ending(plan: Plan, result: TrainResult) -> TrainResult:
    """Return the run's ``TrainResult``; the module holds its final weights (the best with load_best_model_at_end)."""
    state = result.state
    if BEST in state.extras and int(state.extras[BEST].step) >= 0:
        best_path = policy.best_checkpoint(plan.checkpoints.output_dir, state.extras[BEST])
        if plan.checkpoints.load_best and best_path is not None and result.status != "preempted":
            state = ckpt.load_weights(best_path, like=state)
        result = attrs.evolve(result, state=state, best_checkpoint=best_path)
    _log.info("training %s at step %d (%s)", result.status, result.global_step, plan.checkpoints.output_dir)
    result.apply_to(plan.model)  # as HF: the module ends with the final (or best) weights; lent ones are there
    return result
