"""``loop.run``: the fold with hooks, a stop rule, and (given ``output_dir``) the run directory it owns.

A hook of your own, data as a function of the state (a resumed run reads on from its cursor), a stop rule:

>>> import torch
>>> from trainfold import init_state, make_step, max_steps, sgd
>>> from trainfold.core.losses import mse
>>> net, rows = torch.nn.Linear(2, 1), [{"input": torch.eye(2), "labels": torch.ones(2, 1)}]
>>> seen = []
>>> state, log = run(make_step(net, mse, sgd(0.5)), init_state(net, sgd(0.5)), lambda state: [rows] * 10,
...                  hooks=[every(2, lambda state, log: seen.append(log.step))], stop=max_steps(5))
>>> int(state.step), log.status, seen
(5, 'completed', [2, 4])
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from trainfold.core.fold import any_of, fit, never
from trainfold.core.preempt import JIT_SIGNALS, Preemption, preemption_guard
from trainfold.core.state import TrainState, counters
from trainfold.data import StateStream
from trainfold.data.mixture import is_stream_source
from trainfold.loop.directory import open_run_dir
from trainfold.loop.hooks import EVENTS, Hook, every, flat_hooks, hook_extras
from trainfold.loop.record import RunLog
from trainfold.observe.divergence import diverged, divergence_message
from trainfold.observe.entries import train_summary

_log = logging.getLogger(__name__)

__all__ = ["run", "every"]

Data = Iterable[Any] | Callable[[TrainState], Iterable[Any]]


def run(
    step: Callable[[TrainState, Any], TrainState],
    state: TrainState,
    data: Data | StateStream,
    *,
    hooks: Sequence[Any] = (),
    stop: Callable[[TrainState], bool] | None = None,
    output_dir: str | os.PathLike | None = None,
    resume: bool | str | os.PathLike = False,
    settings: dict[str, Any] | None = None,
    epoch_closed: Callable[[TrainState], bool] | None = None,
    status: Callable[[TrainState, RunLog], str] | None = None,
    log: RunLog | None = None,
) -> tuple[TrainState, RunLog]:
    """Fold ``step`` over ``data`` from ``state``, firing ``hooks`` after each step; return ``(state, RunLog)``.

    ``data`` is an iterable of step batches, or a function ``state -> iterable`` called with the first state
    (a resumed one: ``lambda s: stream(dataset, sampler, collate, start=s.cursor)`` continues at its cursor).
    ``stop(state)`` ends the run (status ``completed``); a hook's ``log.stop`` too (``stopped``). A step whose
    params turn inf/NaN ends it (``diverged``), never saved. With ``output_dir`` the run owns that directory:
    its lock and identity (``settings``, e.g. the hyperparameters, and the model's tensors), atomic verified
    checkpoints (``loop.save``), the log history, and SIGTERM/SIGINT: the step in flight finishes, a
    checkpoint is saved and the run returns with status ``preempted`` (``log.exit_code``: 143).
    ``resume=True`` continues bitwise from the newest intact checkpoint (a path: that one). ``data`` may also be a
    ``data.StateStream`` (GRPO's generations, ``trainfold.grpo.grpo_stream(...).stream()``): each step's batch is
    made from the state that step starts from, and its ``extras`` (a buffer) are part of every checkpoint.

    ``epoch_closed(state)`` also closes an epoch at a step (its epoch hooks fire; HF: the run's last step);
    ``status(state, log)`` says how the run ended in place of the rules above (HF's: a preempted run whose
    steps are all done completed); ``log`` is the ``RunLog`` to record into (a new one by default).
    """
    hooks = flat_hooks(hooks)
    if isinstance(data, StateStream):
        step, data, state = _over_stream(step, data, state)
    _check(hooks, data, output_dir, resume)
    state = attrs.evolve(state, extras={**hook_extras(hooks), **state.extras})  # a resume loads into the same shape
    first_cursor = getattr(data, "first_cursor", None)  # trainfold.data.source_data: the source's cursor from step 0
    if first_cursor is not None and state.cursor.streams is None:
        state = attrs.evolve(state, cursor=first_cursor())
    log = RunLog() if log is None else log
    with contextlib.ExitStack() as stack:
        guard = None
        if output_dir is not None:
            guard = stack.enter_context(preemption_guard(JIT_SIGNALS))  # up before the checkpoint is read
            log.directory = stack.enter_context(open_run_dir(output_dir, state, resume=resume, settings=settings))
            state, log.resumed_from = log.directory.start(state)
            log.history = log.directory.entries()
        state = _trained(step, state, data, hooks, _Rules(stop, epoch_closed, status), log, guard)
    return state, log


def _check(hooks: tuple[Hook, ...], data: Data, output_dir: Any, resume: Any) -> None:
    """Refuse by name what the run could not do as asked."""
    if resume is not False and resume is not None and output_dir is None:
        raise ValueError(f"loop.run: resume={resume!r} needs output_dir=, the directory holding the checkpoints")
    if resume not in (False, None) and not callable(data):
        raise TypeError(
            "loop.run: resume needs data as a function state -> iterable of step batches, so the run continues "
            "at the checkpoint's cursor, e.g. data=lambda s: trainfold.stream(dataset, sampler, collate, "
            "start=s.cursor); an iterable would start over from its first batch"
        )
    if is_stream_source(data):
        raise TypeError(
            "loop.run: a streaming source has no batch size; pass data=trainfold.data.source_data(source, "
            "per_device_train_batch_size=..., collate=...), which continues at the state's cursor"
        )
    if output_dir is None and any(h.kind == "save" and h.name == "save" for h in hooks):  # loop.save
        raise ValueError("loop.save needs a directory to save into: pass output_dir= to loop.run")


def _over_stream(
    step: Callable[[TrainState, Any], TrainState], stream: StateStream, state: TrainState
) -> tuple[Callable[[TrainState, Any], TrainState], Callable[[TrainState], Iterable[Any]], TrainState]:
    """Return the step that prepares its batch from the state it starts from, the steps from the state's cursor,
    and the state holding the stream's extras (the template a checkpoint loads into)."""

    def prepared(state: TrainState, item: Any) -> TrainState:
        return step(*stream.prepare(state, item))

    return prepared, lambda s: stream.steps(s.cursor), attrs.evolve(state, extras={**stream.extras, **state.extras})


@attrs.frozen
class _Rules:
    """The run's rules given to ``run``: when it stops, when a step closes an epoch, how its status is told."""

    stop: Callable[[TrainState], bool] | None = None
    epoch_closed: Callable[[TrainState], bool] | None = None
    status: Callable[[TrainState, RunLog], str] | None = None


def _trained(
    step: Callable[[TrainState, Any], TrainState],
    state: TrainState,
    data: Data,
    hooks: tuple[Hook, ...],
    rules: _Rules,
    log: RunLog,
    guard: Preemption | None,
) -> TrainState:
    """Run the steps from ``state``, then the end: the run's status, the JIT save, the ``at_end`` hooks."""
    start, began, stop = counters(state), time.monotonic(), rules.stop
    log.step = int(state.step)
    clock = _Clock(hooks, log, int(state.cursor.epoch), int(state.step), rules.epoch_closed)
    looped = _with_hooks(step, clock)
    halts = [_halting(hook, log) for hook in hooks if hook.halts is not None]
    stops = any_of(stop or never, log.stopping, *halts, guard.stop if guard is not None else never)
    state = fit(looped, state, data(state) if callable(data) else data, stops)
    if rules.status is not None:
        log.status = rules.status(state, log)
        if log.status in ("completed", "stopped"):
            state = clock.fire(state, "end")
    elif log.diverged_at is not None or diverged(state, confirm=True):
        log.diverged_at = int(state.step) if log.diverged_at is None else log.diverged_at
        log.status = "diverged"
        _log.error(divergence_message(state, log.saved[-1] if log.saved else None))
    elif guard is not None and guard.requested() and not (stop is not None and stop(state)):
        # (a signal after the last step ends nothing: the run is complete, and ends as one)
        if int(state.step) > int(start.step):  # none when no step ran here (a signal during setup)
            log.saved.append(log.directory.save(state, jit=True))
        log.status, log.signal = "preempted", guard.signal
    else:
        state = clock.fire(state, "end")
        log.status = "stopped" if log.stop_reason is not None else "completed"
    log.summary = train_summary(state, start, time.monotonic() - began)
    _find_best(state, log)
    return state


def _with_hooks(
    step: Callable[[TrainState, Any], TrainState], clock: _Clock
) -> Callable[[TrainState, Any], TrainState]:
    """Return the step followed by the hooks due after it; donating where ``step`` donates (as ``fit`` asks)."""

    def looped(state: TrainState, batch: Any) -> TrainState:
        return clock.after(step(state, batch))

    donating = getattr(step, "donating", None)
    if donating is not None:
        looped.donating = lambda state, batch: clock.after(donating(state, batch))  # type: ignore[attr-defined]
    return looped


def _halting(hook: Hook, log: RunLog) -> Callable[[TrainState], bool]:
    """Return ``hook.halts`` as a stop rule that records the hook's name as the reason the run stopped."""

    def halts(state: TrainState) -> bool:
        if hook.halts is not None and hook.halts(state):
            log.stop(hook.name or "a hook")
            return True
        return False

    return halts


def _find_best(state: TrainState, log: RunLog) -> None:
    from trainfold.ckpt import policy
    from trainfold.loop.builtins import BEST

    if log.directory is not None and BEST in state.extras:
        log.best = policy.best_checkpoint(log.directory.root, state.extras[BEST])


@attrs.define(eq=False)
class _Clock:
    """Which hooks are due after a step: walks ``EVENTS`` in order, each hook at most once per step."""

    hooks: tuple[Hook, ...]
    log: RunLog
    epoch: int  # the epoch the cursor was in before the step
    first: int  # the step the run started at: no hook fires for it (a resumed run's was done before)
    closes: Callable[[TrainState], bool] | None = None  # run's epoch_closed: a step that closes an epoch
    started: float = attrs.field(factory=time.monotonic)

    def after(self, state: TrainState) -> TrainState:
        """Run the hooks due after the step that made ``state``; stop the run if its params diverged."""
        self.log.step, self.log.closing = int(state.step), False
        if diverged(state):  # log the window that ended in it, then stop: no evaluation, no save
            self.log.diverged_at = self.log.step
            self.log.stop("diverged")
        state = self.fire(state, "step")
        epoch = int(state.cursor.epoch)  # epochs done; one closed before the cursor enters the next is its + 1
        if epoch > self.epoch or self.log.closing or (self.closes is not None and self.closes(state)):
            self.log.closing, self.epoch = True, epoch if epoch > self.epoch else epoch + 1
            state = self.fire(state, "epoch")
        return self.fire(state, "after")

    def fire(self, state: TrainState, phase: str) -> TrainState:
        """Fire the hooks due in ``phase`` (``step``, ``epoch``, ``after``, ``end``), slot by slot as ``EVENTS`` orders;
        after a diverged step only those declared ``after_divergence``."""
        for when, slot in EVENTS:
            if when != phase:
                continue
            for i, hook in enumerate(self.hooks):
                state = self._one(state, i, hook, phase, slot)
        return state

    def _one(self, state: TrainState, i: int, hook: Hook, phase: str, slot: str) -> TrainState:
        if self.log.diverged_at is not None and not hook.after_divergence:
            return state
        marks = self.log.marks.setdefault(i, {"step": self.first, "time": self.started, "evaluations": 0})
        if slot == "judge":
            if hook.judge is None or marks["evaluations"] >= self.log.evaluations:
                return state
            marks["evaluations"] = self.log.evaluations
            return _applied(hook.judge, state, self.log)
        if hook.kind != slot or hook.fn is None or marks["step"] == self.log.step or not self._due(hook, phase, marks):
            return state
        marks["step"], marks["time"] = self.log.step, time.monotonic()
        return _applied(hook.fn, state, self.log)

    def _due(self, hook: Hook, phase: str, marks: dict[str, Any]) -> bool:
        when = hook.every
        if phase == "end":
            return when.at_end
        if phase == "epoch":
            return when.due_at_epoch(self.epoch)
        timed = when.seconds is not None and time.monotonic() - marks["time"] >= when.seconds
        return when.due_at_step(self.log.step) or timed


def _applied(fn: Callable[[Any, Any], Any], state: TrainState, log: RunLog) -> TrainState:
    out = fn(state, log)
    return state if out is None else out
