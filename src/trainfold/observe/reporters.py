"""Reporters send log entries somewhere: a JSON-lines file, TensorBoard, Trackio, Weights & Biases (``sinks``).

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
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from trainfold.observe.progress import LOG_LEVELS, Progress, progress
from trainfold.observe.sinks import (
    EXTRA,
    JsonlReporter,
    TensorBoardReporter,
    TrackioReporter,
    WandbReporter,
    tracker_key,
)

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
            except Exception as err:
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
        except Exception as err:
            if sys.version_info >= (3, 11):  # Python 3.10 has no exception notes
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
    missing = [n for n in names if (package := REPORTERS.get(n)) and importlib.util.find_spec(package) is None]
    errors = [f"unknown reporter {n!r}; choose from {sorted(REPORTERS)}, 'all' or 'none'" for n in unknown]
    errors += [f"report_to {n!r} needs the {REPORTERS[n]} package, which is not installed: {EXTRA}" for n in missing]
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
