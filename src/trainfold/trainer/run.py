"""A run in progress: its ``Plan`` with what it opened, and the side effects after each step (log, eval, save).

``run_hooks(run, ...)`` are ``loop`` hooks: they log when the logging plan says so, evaluate when the
eval plan says so (tracking the best metric and early stopping in ``state.extras``), and save when
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
from trainfold.ckpt import best as best_metric
from trainfold.ckpt import policy
from trainfold.ckpt.sharded import Saver
from trainfold.core.rng import every_rank_global_rng_states
from trainfold.core.state import TrainState
from trainfold.loop.directory import RunDir
from trainfold.loop.hooks import Every, Hook
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
    "record_eval",
    "evaluate_and_record",
    "save_checkpoint",
    "run_hooks",
    "callback_adapter",
]


@attrs.frozen(eq=False)
class Run:
    """A run's plan and what it opened: reporters, the log history, the metric window, the saver."""

    plan: Plan
    reporters: Any
    history: Any  # a history.HistoryFile on the writer rank, a list elsewhere: .append(entry)
    window: MetricWindow = attrs.field(factory=MetricWindow)
    directory: RunDir | None = None  # the run's claimed directory: its identity, log history and checkpoints
    saver: Saver = attrs.field(factory=Saver)  # sync or async (async_save); sharded states: every rank writes
    all_ranks_save: bool = False  # the state is sharded (DTensors): every rank takes part in each save
    record: RunLog = attrs.Factory(RunLog)  # what changes as it goes (a mutable record): .saved, .diverged_at
    session: tuple[float, int] | None = None  # when this call began (time.monotonic) and the tokens seen then
    global_rng: Mapping[str, Any] | None = None  # a resume's saved global generator states (Start.global_rng)
    lookahead: Any = None  # resume.Lookahead: the states before the stream's latest look-ahead collation

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


def _save_metadata(
    run: Run, state: TrainState, global_rng: Mapping[str, Any], ahead: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Return what a checkpoint's sidecar keeps of the run beside its state: the metric window, the best metric,
    the global generators, an early stopper's settings."""
    best: best_metric.BestMetric | None = state.extras.get(BEST)
    shown = None if best is None or int(best.step) < 0 else best  # none yet
    metadata = {
        "window": log_file.window_state(run.window),
        "best_metric": None if shown is None else float(shown.value),
        "best_step": None if shown is None else int(shown.step),
        # every rank's global generators a collator draws from, as they are at the save (after the stream collated
        # the epoch's next micro-batch ahead, as accelerate's loader), and right before that look-ahead collation
        # (None: the step closed its epoch); a resume sets the second, collates, then sets the first
        "global_rng": dict(global_rng),
    }
    if ahead is not None:
        metadata["global_rng_ahead"] = dict(ahead)
    early = run.plan.early
    if early is not None:  # what restore_callback_states_from_checkpoint restores (an EarlyStoppingCallback's args)
        metadata["early_stopping"] = {"patience": early.patience, "threshold": early.threshold}
    return metadata


def save_checkpoint(run: Run, state: TrainState, *, jit: bool = False) -> Path:
    """Write a checkpoint of ``state`` into the run's directory, rotating old ones (never the best); ``jit``: the
    preemption checkpoint, marked as such (and rotated like any other, as HF's).

    Every rank calls it and gets the checkpoint's path: each gives the writer its global generators' states (over
    the run's collective); the ranks that save (``Run.saves_here``) write it.
    """
    global_rng = every_rank_global_rng_states(run.plan.collective, run.plan.rank)
    lookahead, ahead = run.lookahead, None
    if lookahead is not None:  # every rank has one, or none
        ahead = every_rank_global_rng_states(run.plan.collective, run.plan.rank, states=lambda: lookahead.ahead)
    plan, directory = run.plan.checkpoints, run.directory
    assert directory is not None, "a run saves into the directory it claimed (Run.directory)"
    path = ckpt.checkpoint_path(directory.root, int(state.step))
    if not run.saves_here:
        return path
    if run.plan.is_writer:
        _logger.info("saving %scheckpoint %s", "the preemption " if jit else "", path)
    best: best_metric.BestMetric | None = state.extras.get(BEST)
    keep = [ckpt.checkpoint_path(directory.root, int(best.step))] if best is not None and int(best.step) >= 0 else []
    return directory.save(
        state,
        keep_total=plan.total_limit,
        keep=keep,
        model=run.plan.model,
        jit=jit,
        metadata=_save_metadata(run, state, global_rng, ahead),
        save_only_model=plan.save_only_model,
        extra_files=None if plan.processing_class is None else plan.processing_class.save_pretrained,
        saver=run.saver,
    )


@attrs.define
class _Now:
    """What the step's hooks tell each other: early stopping closed its epoch, its evaluation set a new best."""

    closed: bool = False
    new_best: bool = False

    def moment(self, run: Run, state: TrainState, log: RunLog) -> tuple[bool, bool]:
        """Return where the step that made ``state`` ended: (closes an epoch, is the run's last)."""
        last = int(state.step) >= run.plan.schedule.total_steps or log.diverged_at is not None
        return int(state.cursor.position) == 0 or self.closed, last


def _log(run: Run, now: _Now, state: TrainState, log: RunLog, *, last: bool = False) -> TrainState:
    plan, (epoch_end, at_end) = run.plan, now.moment(run, state, log)
    return log_if_due(
        state,
        plan.logging,
        [run],
        plan.observers,
        steps_per_epoch=plan.schedule.epoch_span,
        epoch_end=epoch_end,
        last=at_end or last,
        window=run.window,
    )


def _evaluate(run: Run, now: _Now, state: TrainState, log: RunLog) -> TrainState:
    schedule, (epoch_end, last) = run.plan.schedule, now.moment(run, state, log)
    if not run.plan.evals.due(
        int(state.step), epoch_end, total_steps=schedule.total_steps, steps_per_epoch=schedule.epoch_steps, last=last
    ):
        return state
    state, now.new_best = evaluate_and_record(run, state)
    early = run.plan.early
    if early is not None and patience_exhausted(early)(state):  # HF ends the epoch here: its on_epoch_end
        now.closed = True
        log.close_epoch()  # logs and saves by epoch at this step
        state = _log(run, now, state, log, last=True)
    return state


def _save(run: Run, now: _Now, state: TrainState, log: RunLog) -> None:
    """Save when the checkpoint plan says so; params that are not finite are never saved (the run stops)."""
    plan, (epoch_end, last), new_best = run.plan.checkpoints, now.moment(run, state, log), now.new_best
    due = policy.should_save(  # on every rank: each gives the writer its global generators' states
        int(state.step),
        save_strategy=plan.strategy,
        save_steps=plan.steps,
        epoch_end=epoch_end,
        max_steps=run.plan.schedule.total_steps,
        new_best=new_best,
        last=last,
    )
    if not due:
        return
    if diverged(state, confirm=True):  # never write inf/NaN params over the finite checkpoints
        log.diverged_at = int(state.step) if log.diverged_at is None else log.diverged_at
        log.stop("diverged")
        return
    log.saved.append(save_checkpoint(run, state))


def _window(run: Run, now: _Now) -> Callable[[TrainState, RunLog], None]:
    def add(state: TrainState, log: RunLog) -> None:
        now.closed = now.new_best = False
        run.window.add(state)
        if log.diverged_at is not None:  # the run's last step: HF closes its epoch
            log.close_epoch()

    return add


def run_hooks(run: Run, hf: hf_callbacks.HFCallbacks | None, bar: Any) -> list[Hook]:
    """Return the run's side effects after each step as ``loop`` hooks, HF's order from ``loop.EVENTS``.

    Log, evaluation and save fire by steps, or (``*_strategy="epoch"``) in the epoch phase of a step that closes
    one, each on its plan's ``due`` rule; the HF callbacks' events are hooks too: ``on_step_end`` before the log,
    ``on_epoch_end`` before those by epoch, what the callbacks asked for (and the progress bar) after them.
    """
    plan, now = run.plan, _Now()
    late = hf_callbacks.by_epoch(plan.logging.strategy, plan.evals.strategy, plan.checkpoints.strategy)

    def when(kind: str) -> Every:
        return Every(epochs=1) if late.get(kind, False) else Every(steps=1)

    hooks = [Hook(_window(run, now), 1, after_divergence=True, name="window")]
    hooks += hf.hooks() if hf is not None else []
    hooks.append(Hook(functools.partial(_log, run, now), when("log"), kind="log", name="log"))
    hooks.append(Hook(functools.partial(_evaluate, run, now), when("eval"), kind="evaluate", name="evaluate"))
    hooks.append(Hook(functools.partial(_save, run, now), when("save"), kind="save", name="checkpoint"))
    hooks.append(Hook(lambda state, log: bar.update(state), 1, kind="after", name="progress"))
    return hooks


def callback_adapter(run: Run, state: TrainState) -> tuple[Run, hf_callbacks.HFCallbacks | None]:
    """Return the run whose reporters include the HF ``TrainerCallback`` adapter (begun), and the adapter."""
    plan = run.plan
    if not plan.callbacks:
        return run, None
    evaluate = None if not plan.evals.enabled else (lambda s: evaluate_and_record(run, s)[0])
    hf = hf_callbacks.HFCallbacks(
        plan.callbacks,
        plan.callback_args,
        total_steps=plan.schedule.total_steps,
        steps_per_epoch=plan.schedule.epoch_steps,
        epoch_span=plan.schedule.epoch_span,
        use_cpu=plan.device.type == "cpu",
        saved=run.record.saved,
        evaluate=evaluate,  # the run below, which reports to the adapter
        history=run.history.history() if isinstance(run.history, log_file.HistoryFile) else run.history,
        save=lambda s: run.record.saved.append(save_checkpoint(run, s)),  # on every rank
        rank=plan.rank,
        best_key=BEST,
    )
    run = attrs.evolve(run, reporters=run.reporters.including(hf))
    hf.begin(state)
    return run, hf
