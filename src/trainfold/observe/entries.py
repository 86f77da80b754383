"""What a log holds: the logging mark in ``state.extras``, the window's exact mean loss, eval and summary entries.

A log entry's ``loss`` is the exact mean of the per-step losses since the last log, computed from
the state's running ``loss_total`` minus the mark's (``state.extras[LOG_MARK]``, a record of 0-d
tensors, so a checkpoint carries it):

>>> import torch
>>> from trainfold.core.state import TrainState, scalar
>>> state = TrainState(params={}, buffers={}, opt_state=None, step=scalar(4),
...                    loss_total=scalar(10.0, torch.float64))
>>> log_entry(state)["loss"]                     # 4 steps, losses summing to 10
2.5
>>> state = mark_logged(state)
>>> state = attrs.evolve(state, step=scalar(6), loss_total=scalar(13.0, torch.float64))
>>> log_entry(state)["loss"]                     # the 2 steps since the mark
1.5
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.core.losses import count_key
from trainfold.core.state import TrainState, scalar
from trainfold.observe.tokens import TOKENS_SEEN

_FIX_WINDOW = "resume from another checkpoint, or start fresh (log_history then starts empty)"

__all__ = [
    "window_state",
    "restore_window",
    "LOG_MARK",
    "LogMark",
    "MetricWindow",
    "eval_entry",
    "filtered_mean_loss",
    "log_entry",
    "log_mark",
    "mark_logged",
    "train_summary",
]

LOG_MARK = "log_mark"  # the key of the logging mark in state.extras


@attrs.frozen(eq=False)
class LogMark:
    """Where the last log was taken: the step, the running loss sum and the non-finite count then.

    >>> import torch
    >>> mark = LogMark(step=scalar(3), loss_total=scalar(4.5, torch.float64))
    >>> mark.step.item(), mark.loss_total.item(), LogMark().step.item()
    (3, 4.5, 0)
    """

    step: Tensor = attrs.field(factory=lambda: scalar(0))
    loss_total: Tensor = attrs.field(factory=lambda: scalar(0.0, torch.float64))
    nonfinite_losses: Tensor = attrs.field(factory=lambda: scalar(0))


def log_mark(state: TrainState, key: str = LOG_MARK) -> LogMark:
    """Return the state's last logging mark (the start of training when there is none).

    >>> from trainfold.core.state import TrainState
    >>> log_mark(TrainState(params={}, buffers={}, opt_state=None)).step.item()
    0
    """
    mark = state.extras.get(key)
    return LogMark() if mark is None else mark


def mark_logged(state: TrainState, key: str = LOG_MARK) -> TrainState:
    """Return ``state`` with its logging mark moved to the current step (a new state).

    >>> from trainfold.core.state import TrainState, scalar
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(7))
    >>> log_mark(mark_logged(s)).step.item()
    7
    """
    mark = LogMark(
        step=state.step.detach().clone(),
        loss_total=state.loss_total.detach().clone(),
        nonfinite_losses=state.nonfinite_losses.detach().clone(),
    )
    return attrs.evolve(state, extras={**state.extras, key: mark})


def _epoch(state: TrainState, steps_per_epoch: float | None) -> float:
    epoch, position = state.cursor.as_tuple()
    if not steps_per_epoch:
        return float(epoch)
    return epoch + position / steps_per_epoch


def log_entry(
    state: TrainState, mark: LogMark | None = None, *, steps_per_epoch: float | None = None
) -> dict[str, float]:
    """Return the log entry for the window since ``mark`` (default: the state's own mark).

    ``loss`` is the mean of the per-step losses in the window (exact: a difference of running
    float64 sums), over the steps whose loss was finite: ``logging_nan_inf_filter``, always on, which
    stands in for an inf/NaN step with the loss of the others (see ``filtered_mean_loss``); a window
    of only non-finite steps logs the mean of every finite step loss so far, never NaN. ``grad_norm``
    (before clipping) and ``learning_rate`` are those of the last step; ``epoch`` is fractional from
    the data cursor when ``steps_per_epoch`` is given.

    >>> import torch
    >>> from trainfold.core.state import Cursor, TrainState
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(3), cursor=Cursor(scalar(0), scalar(3)),
    ...                loss_total=scalar(4.0, torch.float64))
    >>> entry = log_entry(s, LogMark(step=scalar(1), loss_total=scalar(1.0, torch.float64)), steps_per_epoch=4)
    >>> entry["loss"], entry["epoch"], entry["step"], sorted(entry)
    (1.5, 0.75, 3, ['epoch', 'grad_norm', 'learning_rate', 'loss', 'step'])
    """
    mark = log_mark(state) if mark is None else mark
    steps = int(state.step) - int(mark.step)
    if steps <= 0:
        raise ValueError(
            f"nothing to log: the state is at step {int(state.step)} and the last log was at step "
            f"{int(mark.step)}; call log_entry only after a step (should_log decides when)"
        )
    metrics = state.metrics
    tokens = _tokens(state)
    return {
        "loss": filtered_mean_loss(state, mark),
        "grad_norm": float(metrics["grad_norm"]),
        "learning_rate": float(metrics["learning_rate"]),
        **tokens,
        "epoch": _epoch(state, steps_per_epoch),
        "step": int(state.step),
    }


def _mean_loss(state: TrainState, total_before: Tensor, nonfinite_before: Tensor, steps: int) -> float:
    counted = steps - (int(state.nonfinite_losses) - int(nonfinite_before))
    return ((state.loss_total.double() - total_before.double()) / counted).item() if counted > 0 else math.nan


def filtered_mean_loss(state: TrainState, mark: LogMark | None = None) -> float:
    """Return the logged loss of the window since ``mark``: HF's ``logging_nan_inf_filter``, done exactly.

    HF replaces an inf/NaN step's loss by an average of the window's others; each non-finite step
    counting as the mean of the finite ones leaves exactly the mean over the finite steps, which is
    what this returns. (HF's own formula, ``tr_loss / (1 + steps in the window)``, divides by one step
    too many, so it logs 0.75x the loss for a window [finite, nan], and 0.0 for a window of only
    non-finite steps.) A window with no finite step gets the mean of all finite step losses so far,
    the average HF's code comment promises; NaN only when no step has had a finite loss yet.

    >>> import torch
    >>> from trainfold.core.state import TrainState
    >>> s = TrainState(params={}, buffers={}, opt_state=None, step=scalar(4), loss_total=scalar(6.0, torch.float64),
    ...                nonfinite_losses=scalar(1))
    >>> filtered_mean_loss(s, LogMark(step=scalar(2), loss_total=scalar(4.0, torch.float64)))   # [2.0, nan]
    2.0
    >>> filtered_mean_loss(s, LogMark(step=scalar(3), loss_total=scalar(6.0, torch.float64)))   # [nan]: 6 / 3
    2.0
    """
    mark = log_mark(state) if mark is None else mark
    steps = int(state.step) - int(mark.step)
    window = _mean_loss(state, mark.loss_total, mark.nonfinite_losses, steps)
    if not math.isnan(window) or steps <= 0:
        return window
    return _mean_loss(state, torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64), int(state.step))


_STEP_METRICS = frozenset({"loss", "grad_norm", "learning_rate", "num_items"})


@attrs.define
class MetricWindow:
    """Window means of a step's other metrics (an objective's ``aux``: DPO rewards, GRPO rewards).

    ``add(state)`` after each step sums every scalar metric the step reported besides the loss,
    grad norm, learning rate and item count; ``take()`` returns their means over the steps since
    the last ``take`` (a metric that first appears mid-window, over the steps since it appeared)
    and starts a new window. A metric reported with a count of micro-batches (its
    ``core.losses.count_key``: SFT's ``entropy``, KTO's ``rewards/chosen``...) weighs by that count, so the
    window's mean is over every micro-batch since the last ``take``, as TRL's ``log`` averages its lists; a step
    whose count is 0 adds nothing, and a metric no step of the window had is left out of it. A step that did not
    advance the state (an all-ignored batch) is not counted twice. The sums live in this process, as TRL keeps its
    stored metrics: after a resume the first window covers the steps since the resume (the loss's
    window mean stays exact, from ``state.loss_total``).

    >>> from trainfold.core.state import TrainState
    >>> window = MetricWindow()
    >>> for step, margin in [(1, 0.5), (2, 1.5)]:
    ...     window.add(TrainState(params={}, buffers={}, opt_state=None, step=scalar(step),
    ...                           metrics={"loss": torch.tensor(0.7), "rewards/margins": torch.tensor(margin)}))
    >>> window.take(), window.take()
    ({'rewards/margins': 1.0}, {})
    """

    sums: dict[str, tuple[float, int]] = attrs.field(factory=dict)  # name -> (sum, steps (micro-batches) in it)
    last_step: int = -1
    pending: dict[str, float] = attrs.field(factory=dict)  # the last window when logged only at the run's end

    def add(self, state: TrainState) -> None:
        """Count ``state``'s metrics into the window (once per step)."""
        step = int(state.step)
        if step == self.last_step:
            return
        self.last_step = step
        metrics, counts = state.metrics, count_key("")
        for name, value in metrics.items():
            if name in _STEP_METRICS or name.endswith(counts) or not isinstance(value, Tensor) or value.numel() != 1:
                continue
            weight = int(metrics[count_key(name)]) if count_key(name) in metrics else 1
            if weight:
                total, n = self.sums.get(name, (0.0, 0))
                self.sums[name] = (total + float(value) * weight, n + weight)

    def take(self) -> dict[str, float]:
        """Return the window's means and start a new window."""
        means = {name: total / n for name, (total, n) in self.sums.items()}
        self.sums = {}
        return means


def _value(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


def eval_entry(
    metrics: Mapping[str, Any],
    state: TrainState | None = None,
    *,
    prefix: str = "eval",
    steps_per_epoch: float | None = None,
) -> dict[str, Any]:
    """Return an evaluation's log entry: every metric under ``{prefix}_``, then ``epoch`` and ``step``.

    A state that counts input tokens adds ``num_input_tokens_seen``, as HF adds it to every log.

    >>> eval_entry({"loss": 1.5, "eval_accuracy": 0.5})
    {'eval_loss': 1.5, 'eval_accuracy': 0.5}
    """
    head = f"{prefix}_"
    entry = {(k if k.startswith(head) else head + k): _value(v) for k, v in metrics.items()}
    if state is not None:
        entry["epoch"] = _epoch(state, steps_per_epoch)
        entry.update(_tokens(state))
        entry["step"] = int(state.step)
    return entry


def _tokens(state: TrainState) -> dict[str, int]:
    return {TOKENS_SEEN: int(state.extras[TOKENS_SEEN])} if TOKENS_SEEN in state.extras else {}


def train_summary(
    state: TrainState,
    start: TrainState,
    runtime: float,
    num_samples: int | None = None,
    *,
    steps_per_epoch: float | None = None,
) -> dict[str, float]:
    """Return the end-of-training entry for the steps from ``start`` to ``state`` (this run only).

    ``train_loss`` is the mean per-step loss over those steps (NaN if none ran).

    >>> import torch
    >>> from trainfold.core.state import TrainState, scalar
    >>> s0 = TrainState(params={}, buffers={}, opt_state=None)
    >>> s1 = attrs.evolve(s0, step=scalar(4), loss_total=scalar(6.0, torch.float64))
    >>> out = train_summary(s1, s0, runtime=2.0, num_samples=32)
    >>> out["train_loss"], out["train_steps_per_second"], out["train_samples_per_second"]
    (1.5, 2.0, 16.0)
    """
    steps = int(state.step) - int(start.step)
    loss = _mean_loss(state, start.loss_total, start.nonfinite_losses, steps)
    per_second = (lambda n: n / runtime) if runtime > 0 else (lambda n: math.nan)
    return {
        "train_runtime": float(runtime),
        "train_samples_per_second": per_second(num_samples) if num_samples is not None else math.nan,
        "train_steps_per_second": per_second(steps),
        "train_loss": loss,
        "epoch": _epoch(state, steps_per_epoch),
        **_tokens(state),  # num_input_tokens_seen, as HF
        "step": int(state.step),
    }


def window_state(window: Any) -> dict[str, Any]:
    """Return a ``MetricWindow``'s sums as JSON (the sidecar's ``metadata.window``).

    >>> window_state(MetricWindow({"rewards/margins": (1.5, 2)}, 4))
    {'sums': {'rewards/margins': [1.5, 2]}, 'last_step': 4}
    """
    return {"sums": {k: [t, n] for k, (t, n) in window.sums.items()}, "last_step": window.last_step}


def restore_window(window: Any, saved: Any, source: str | os.PathLike) -> None:
    """Put a checkpoint's ``metadata.window`` back into ``window`` (so the first window after a resume is exact)."""

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    ok = (
        isinstance(saved, Mapping)
        and sorted(saved) == ["last_step", "sums"]
        and count(saved["last_step"])
        and isinstance(saved["sums"], Mapping)
        and all(
            isinstance(v, list)
            and len(v) == 2
            and isinstance(v[0], (int, float))
            and count(v[1])
            and v[1] > 0
            and not isinstance(v[0], bool)
            for v in saved["sums"].values()
        )
    )
    if not ok:
        raise ValueError(
            f"{Path(source) / 'trainfold.json'}: field 'metadata.window' must be "
            f"{{'sums': {{name: [total, steps]}}, 'last_step': int}}, got {saved!r:.100}; {_FIX_WINDOW}"
        )
    window.sums = {k: (float(t), int(n)) for k, (t, n) in saved["sums"].items()}
    window.last_step = int(saved["last_step"])
