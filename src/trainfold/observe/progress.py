"""The console view of a run: a progress bar on a terminal (tqdm), one line per log elsewhere.

``progress(total, ...)`` builds a :class:`Progress`, itself a reporter (``log(entry, step)``);
``LOG_LEVELS`` are HF's ``log_level`` values, which choose what it shows.

>>> import io
>>> buf = io.StringIO()
>>> with progress(4, stream=buf, clock=iter([0.0, 1.0]).__next__) as console:
...     console.log({"eval_loss": 0.5, "step": 2}, step=2)
>>> print(buf.getvalue(), end="")
eval step 2/4  eval_loss 0.5
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch

from trainfold.core.state import TrainState

__all__ = ["LOG_LEVELS", "Progress", "progress"]


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
        elif "train_loss" in numbers:  # the summary (a log counting tokens has a train_runtime too)
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
            from tqdm.auto import tqdm
        except ImportError:
            if use_tqdm:
                raise ImportError("use_tqdm=True needs tqdm: pip install 'trainfold[progress]'") from None
        else:
            drawn = tqdm(total=total, initial=initial, file=stream, unit="step", dynamic_ncols=True)
    return Progress(total, initial, stream, drawn, clock, min_interval, rewrite=bar and drawn is None, lines=lines)
