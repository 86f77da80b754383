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

from trainfold.state import TrainState

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
            self._writer.add_text("config", json.dumps(_json_ready(dict(config)), indent=2, default=str))

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


def _make(name: str, output_dir: Path, run_name: str | None, config: Mapping[str, Any] | None, project: str) -> Any:
    if name == "jsonl":
        return JsonlReporter(output_dir / "log.jsonl")
    if name == "tensorboard":
        return TensorBoardReporter(output_dir / "runs" / (run_name or "run"), config)
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
) -> Reporters:
    """Build the reporters named by ``report_to``: ``"none"``, ``"all"`` (every installed one), or names.

    Names: ``jsonl`` (``output_dir/log.jsonl``), ``tensorboard`` (``output_dir/runs/<run_name>``),
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
            made.append(_make(name, out, run_name, config, project))
    except BaseException:
        Reporters(tuple(made)).close()
        raise
    return Reporters(tuple(made))


# -- progress --------------------------------------------------------------------------------------


class Progress:
    """A progress display of step, loss and rate: tqdm when available, else one rewritten line.

    Made by ``progress(...)``; ``update(state)`` after each step, ``close()`` at the end (or use
    it as a context manager). A disabled one does nothing.

    >>> import io, types
    >>> buf = io.StringIO()
    >>> state = types.SimpleNamespace(step=4, metrics={"loss": 1.25, "learning_rate": 0.01})
    >>> with progress(8, enabled=True, stream=buf, use_tqdm=False, clock=iter([0.0, 2.0]).__next__) as bar:
    ...     bar.update(state)
    >>> buf.getvalue().splitlines()[-1].strip()     # the line is rewritten in place
    'step 4/8  loss 1.25  lr 0.01  2 step/s'
    """

    def __init__(
        self,
        total: int | None,
        initial: int,
        stream: IO[str] | None,
        bar: Any,
        clock: Callable[[], float],
        min_interval: float,
    ) -> None:
        self._total, self._initial, self._stream, self._bar = total, initial, stream, bar
        self._clock, self._min_interval = clock, min_interval
        self._start = clock()
        self._last_print = -math.inf
        self._line = ""

    @property
    def enabled(self) -> bool:
        """Whether anything is shown."""
        return self._stream is not None

    def update(self, state: TrainState) -> None:
        """Show the state's step, its last step loss and learning rate, and the step rate."""
        if self._stream is None:
            return
        step = int(state.step)
        loss, lr = float(state.metrics["loss"]), float(state.metrics["learning_rate"])
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4g}", lr=f"{lr:.3g}", refresh=False)
            self._bar.update(step - self._bar.n)
            return
        now = self._clock()
        elapsed = now - self._start
        rate = (step - self._initial) / elapsed if elapsed > 0 else math.nan
        of = f"/{self._total}" if self._total is not None else ""
        line = f"step {step}{of}  loss {loss:.4g}  lr {lr:.3g}  {rate:.3g} step/s"
        self._line = line.ljust(len(self._line))  # blank out the rest of a longer previous line
        if now - self._last_print >= self._min_interval or (self._total is not None and step >= self._total):
            self._stream.write("\r" + self._line)
            self._stream.flush()
            self._last_print = now

    def close(self) -> None:
        """Finish the display (end the line); safe to call twice."""
        if self._stream is None:
            return
        if self._bar is not None:
            self._bar.close()
        else:
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
    enabled: bool | None = None,
    stream: IO[str] | None = None,
    use_tqdm: bool | None = None,
    clock: Callable[[], float] = time.monotonic,
    min_interval: float = 0.1,
) -> Progress:
    """Return a progress display for a run of ``total`` steps starting at step ``initial``.

    ``enabled=None`` shows it only when ``stream`` (default stderr) is a terminal; ``False``
    turns it off. ``use_tqdm=None`` uses tqdm when installed; ``False`` prints a plain line.

    >>> import io
    >>> progress(10, stream=io.StringIO()).enabled        # not a terminal
    False
    """
    stream = sys.stderr if stream is None else stream
    if enabled is None:
        enabled = bool(getattr(stream, "isatty", lambda: False)())
    if not enabled:
        return Progress(total, initial, None, None, clock, min_interval)
    bar = None
    if use_tqdm is not False:
        try:
            from tqdm.auto import tqdm  # noqa: PLC0415 - optional
        except ImportError:
            if use_tqdm:
                raise ImportError("use_tqdm=True needs tqdm: pip install 'trainfold[progress]'") from None
        else:
            bar = tqdm(total=total, initial=initial, file=stream, unit="step", dynamic_ncols=True)
    return Progress(total, initial, stream, bar, clock, min_interval)
