"""Where log entries go, one reporter class each: a JSON-lines file, TensorBoard, Trackio, Weights & Biases.

Each has ``log(entry, step)`` and ``close()``; trackers take each key under its :func:`tracker_key`
name. ``trainfold.observe.reporters`` builds them from ``report_to``.

>>> tracker_key("eval_accuracy")
'eval/accuracy'
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

__all__ = [
    "EXTRA",
    "JsonlReporter",
    "TensorBoardReporter",
    "TrackioReporter",
    "WandbReporter",
    "json_ready",
    "tracker_key",
]

EXTRA = "pip install 'trainfold[tracking]'"  # what installs the trackers' packages


def tracker_key(name: str) -> str:
    """Return the tracker name of a log key: ``eval_x`` -> ``eval/x``, ``test_x`` -> ``test/x``, else ``train/x``.

    >>> tracker_key("eval_loss"), tracker_key("loss"), tracker_key("train_runtime")
    ('eval/loss', 'train/loss', 'train/train_runtime')
    """
    for prefix in ("eval_", "test_"):
        if name.startswith(prefix):
            return f"{prefix[:-1]}/{name[len(prefix) :]}"
    return f"train/{name}"


def _scalars(entry: Mapping[str, Any]) -> dict[str, float]:
    """The entry's numbers under tracker names, without ``step`` (trackers take it separately)."""
    return {
        tracker_key(k): float(v)
        for k, v in entry.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def json_ready(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


class JsonlReporter:
    """Append one JSON object per log to ``path`` (NaN and infinities become ``null``), flushed each time.

    >>> import json, pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "logs" / "log.jsonl"
    >>> reporter = JsonlReporter(path)
    >>> reporter.log({"loss": float("nan"), "grad_norm": 0.5}, step=1)
    >>> reporter.log({"loss": 2.0}, step=2)
    >>> reporter.close(); reporter.close()
    >>> [json.loads(line) for line in path.read_text().splitlines()]
    [{'loss': None, 'grad_norm': 0.5, 'step': 1}, {'loss': 2.0, 'step': 2}]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def log(self, entry: Mapping[str, Any], step: int) -> None:
        """Write ``entry`` with its ``step`` as one line."""
        if self._file is None:
            raise ValueError(f"the jsonl reporter for {str(self.path)!r} is closed; make a new one to log again")
        line = json.dumps(json_ready({**entry, "step": int(step)}), allow_nan=False, default=str)
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardReporter:
    """Write scalars to TensorBoard event files in ``log_dir`` (``eval_*`` keys under ``eval/``).

    It needs the ``tensorboard`` package; each key is written under its :func:`tracker_key` tag:

    >>> [tracker_key(k) for k in ("loss", "eval_loss")]
    ['train/loss', 'eval/loss']
    """

    def __init__(self, log_dir: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(f"report_to 'tensorboard' needs the tensorboard package: {EXTRA}") from None
        self.log_dir = Path(log_dir)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))
        if config:
            self._writer.add_text("args", json.dumps(json_ready(dict(config)), indent=2, default=str))  # HF's tag

    def log(self, entry: Mapping[str, Any], step: int) -> None:
        """Add each number of ``entry`` as a scalar at ``step``."""
        for tag, value in _scalars(entry).items():
            self._writer.add_scalar(tag, value, global_step=int(step))

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


class _TrackerRun:
    """A reporter over a tracker's run object, which has ``log(numbers, step=)`` and ``finish()`` (Trackio, W&B)."""

    _run: Any

    def log(self, entry: Mapping[str, Any], step: int) -> None:
        """Log the numbers of ``entry`` at ``step``."""
        self._run.log(_scalars(entry), step=int(step))

    def close(self) -> None:
        """Finish the run."""
        if self._run is not None:
            self._run.finish()
            self._run = None


class TrackioReporter(_TrackerRun):
    """Log to a local Trackio project (stored under ``TRACKIO_DIR``; no server needed).

    It needs the ``trackio`` package; ``make_reporters`` checks every name before starting any:

    >>> from trainfold.observe.reporters import make_reporters
    >>> try:
    ...     make_reporters(["trackio", "trakio"], "unused")
    ... except ValueError as e:
    ...     print(str(e).splitlines()[0])
    unknown reporter 'trakio'; choose from ['jsonl', 'tensorboard', 'trackio', 'wandb'], 'all' or 'none'
    """

    def __init__(self, project: str, run_name: str | None, config: Mapping[str, Any] | None = None) -> None:
        try:
            import trackio
        except ImportError:
            raise ImportError(f"report_to 'trackio' needs the trackio package: {EXTRA}") from None
        self._run: Any = trackio.init(project=project, name=run_name, config=json_ready(dict(config or {})))


class WandbReporter(_TrackerRun):
    """Log to Weights & Biases; with ``WANDB_MODE=offline`` the run is written under ``output_dir/wandb``.

    It needs the ``wandb`` package; a ``report_to`` that mixes ``"none"`` with it is refused first:

    >>> from trainfold.observe.reporters import make_reporters
    >>> try:
    ...     make_reporters(["wandb", "none"], "unused")
    ... except ValueError as e:
    ...     print(str(e))
    report_to=['wandb', 'none'] mixes 'none' with reporters; use 'none' alone or drop it
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        project: str,
        run_name: str | None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(f"report_to 'wandb' needs the wandb package: {EXTRA}") from None
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=project, name=run_name, config=json_ready(dict(config or {})), dir=str(output_dir)
        )

    @property
    def run_dir(self) -> Path | None:
        """The run's local directory (None once closed)."""
        return None if self._run is None else Path(self._run.dir).parent
