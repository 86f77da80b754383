"""A run in progress: its ``Plan`` with what it opened, and the side effects after each step (log, eval, save).

``after_step(run)`` is ``state -> state``: it logs when the logging plan says so, evaluates when the
eval plan says so (tracking the best metric and early stopping in ``state.extras``), and saves when
the checkpoint plan says so; a run whose params turn inf/NaN logs the window that ended in it and stops.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from trainfold import ckpt
from trainfold.ckpt import policy, run_dir
from trainfold.ckpt.sharded import Saver
from trainfold.core.rng import global_rng_states
from trainfold.core.state import TrainState
from trainfold.evaluation import best as best_metric
from trainfold.loop.directory import already_saved
from trainfold.loop.record import RunLog
from trainfold.observe import TOKENS_SEEN, MetricWindow, eval_entry, log_if_due, notify
from trainfold.observe import history as log_file
from trainfold.observe.divergence import diverged
from trainfold.observe.stopping import patience_exhausted, record_evaluation
from trainfold.trainer import callbacks as hf_callbacks
from trainfold.trainer.extras import BEST
from trainfold.trainer.plan import Plan

_logger = logging.getLogger(__name__)

__all__ = [
    "Run",
    "saving_files_of",
    "record_eval",
    "evaluate_and_record",
    "save_checkpoint",
    "after_step",
    "callback_adapter",
]


@attrs.frozen(eq=False)
class Run:
    """A run's plan and what it opened: reporters, the log history, the metric window, the saver."""

    plan: Plan
    reporters: Any
    history: Any  # a history.HistoryFile on the writer rank, a list elsewhere: .append(entry)
    window: MetricWindow = attrs.field(factory=MetricWindow)
    run_id: run_dir.RunIdentity | None = None
    saver: Saver = attrs.field(factory=Saver)  # sync or async (async_save); sharded states: every rank writes
    all_ranks_save: bool = False  # the state is sharded (DTensors): every rank takes part in each save
    record: RunLog = attrs.Factory(RunLog)  # what changes as it goes (a mutable record): .saved, .diverged_at
    session: tuple[float, int] | None = None  # when this call began (time.monotonic) and the tokens seen then
    global_rng: Mapping[str, Any] | None = None  # a resume's saved global generator states (Start.global_rng)

    @property
    def saves_here(self) -> bool:
        """Whether this rank takes part in saves (the writer; every rank of a sharded state)."""
        return self.plan.is_writer or self.all_ranks_save

    def log(self, entry: Mapping[str, Any], step: int) -> None:
        """Append ``entry`` to the history and send it to the reporters (a reporter for ``log_if_due``).

        Counting input tokens, a log also has this call's ``train_runtime`` and ``train_tokens_per_second``, as HF's.
        """
        if self.session is not None and TOKENS_SEEN in entry:
            runtime, seen = time.monotonic() - self.session[0], entry[TOKENS_SEEN] - self.session[1]
            rate = round(seen / runtime, 3) if runtime > 0 else float("nan")
            last = {"step": entry["step"]} if "step" in entry else {}  # last, as HF
            entry = {**entry, "train_runtime": round(runtime, 4), "train_tokens_per_second": rate, **last}
        self.history.append(dict(entry))
        self.reporters.log(entry, step)


def record_eval(
    run: Run, state: TrainState, results: Sequence[Mapping[str, Any]], *, track: bool = True
) -> tuple[TrainState, bool]:
    """Log an evaluation (an entry per eval set, as HF), track the best metric and early stopping; (state, new best?).

    ``track=False`` (``eval_on_start``) only logs: there is no checkpoint of step 0 to call best.
    """
    metrics: dict[str, Any] = {}
    for one in results:
        entry = eval_entry(one, state, steps_per_epoch=run.plan.schedule.epoch_span)
        run.history.append(entry)
        run.reporters.log(entry, int(state.step))
        notify(run.plan.observers, state, entry)
        metrics.update(one)
    new_best = False
    if not track:
        return state, new_best
    key = run.plan.metric_key
    if key is not None:
        if key not in metrics:
            named = any(s.prefix != "eval" for s in run.plan.evals.sets)
            raise KeyError(
                f"metric_for_best_model {key!r} is not among the eval metrics "
                f"{sorted(metrics)}; name one of them (without or with the 'eval_' prefix)"
                + ("; with a dict eval_dataset each set's metrics are named eval_{name}_*" if named else "")
            )
        best, new_best = best_metric.update_best(state.extras[BEST], metrics[key], int(state.step))
        state = attrs.evolve(state, extras={**state.extras, BEST: best})
    if run.plan.early is not None:
        state = record_evaluation(run.plan.early, state, metrics)
    return state, new_best


def evaluate_and_record(run: Run, state: TrainState, *, track: bool = True) -> tuple[TrainState, bool]:
    """Evaluate the state on the run's eval sets and record it (``record_eval``)."""
    return record_eval(run, state, run.plan.evals.run(run.plan.model, state), track=track)


def _save_options(run: Run, state: TrainState) -> dict[str, Any]:
    best: best_metric.BestMetric | None = state.extras.get(BEST)
    if run.plan.is_writer:  # the sidecar is rank 0's (the other ranks of a sharded save write their shards)
        run.history.sync()  # the entries the sidecar's offset covers are on disk first
    shown = None if best is None or int(best.step) < 0 else best  # none yet
    metadata = {
        "log": run.history.position() if run.plan.is_writer else None,
        "window": log_file.window_state(run.window),
        "best_metric": None if shown is None else float(shown.value),
        "best_step": None if shown is None else int(shown.step),
        # the global generators a collator draws from, as they are after the last step's collation (the stream
        # collates each step when it is drawn, never ahead); a resume restores them before its first collation
        "global_rng": {str(run.plan.rank): global_rng_states()},
    }
    early = run.plan.early
    if early is not None:  # what restore_callback_states_from_checkpoint restores (an EarlyStoppingCallback's args)
        metadata["early_stopping"] = {"patience": early.patience, "threshold": early.threshold}
    return dict(
        model=run.plan.model,
        metadata=metadata,
        settings=run.plan.settings,
        save_only_model=run.plan.checkpoints.save_only_model,
        run=attrs.asdict(run.run_id) if run.run_id is not None else None,
        extra_files=saving_files_of(run.plan.checkpoints.processing_class),
    )


def saving_files_of(processing_class: Any) -> Callable[[Path], Any] | None:
    """Return what writes ``processing_class``'s files into a checkpoint (its ``save_pretrained``), or None."""
    return None if processing_class is None else processing_class.save_pretrained


def save_checkpoint(run: Run, state: TrainState, *, jit: bool = False) -> Path:
    """Write a checkpoint of ``state`` (rotating old ones); ``jit``: the preemption checkpoint, marked as such."""
    options, output_dir = _save_options(run, state), run.plan.checkpoints.output_dir
    path = ckpt.checkpoint_path(output_dir, int(state.step))
    if run.plan.is_writer:
        _logger.info("saving %scheckpoint %s", "the preemption " if jit else "", path)
    best: best_metric.BestMetric | None = state.extras.get(BEST)
    keep = [path]
    if best is not None and int(best.step) >= 0:
        keep.append(ckpt.checkpoint_path(output_dir, int(best.step)))
    rotate = functools.partial(
        policy.rotate,
        output_dir,
        run.plan.checkpoints.total_limit,
        keep=keep,
        run_id=options["run"]["id"] if options["run"] is not None else None,
    )

    def committed(_: Path) -> None:  # once the checkpoint is complete
        rotate()
        if isinstance(run.history, log_file.HistoryFile):
            run.history.checkpointed()  # an earlier run's history, kept until now, is no longer needed

    if jit:  # rotates like any other save (HF's too): a preempted run's older JIT checkpoints do not pile up
        run.saver.wait()  # an async save in flight is complete (or raised) first
        if already_saved(path, options["run"], int(state.step), options["save_only_model"]):
            return ckpt.mark_jit(path) if run.plan.is_writer else path  # the same state is there, complete: mark it
        return run.saver.save(state, path, jit=True, wait=True, on_commit=committed, **options)
    return run.saver.save(state, path, on_commit=committed, **options)


@attrs.define
class _Moment:
    """Where a step ended: its number, whether it closed an epoch or the run, and whether it set a new best."""

    step: int
    epoch_end: bool
    last: bool
    new_best: bool = False


def _log(run: Run, state: TrainState, now: _Moment) -> TrainState:
    plan = run.plan
    return log_if_due(
        state,
        plan.logging,
        [run],
        plan.observers,
        steps_per_epoch=plan.schedule.epoch_span,
        epoch_end=now.epoch_end,
        last=now.last,
        window=run.window,
    )


def _evaluate(run: Run, state: TrainState, now: _Moment) -> TrainState:
    schedule = run.plan.schedule
    due = run.plan.evals.due(
        now.step, now.epoch_end, total_steps=schedule.total_steps, steps_per_epoch=schedule.epoch_steps, last=now.last
    )
    if not due:
        return state
    state, now.new_best = evaluate_and_record(run, state)
    early = run.plan.early
    if early is not None and patience_exhausted(early)(state):  # HF ends the epoch here: its on_epoch_end
        now.epoch_end = True  # logs and saves by epoch at this step
        state = _log(run, state, attrs.evolve(now, last=True))
    return state


def _save_if_due(run: Run, state: TrainState, now: _Moment) -> bool:
    """Save when the checkpoint plan says so; return False when the params are not finite (nothing saved)."""
    plan = run.plan.checkpoints
    due = run.saves_here and policy.should_save(
        now.step,
        save_strategy=plan.strategy,
        save_steps=plan.steps,
        epoch_end=now.epoch_end,
        max_steps=run.plan.schedule.total_steps,
        new_best=now.new_best,
        last=now.last,
    )
    if not due:
        return True
    if diverged(state, confirm=True):  # never write inf/NaN params over the finite checkpoints
        _diverged_at(run, now.step)
        return False
    run.record.saved.append(save_checkpoint(run, state))
    return True


def _diverged_at(run: Run, step: int) -> None:
    if run.record.diverged_at is None:  # the first step whose params are not finite
        run.record.diverged_at = step


def after_step(
    run: Run, epoch_closed: Callable[[TrainState], TrainState] | None = None
) -> Callable[[TrainState], TrainState]:
    """Return the side effects after each step as ``state -> state``: log, evaluate, save.

    An epoch's last step runs as HF's: its step-driven log/evaluation/save, then ``epoch_closed`` (the
    HF callbacks' ``on_epoch_end``, if any), then those by epoch (``*_strategy="epoch"``), so the log
    history has HF's order (an evaluation by steps before the epoch's log by epoch).
    """
    late = hf_callbacks.by_epoch(run.plan.args)

    def after(state: TrainState) -> TrainState:
        step = int(state.step)
        now = _Moment(step, int(state.cursor.position) == 0, step >= run.plan.schedule.total_steps)
        run.window.add(state)
        if diverged(state):  # log the window that ended in it, then stop: no evaluation, no save
            _diverged_at(run, step)
            now.last = True

        def late_here(kind: str) -> bool:  # by epoch, at a step that closes one (early stopping may close it)
            return late.get(kind, False) and (now.epoch_end or now.last)

        for by_epoch in (False, True):
            if by_epoch:
                if not (now.epoch_end or now.last):
                    break
                state = epoch_closed(state) if epoch_closed is not None else state
            if late_here("log") is by_epoch:
                state = _log(run, state, now)
            if run.record.diverged_at is not None:
                continue
            if late_here("eval") is by_epoch:
                state = _evaluate(run, state, now)
            if late_here("save") is by_epoch and not _save_if_due(run, state, now):
                return state
        return state

    return after


def callback_adapter(run: Run, state: TrainState) -> tuple[Run, hf_callbacks.HFCallbacks | None]:
    """Return the run whose reporters include the HF ``TrainerCallback`` adapter (begun), and the adapter."""
    plan = run.plan
    if not plan.callbacks:
        return run, None
    evaluate = None if not plan.evals.enabled else (lambda s: evaluate_and_record(run, s)[0])
    hf = hf_callbacks.HFCallbacks(
        plan.callbacks,
        plan.args,
        total_steps=plan.schedule.total_steps,
        steps_per_epoch=plan.schedule.epoch_steps,
        epoch_span=plan.schedule.epoch_span,
        use_cpu=plan.device.type == "cpu",
        saved=run.record.saved,
        evaluate=evaluate,  # the run below, which reports to the adapter
        history=run.history.history() if isinstance(run.history, log_file.HistoryFile) else run.history,
        save=lambda s: run.record.saved.append(save_checkpoint(run, s)) if run.saves_here else None,
        rank=plan.rank,
        best_key=BEST,
    )
    run = attrs.evolve(run, reporters=run.reporters.including(hf))
    hf.begin(state)
    return run, hf
