"""``transformers.TrainerCallback`` objects in a trainfold run: ``train(..., callbacks=[MyCallback()])``.

A callback's events are called where the HF Trainer calls them, with HF-shaped arguments:

- ``args``: a real ``transformers.TrainingArguments`` built from the run's settings (the names both
  share; ``report_to="none"``). It is a copy: changing it does not change the run.
- ``state``: a ``transformers.TrainerState`` kept up to date (``global_step``, ``epoch``, ``max_steps``,
  ``log_history`` (a list of the run's logs, as HF keeps it), ``best_metric``,
  ``best_global_step``, ``best_model_checkpoint``, ``num_input_tokens_seen``).
- ``control``: a ``transformers.TrainerControl``. ``should_training_stop`` ends the run after the step
  (status ``stopped``); ``should_evaluate`` and ``should_save`` set by a callback evaluate and save at
  that step, as in HF.
- keywords: ``trainfold_state`` (the current ``TrainState``: the trained tensors live there); ``model``,
  ``optimizer``, ``lr_scheduler`` and the dataloaders are ``None``, since trainfold never changes the
  module you passed and has no optimizer object to hand out.

Events, per step: ``on_epoch_begin`` (first step of an epoch), ``on_step_begin``, the step,
``on_step_end``, then for each log ``on_log``, each evaluation ``on_log`` + ``on_evaluate``, each save
``on_save``; ``on_epoch_end`` at the last step of an epoch (and of the run), where HF calls it: after
that step's logs, evaluations and saves by steps, before those by epoch (``logging_strategy``,
``eval_strategy`` or ``save_strategy`` ``"epoch"``); at the end ``on_log`` (the summary) and
``on_train_end``. ``on_init_end`` and ``on_train_begin`` open the run.

Hooks that need a mutable trainer cannot be honoured: ``on_pre_optimizer_step`` and
``on_optimizer_step`` (they change gradients or the optimizer in place), ``on_substep_end`` (between
the micro-batches of one pure step) and ``on_prediction_step`` (inside evaluation). A callback that
overrides one of them is refused by name. ``EarlyStoppingCallback(patience, threshold)`` becomes
``trainfold.observe.stopping.early_stopping`` on ``metric_for_best_model``: it stops at the same step as HF's
(threshold 0), measures a threshold from the last counted improvement (HF's best moves with every
small gain), and its counter is in the checkpoint.

>>> refused_hooks(object())
[]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from trainfold import ckpt
from trainfold.core.state import TrainState
from trainfold.loop.hooks import Every, Hook
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.args_convert import built_aside
from trainfold.trainer.callback_checks import (
    REFUSED_HOOKS,
    by_epoch,
    check_callbacks,
    check_observers,
    refused_hooks,
    set_transformers_verbosity,
    split_early_stopping,
    transformers_module,
)
from trainfold.trainer.extras import BEST

__all__ = [
    "resumed_callback_states",
    "REFUSED_HOOKS",
    "refused_hooks",
    "check_callbacks",
    "check_observers",
    "split_early_stopping",
    "HFCallbacks",
    "hf_training_arguments",
    "by_epoch",
    "set_transformers_verbosity",
]


def hf_training_arguments(args: TrainingArguments, *, use_cpu: bool) -> Any:
    """Return a ``transformers.TrainingArguments`` with the settings both share (``report_to="none"``)."""
    import dataclasses

    transformers = transformers_module()
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    shared = {k: v for k, v in args.to_dict().items() if k in names}
    shared.update(report_to="none", use_cpu=use_cpu or args.use_cpu)
    return built_aside(transformers.TrainingArguments, **shared)  # a Trainer of the process keeps working


class HFCallbacks:
    """Calls HF callbacks from a trainfold run: a reporter (every log entry), and hooks around each step.

    ``evaluate(state) -> state`` and ``save(state) -> None`` run an evaluation / a save on a callback's
    request; ``saved`` is the run's list of checkpoint paths (a new entry means a save happened).
    """

    def __init__(
        self,
        callbacks: Sequence[Any],
        args: TrainingArguments,
        *,
        total_steps: int,
        steps_per_epoch: int,
        use_cpu: bool,
        epoch_span: float | None = None,  # what state.epoch divides the epoch's steps done by (RunLength.epoch_span)
        saved: list[Path],
        history: Sequence[dict[str, Any]],
        evaluate: Callable[[TrainState], TrainState] | None,
        save: Callable[[TrainState], None],
        rank: int = 0,
        best_key: str = BEST,
    ) -> None:
        transformers = transformers_module()
        self.callbacks = list(callbacks)
        self.args = hf_training_arguments(args, use_cpu=use_cpu)
        self._output_dir, self._best_key = args.output_dir, best_key
        self.state = transformers.TrainerState(
            max_steps=total_steps,
            logging_steps=self.args.logging_steps,
            eval_steps=self.args.eval_steps or 0,
            save_steps=self.args.save_steps,
            train_batch_size=args.per_device_train_batch_size,
            num_train_epochs=-(-total_steps // steps_per_epoch),
            is_local_process_zero=rank == 0,
            is_world_process_zero=rank == 0,
        )
        self.state.log_history = list(history)  # HF's in-memory list, appended on every log
        self.control = transformers.TrainerControl()
        self._epoch_span, self._evaluate, self._save, self._saved = epoch_span or steps_per_epoch, evaluate, save, saved
        self._current: TrainState | None = None
        self._saves_seen, self._saved_steps = len(saved), set[int]()
        self._epoch_open = False
        self._warned_log = False

    # -- calling -----------------------------------------------------------------------------------

    def _event(self, name: str, **kwargs: Any) -> None:
        common = dict(
            model=None,
            processing_class=None,
            optimizer=None,
            lr_scheduler=None,
            train_dataloader=None,
            eval_dataloader=None,
            trainfold_state=self._current,
        )
        for cb in self.callbacks:
            result = getattr(cb, name)(self.args, self.state, self.control, **common, **kwargs)
            if result is not None:
                self.control = result
        if self.control.should_epoch_stop:
            raise ValueError(
                f"a callback set control.should_epoch_stop in {name}: trainfold's data stream cannot "
                "skip the rest of an epoch; set control.should_training_stop to end the run instead"
            )

    def _sync(self, state: TrainState) -> None:
        from trainfold.ckpt import checkpoint_path
        from trainfold.observe import TOKENS_SEEN

        self._current = state
        epoch, position = state.cursor.as_tuple()
        self.state.global_step = int(state.step)
        self.state.epoch = epoch + position / self._epoch_span
        if TOKENS_SEEN in state.extras:
            self.state.num_input_tokens_seen = int(state.extras[TOKENS_SEEN])
        best = state.extras.get(self._best_key)
        if best is not None and int(best.step) >= 0:
            self.state.best_metric, self.state.best_global_step = float(best.value), int(best.step)
            path = checkpoint_path(self._output_dir, int(best.step))
            if path.is_dir():
                self.state.best_model_checkpoint = str(path)

    # -- the run's hooks ------------------------------------------------------------------------------

    def begin(self, state: TrainState) -> None:
        """Open the run: ``on_init_end``, ``on_train_begin``."""
        self._sync(state)
        self._event("on_init_end")
        self.control.should_training_stop = False
        self._event("on_train_begin")

    def wrap(self, step: Callable[[TrainState, Any], TrainState]) -> Callable[[TrainState, Any], TrainState]:
        """Return ``step`` preceded by ``on_epoch_begin`` (at an epoch's first step) and ``on_step_begin``."""

        def stepped(state: TrainState, batch: Any) -> TrainState:
            self._sync(state)
            if not self._epoch_open:
                self._epoch_open = True
                self.control.should_epoch_stop = False
                self._event("on_epoch_begin")
            self.control.should_log = self.control.should_evaluate = self.control.should_save = False
            self._event("on_step_begin")
            return step(state, batch)

        return stepped

    def hooks(self) -> list[Hook]:
        """Return the adapter as ``loop`` hooks: ``on_step_end`` before the step's log, evaluation and save, the
        epoch's close (``on_epoch_end``) before those by epoch, after them ``on_save`` for a save just made and
        what the callbacks asked for; all also after divergence."""
        return [
            Hook(lambda state, log: self.step_end(state), 1, after_divergence=True, name="on_step_end"),
            Hook(lambda state, log: self.epoch_closed(state), Every(epochs=1), after_divergence=True, name="epoch"),
            Hook(lambda state, log: self._settle(state), 1, kind="after", name="callbacks"),
        ]

    def step_end(self, state: TrainState) -> TrainState:
        """``on_step_end`` after the step, before its log, evaluation and save."""
        self._sync(state)
        self._saves_seen = len(self._saved)
        self._event("on_step_end")
        return state

    def epoch_closed(self, state: TrainState) -> TrainState:
        """At an epoch's (or the run's) last step, after its step-driven log/evaluation/save and before those by
        epoch: ``on_save`` for a save just made, what callbacks asked for, then ``on_epoch_end`` (HF's order)."""
        state = self._settle(state)
        self._close_epoch()
        return state

    def _settle(self, state: TrainState) -> TrainState:
        """``on_save`` for a save the run just made, then the evaluation and save callbacks asked for."""
        self._sync(state)
        if len(self._saved) > self._saves_seen:
            self._saved_now()
        if self.control.should_log and not self._warned_log:
            self._warned_log = True
            warnings.warn(
                "a callback set control.should_log; trainfold logs on its logging plan (logging_steps) "
                "and does not add a log for it",
                stacklevel=2,
            )
        if self.control.should_evaluate:
            if self._evaluate is None:
                raise ValueError("a callback set control.should_evaluate, but the run has no eval_dataset; pass one")
            state = self._evaluate(state)
            self._sync(state)
            self.control.should_evaluate = False
        if self.control.should_save and int(state.step) not in self._saved_steps:
            self._save(state)
            self._sync(state)
            self._saved_now()
        return state

    def _saved_now(self) -> None:
        self._saves_seen = len(self._saved)
        self._saved_steps.add(self.state.global_step)
        self.control.should_save = False
        self._event("on_save")

    def _close_epoch(self) -> None:
        if self._epoch_open:
            self._epoch_open = False
            self._event("on_epoch_end")

    def stop(self, state: TrainState) -> bool:
        """The run's stop predicate: a callback set ``control.should_training_stop``."""
        return bool(self.control.should_training_stop)

    # -- the reporter side ----------------------------------------------------------------------------

    def log(self, entry: Mapping[str, Any], step: int) -> None:
        """``on_log`` for every entry (without ``step``, as HF); ``on_evaluate`` after an evaluation's;
        after the summary, ``on_epoch_end`` (if an epoch is open) first and ``on_train_end`` last."""
        self.state.log_history.append(dict(entry))
        logs = {k: v for k, v in entry.items() if k != "step"}
        summary = "train_loss" in logs  # a log counting tokens has a train_runtime too
        if summary and self._epoch_open:  # HF ends the last epoch before it logs the summary
            history, self.state.log_history = self.state.log_history, self.state.log_history[:-1]
            self._close_epoch()
            self.state.log_history = history
        self.control.should_log = False
        self._event("on_log", logs=logs)
        if any(k.startswith("eval_") for k in logs):
            self.control.should_evaluate = False
            self._event("on_evaluate", metrics=dict(logs))  # HF's metrics carry the epoch too
        if summary:
            self._event("on_train_end")

    def close(self) -> None:
        """Nothing to release."""


def resumed_callback_states(plan: Any, begin: Any, callbacks: Sequence[Any]) -> tuple[Any, Any]:
    """Return ``(plan, begin)`` resuming an ``EarlyStoppingCallback`` as HF does: from the checkpoint, or afresh.

    With ``restore_callback_states_from_checkpoint`` its patience and threshold come from the checkpoint
    (HF re-creates the callback from the ``args`` it saved) and its count of bad evaluations goes on;
    without (HF's default), the count restarts at 0 under the new callback's settings. trainfold's own
    ``early_stopping=`` record is part of the state and always goes on.
    """
    restore = plan.restore_callback_states
    given = any(type(cb).__name__ == "EarlyStoppingCallback" for cb in callbacks)
    if begin.source is None or plan.early is None or not given:
        return plan, begin
    if not restore:
        record = begin.state.extras[plan.early.key]
        fresh = attrs.evolve(record, bad_evals=torch.zeros_like(record.bad_evals))
        return plan, attrs.evolve(
            begin, state=attrs.evolve(begin.state, extras={**begin.state.extras, plan.early.key: fresh})
        )
    saved = ckpt.read_metadata(begin.source)["metadata"].get("early_stopping")
    if not isinstance(saved, Mapping) or sorted(saved) != ["patience", "threshold"]:
        return plan, begin  # a checkpoint of a run without early stopping: the run's own settings
    early = attrs.evolve(plan.early, patience=int(saved["patience"]), threshold=float(saved["threshold"]))
    return plan.with_early_stopping(early), begin
