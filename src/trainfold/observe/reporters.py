"""Reporters send log entries somewhere: a JSON-lines file, TensorBoard, Trackio, Weights & Biases.

A ``Progress`` display (tqdm or a plain line) shows the run as it goes.

A reporter has ``log(entry, step)`` and ``close()``. ``make_reporters(report_to, ...)`` builds
them from the Hugging Face ``report_to`` setting and returns a ``Reporters`` group, which is
itself a reporter and a context manager that closes every member even when training raises:

>>> import json, pathlib, tempfile
>>> out = pathlib.Path(tempfile.mkdtemp())
>>> with make_reporters(["jsonl"], out) as reporters:
...     reporters.log({"loss": 2.5, "step": 1}, step=1)
>>> [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
[{'loss': 2.5, 'step': 1}]
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import attrs
import torch

from trainfold.core.state import TrainState

__all__ = [
    "Reporter",
    "Reporters",
    "JsonlReporter",
    "TensorBoardReporter",
    "TrackioReporter",
    "WandbReporter",
    "REPORTERS",
    "installed_reporters",
    "make_reporters",
    "tracker_key",
    "tensorboard_dir",
    "Progress",
    "progress",
]

_EXTRA = "pip install 'trainfold[tracking]'"


class Reporter(Protocol):
    """Where log entries go.

    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "log.jsonl"
    >>> reporter: Reporter = JsonlReporter(path)
    >>> reporter.log({"loss": 1.5}, step=3); reporter.close(); path.read_text().splitlines()
    ['{"loss": 1.5, "step": 3}']
    """

    def log(self, entry: Mapping[str, Any], step: int) -> None:
        """Record ``entry`` (metric name -> number) at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and release what the reporter holds; safe to call twice."""


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


def _json_ready(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


# -- the reporters ---------------------------------------------------------------------------------


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
        line = json.dumps(_json_ready({**entry, "step": int(step)}), allow_nan=False, default=str)
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

    >>> REPORTERS["tensorboard"], [tracker_key(k) for k in ("loss", "eval_loss")]
    ('tensorboard', ['train/loss', 'eval/loss'])
    """

    def __init__(self, log_dir: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional
        except ImportError:
            raise ImportError(f"report_to 'tensorboard' needs the tensorboard package: {_EXTRA}") from None
        self.log_dir = Path(log_dir)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))
        if config:
            self._writer.add_text("args", json.dumps(_json_ready(dict(config)), indent=2, default=str))  # HF's tag

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

    >>> try:
    ...     make_reporters(["trackio", "trakio"], "unused")
    ... except ValueError as e:
    ...     print(str(e).splitlines()[0])
    unknown reporter 'trakio'; choose from ['jsonl', 'tensorboard', 'trackio', 'wandb'], 'all' or 'none'
    """

    def __init__(self, project: str, run_name: str | None, config: Mapping[str, Any] | None = None) -> None:
        try:
            import trackio  # noqa: PLC0415 - optional
        except ImportError:
            raise ImportError(f"report_to 'trackio' needs the trackio package: {_EXTRA}") from None
        self._run: Any = trackio.init(project=project, name=run_name, config=_json_ready(dict(config or {})))


class WandbReporter(_TrackerRun):
    """Log to Weights & Biases; with ``WANDB_MODE=offline`` the run is written under ``output_dir/wandb``.

    It needs the ``wandb`` package; a ``report_to`` that mixes ``"none"`` with it is refused first:

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
            import wandb  # noqa: PLC0415 - optional
        except ImportError:
            raise ImportError(f"report_to 'wandb' needs the wandb package: {_EXTRA}") from None
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=project, name=run_name, config=_json_ready(dict(config or {})), dir=str(output_dir)
        )

    @property
    def run_dir(self) -> Path | None:
        """The run's local directory (None once closed)."""
        return None if self._run is None else Path(self._run.dir).parent


# -- the group and the factory ---------------------------------------------------------------------


@attrs.frozen
class Reporters:
    """A group of reporters, itself a reporter; as a context manager it closes them all on exit.

    >>> import pathlib, tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> with Reporters((JsonlReporter(out / "a.jsonl"), JsonlReporter(out / "b.jsonl"))) as group:
    ...     group.log({"loss": 0.5}, step=7)
    >>> len(group), [r.path.read_text().strip() for r in group]
    (2, ['{"loss": 0.5, "step": 7}', '{"loss": 0.5, "step": 7}'])
    """

    members: tuple[Any, ...] = ()

    def log(self, entry: Mapping[str, Any], step: int) -> None:
        """Send ``entry`` to every member."""
        for reporter in self.members:
            reporter.log(entry, step)

    def close(self) -> None:
        """Close every member, even when one of them fails to close (the first error is raised)."""
        first: BaseException | None = None
        for reporter in self.members:
            try:
                reporter.close()
            except Exception as err:  # noqa: BLE001 - close the rest, then raise
                first = first or err
        if first is not None:
            raise first

    def including(self, *more: Any) -> Reporters:
        """Return a group that also sends to ``more`` (a new group; this one is unchanged).

        >>> len(Reporters().including(Reporters(), Reporters()))
        2
        """
        return Reporters((*self.members, *more))

    def __iter__(self) -> Any:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    def __enter__(self) -> Reporters:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:  # training failed: close everything, but let the training error be the one raised
            self.close()
        except Exception as err:  # noqa: BLE001
            exc.add_note(f"closing the reporters also failed: {err!r}")


# name -> the package it needs (None: built in)
REPORTERS: dict[str, str | None] = {"jsonl": None, "tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}


def installed_reporters() -> list[str]:
    """Return the reporter names whose packages are installed (``jsonl`` always is).

    >>> "jsonl" in installed_reporters()
    True
    """
    return [name for name, pkg in REPORTERS.items() if pkg is None or importlib.util.find_spec(pkg) is not None]


def _names(report_to: str | Sequence[str] | None) -> list[str]:
    if report_to is None or report_to == "none":
        return []
    if report_to == "all":
        return installed_reporters()
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if "none" in names and len(names) > 1:
        raise ValueError(f"report_to={report_to!r} mixes 'none' with reporters; use 'none' alone or drop it")
    if "all" in names and len(names) > 1:
        raise ValueError(f"report_to={report_to!r} mixes 'all' with reporters; use 'all' alone or list them")
    names = [n for n in names if n != "none"]
    if "all" in names:
        return installed_reporters()
    unknown = [n for n in names if n not in REPORTERS]
    missing = [n for n in names if n in REPORTERS and REPORTERS[n] and importlib.util.find_spec(REPORTERS[n]) is None]
    errors = [f"unknown reporter {n!r}; choose from {sorted(REPORTERS)}, 'all' or 'none'" for n in unknown]
    errors += [f"report_to {n!r} needs the {REPORTERS[n]} package, which is not installed: {_EXTRA}" for n in missing]
    if errors:
        raise (ImportError if missing and not unknown else ValueError)("\n".join(errors))
    return list(dict.fromkeys(names))


def tensorboard_dir(
    output_dir: str | os.PathLike[str], run_name: str | None = None, logging_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Return where TensorBoard events go: ``logging_dir``, else ``$TENSORBOARD_LOGGING_DIR`` (HF 5's way),
    else ``output_dir/runs/<run_name>`` (``run`` without a name).

    >>> str(tensorboard_dir("out", "exp1")), str(tensorboard_dir("out", "exp1", logging_dir="tb"))
    ('out/runs/exp1', 'tb')
    """
    chosen = logging_dir or os.environ.get("TENSORBOARD_LOGGING_DIR")
    return Path(chosen).expanduser() if chosen else Path(output_dir) / "runs" / (run_name or "run")


def _make(
    name: str,
    output_dir: Path,
    run_name: str | None,
    config: Mapping[str, Any] | None,
    project: str,
    logging_dir: str | os.PathLike[str] | None = None,
) -> Any:
    if name == "jsonl":
        return JsonlReporter(output_dir / "log.jsonl")
    if name == "tensorboard":
        return TensorBoardReporter(tensorboard_dir(output_dir, run_name, logging_dir), config)
    if name == "trackio":
        return TrackioReporter(os.environ.get("TRACKIO_PROJECT", project), run_name, config)
    return WandbReporter(output_dir, os.environ.get("WANDB_PROJECT", project), run_name, config)


def make_reporters(
    report_to: str | Sequence[str] | None,
    output_dir: str | os.PathLike[str],
    run_name: str | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    project: str = "trainfold",
    logging_dir: str | os.PathLike[str] | None = None,
) -> Reporters:
    """Build the reporters named by ``report_to``: ``"none"``, ``"all"`` (every installed one), or names.

    Names: ``jsonl`` (``output_dir/log.jsonl``), ``tensorboard`` (:func:`tensorboard_dir`: ``logging_dir``
    or ``output_dir/runs/<run_name>``),
    ``trackio`` (local project ``project`` or ``$TRACKIO_PROJECT``), ``wandb`` (``$WANDB_PROJECT``
    or ``project``; set ``WANDB_MODE=offline`` to work without a network). Every name is checked
    before any reporter starts; if one fails to start, those already started are closed.

    >>> len(make_reporters("none", "unused"))
    0
    """
    names = _names(report_to)
    out = Path(output_dir)
    made: list[Any] = []
    try:
        for name in names:
            made.append(_make(name, out, run_name, config, project, logging_dir))
    except BaseException:
        Reporters(tuple(made)).close()
        raise
    return Reporters(tuple(made))


# -- progress --------------------------------------------------------------------------------------


LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")  # HF's log_level values
_BAR_LEVELS = ("debug", "info", "warning", "passive")  # HF: tqdm only while the level is WARN or lower
_LINE_LEVELS = ("debug", "info", "passive")  # a log line is an info message


def _clock_text(seconds: float) -> str:
    """Format seconds as ``m:ss`` or ``h:mm:ss``.

    >>> _clock_text(5.2), _clock_text(754), _clock_text(3 * 3600 + 61), _clock_text(float("nan"))
    ('0:05', '12:34', '3:01:01', '?')
    """
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


_TRAIN_KEYS = ("loss", "learning_rate", "grad_norm")
_SHORT = {"learning_rate": "lr"}
_SKIP = frozenset({"step", "epoch"})


class Progress:
    """The console view of a run: a progress bar on a terminal, one line per log elsewhere.

    Made by ``progress(...)``; ``update(state)`` after each step, ``log(entry, step)`` for each log
    entry (train logs, evaluations, the final summary: it is a reporter), ``close()`` at the end (or
    use it as a context manager). Without a bar (not a terminal, or ``bar=False``) each log is one
    line: step/max, loss, lr, grad_norm, tokens/s (labelled tokens, from the step's ``num_items``),
    elapsed time and ETA; each evaluation one line of its metrics. With a bar the same lines are
    written above it (``tqdm.write``). A disabled one shows nothing.

    >>> import io, types, torch
    >>> buf = io.StringIO()
    >>> state = types.SimpleNamespace(step=4, metrics={"num_items": torch.tensor(600.0)})
    >>> with progress(8, stream=buf, clock=iter([0.0, 2.0, 2.0, 2.5]).__next__) as console:
    ...     console.update(state)
    ...     console.log({"loss": 1.25, "learning_rate": 0.01, "grad_norm": 0.5, "epoch": 0.5, "step": 4}, step=4)
    ...     console.log({"eval_loss": 1.5, "epoch": 0.5, "step": 4}, step=4)
    >>> print(buf.getvalue(), end="")
    step 4/8  loss 1.25  lr 0.01  grad_norm 0.5  epoch 0.5  tokens/s 300  elapsed 0:02  eta 0:02
    eval step 4/8  eval_loss 1.5  epoch 0.5
    """

    def __init__(
        self,
        total: int | None,
        initial: int,
        stream: IO[str] | None,
        bar: Any,
        clock: Callable[[], float],
        min_interval: float,
        *,
        rewrite: bool = False,
        lines: bool = True,
    ) -> None:
        self._total, self._initial, self._stream, self._bar = total, initial, stream, bar
        self._clock, self._min_interval, self._rewrite, self._lines = clock, min_interval, rewrite, lines
        self._start = clock()
        self._last_print = -math.inf
        self._line = ""
        self._step, self._tokens, self._step_time = initial, 0.0, self._start
        self._items: list[Any] = []  # the steps' num_items since the last log, summed then (no sync per step)
        self._last_items: Any = None

    @property
    def enabled(self) -> bool:
        """Whether anything is shown."""
        return self._stream is not None

    def update(self, state: TrainState) -> None:
        """Count the step (and its labelled tokens); move the bar, or rewrite the terminal line."""
        if self._stream is None:
            return
        items = state.metrics.get("num_items")
        if items is None:
            self._tokens = math.nan
        elif items is not self._last_items:  # a new step (the same state seen twice counts once)
            self._items.append(items)
            self._last_items = items
            if len(self._items) >= 1024:  # runs that seldom log: keep the list short
                self._count_tokens()
        self._step_time = self._clock()
        if self._bar is None and not self._rewrite:
            return
        self._step = int(state.step)
        if self._bar is not None:
            loss, lr = float(state.metrics["loss"]), float(state.metrics["learning_rate"])
            self._bar.set_postfix(loss=f"{loss:.4g}", lr=f"{lr:.3g}", refresh=False)
            self._bar.update(self._step - self._bar.n)
        else:
            self._redraw(state)

    def _redraw(self, state: TrainState) -> None:
        assert self._stream is not None
        loss, lr = float(state.metrics["loss"]), float(state.metrics["learning_rate"])
        elapsed = self._step_time - self._start
        rate = (self._step - self._initial) / elapsed if elapsed > 0 else math.nan
        line = f"{self._of(self._step)}  loss {loss:.4g}  lr {lr:.3g}  {rate:.3g} step/s"
        self._line = line.ljust(len(self._line))  # blank out the rest of a longer previous line
        if self._step_time - self._last_print >= self._min_interval or (
            self._total is not None and self._step >= self._total
        ):
            self._stream.write("\r" + self._line)
            self._stream.flush()
            self._last_print = self._step_time

    def _of(self, step: int) -> str:
        return f"step {step}" + (f"/{self._total}" if self._total is not None else "")

    def line(self, entry: Mapping[str, Any], step: int) -> str:
        """Return the console line of a log entry (a train log, an evaluation or the run's summary)."""
        numbers = {k: v for k, v in entry.items() if k not in _SKIP and isinstance(v, (int, float))}
        if any(k.startswith(("eval_", "test_")) for k in numbers):
            head = "eval "
        elif "train_runtime" in numbers:
            head = "done "
        else:
            head = ""
        parts = [head + self._of(int(step))]
        first = [k for k in _TRAIN_KEYS if k in numbers]
        parts += [f"{_SHORT.get(k, k)} {_number(numbers[k])}" for k in first]
        parts += [f"{k} {_number(v)}" for k, v in numbers.items() if k not in first]
        if "epoch" in entry:
            parts.append(f"epoch {_number(float(entry['epoch']))}")
        if not head:
            parts += self._timing(int(step))
        return "  ".join(parts)

    def _timing(self, step: int) -> list[str]:
        elapsed = self._step_time - self._start
        steps = step - self._initial
        self._count_tokens()
        out = []
        if elapsed > 0 and steps > 0:
            if math.isfinite(self._tokens):
                out.append(f"tokens/s {self._tokens / elapsed:.4g}")
            out.append(f"elapsed {_clock_text(elapsed)}")
            if self._total is not None:
                out.append(f"eta {_clock_text((self._total - step) * elapsed / steps)}")
        return out

    def _count_tokens(self) -> None:
        if self._items:
            self._tokens += float(torch.stack(self._items).sum())
            self._items = []

    def log(self, entry: Mapping[str, Any], step: int) -> None:
        """Show one log entry as a line (above the bar when there is one)."""
        if self._stream is None or not self._lines:
            return
        text = self.line(entry, step)
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
            return
        if self._rewrite and self._line:
            text = "\r" + text.ljust(len(self._line)) + "\n" + self._line
        else:
            text += "\n"
        self._stream.write(text)
        self._stream.flush()

    def close(self) -> None:
        """Finish the display (end the bar's line); safe to call twice."""
        if self._stream is None:
            return
        if self._bar is not None:
            self._bar.close()
        elif self._rewrite:
            self._stream.write(("\r" + self._line if self._line else "") + "\n")
            self._stream.flush()
        self._stream = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(
    total: int | None = None,
    *,
    initial: int = 0,
    enabled: bool | None = True,
    bar: bool | None = None,
    log_level: str = "passive",
    stream: IO[str] | None = None,
    use_tqdm: bool | None = None,
    clock: Callable[[], float] = time.monotonic,
    min_interval: float = 0.1,
) -> Progress:
    """Return the console view of a run of ``total`` steps starting at step ``initial``.

    ``bar=None`` shows a progress bar only when ``stream`` (default stderr) is a terminal (HF's
    ``disable_tqdm``: ``bar = None if disable_tqdm is None else not disable_tqdm``); without one, each
    log is one line. ``log_level`` (HF's names): ``passive``, ``info`` and ``debug`` show the log
    lines; ``warning`` keeps only the bar; ``error`` and ``critical`` show nothing. ``enabled=False``
    shows nothing (ranks other than 0). ``use_tqdm=None`` draws the bar with tqdm when installed;
    ``False`` rewrites one plain line.

    >>> import io
    >>> progress(10, stream=io.StringIO()).enabled, progress(10, stream=io.StringIO(), log_level="error").enabled
    (True, False)
    """
    if log_level not in LOG_LEVELS:
        raise ValueError(f"log_level={log_level!r} is not one of {list(LOG_LEVELS)}")
    stream = sys.stderr if stream is None else stream
    if bar is None:
        bar = bool(getattr(stream, "isatty", lambda: False)())
    bar = bar and log_level in _BAR_LEVELS
    lines = log_level in _LINE_LEVELS
    if enabled is False or not (bar or lines):
        return Progress(total, initial, None, None, clock, min_interval)
    drawn = None
    if bar and use_tqdm is not False:
        try:
            from tqdm.auto import tqdm  # noqa: PLC0415 - optional
        except ImportError:
            if use_tqdm:
                raise ImportError("use_tqdm=True needs tqdm: pip install 'trainfold[progress]'") from None
        else:
            drawn = tqdm(total=total, initial=initial, file=stream, unit="step", dynamic_ncols=True)
    return Progress(total, initial, stream, drawn, clock, min_interval, rewrite=bar and drawn is None, lines=lines)
