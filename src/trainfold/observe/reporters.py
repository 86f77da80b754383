"""Reporters send log entries somewhere: a JSON-lines file, TensorBoard, Trackio, Weights & Biases.

A ``Progress`` display (tqdm or a plain line; ``trainfold.observe.progress``) shows the run as it goes.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import attrs

from trainfold.observe.progress import LOG_LEVELS, Progress, progress

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
    "LOG_LEVELS",
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
