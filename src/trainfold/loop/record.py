"""``RunLog``: the record of a run in progress, a plain mutable ``attrs.define`` (what changes lives here).

The hooks read and write it: the log hook appends entries, the evaluate hook its metrics, the save hook
the checkpoints it wrote; a hook asks the run to stop with ``log.stop(reason)``. ``loop.run`` returns it
with the run's ``status``.

>>> log = RunLog()
>>> log.record({"loss": 1.5, "step": 2}); log.stop("early_stop"); log.stop("later")
>>> log.history, log.stop_reason, log.exit_code
([{'loss': 1.5, 'step': 2}], 'early_stop', 0)
"""

from __future__ import annotations

import signal as signals
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["STATUSES", "RunLog"]

# How a run ended: its steps ran out ("completed"), a hook stopped it ("stopped": early stopping), a signal
# ("preempted": checkpoint saved), or its params turned inf/NaN ("diverged": nothing non-finite saved).
STATUSES = ("running", "completed", "stopped", "preempted", "diverged")


@attrs.define(eq=False)
class RunLog:
    """A run's record: status, log history, evaluations, checkpoints written, the best one, why it stopped."""

    status: str = "running"
    step: int = 0  # the optimizer step the run is at
    history: list[dict[str, Any]] = attrs.Factory(list)  # every log entry (a resumed run: from its start)
    metrics: dict[str, Any] = attrs.Factory(dict)  # the latest evaluation's metrics
    evaluations: int = 0  # evaluations done in this call
    saved: list[Path] = attrs.Factory(list)  # the checkpoints this call wrote, in order
    best: Path | None = None  # the best checkpoint (``loop.save(best=...)``), once the run ends
    stop_reason: str | None = None  # the first stop a hook asked for ("early_stop", "diverged")
    diverged_at: int | None = None  # the step after which the params turned inf/NaN
    signal: int | None = None  # the signal that preempted the run
    resumed_from: Path | None = None  # the checkpoint this call started from
    summary: dict[str, Any] = attrs.Factory(dict)  # the end-of-run entry: runtime, train_loss, steps per second
    directory: Any = attrs.field(default=None, repr=False)  # the ``loop.directory.RunDir`` the run owns, or None
    closing: bool = False  # the step just made closes an epoch (``close_epoch``; reset before each step's hooks)
    marks: dict[int, Any] = attrs.field(factory=dict, repr=False)  # per hook: when it last fired (schedules)

    def record(self, entry: Mapping[str, Any]) -> None:
        """Append ``entry`` to the history (and to ``log_history.jsonl`` of the run directory)."""
        entry = dict(entry)
        self.history.append(entry)
        if self.directory is not None:
            self.directory.append(entry)

    def stop(self, reason: str) -> None:
        """Ask the run to stop before its next step; the first reason asked for is kept."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def close_epoch(self) -> None:
        """Mark the step just made as closing an epoch: the epoch's hooks fire after its step hooks (HF closes one
        when early stopping fires, or at the run's last step)."""
        self.closing = True

    def stopping(self, state: Any) -> bool:
        """The stop predicate of the run: a hook asked to stop."""
        return self.stop_reason is not None

    @property
    def exit_code(self) -> int:
        """Return the exit status a job script should end with: ``128 + signal`` when preempted (143), else 0.

        >>> RunLog(status="preempted", signal=15).exit_code
        143
        """
        if self.status != "preempted":
            return 0
        return 128 + int(self.signal if self.signal is not None else signals.SIGTERM)
