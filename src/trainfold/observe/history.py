"""The log history as an append-only file next to the checkpoints, read back lazily.

``HistoryFile`` appends one JSON line per log entry to ``output_dir/log_history.jsonl`` and
knows where it stands (``position()``: bytes, entries and the CRC-32 of what was written); a
checkpoint's sidecar keeps that position, not the entries, so a save costs the same at step 10
and at step 100 000. ``HistoryFile.resume`` truncates the file back to a checkpoint's position
(after checking that its bytes are the ones the checkpoint saw). ``LogHistory`` is the sequence
``TrainResult.log_history`` hands out: it reads the file when asked and holds no entries.

>>> import pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp()) / HISTORY_FILE
>>> with HistoryFile(path) as h:
...     h.append({"loss": 2.5, "step": 1})
...     at = h.position()
...     h.append({"loss": 2.0, "step": 2})
>>> list(LogHistory(path, at["offset"], at["entries"])), len(LogHistory(path, **HistoryFile.span(path)))
([{'loss': 2.5, 'step': 1}], 2)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
import weakref
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainfold.ckpt.listing import catalog
from trainfold.ckpt.writer import disk_full, is_disk_full
from trainfold.observe.entries import restore_window, window_state  # the metric window's, kept here too

__all__ = ["HISTORY_FILE", "HistoryFile", "LogHistory", "verify", "start", "window_state", "restore_window"]

HISTORY_FILE = "log_history.jsonl"
PREVIOUS_FILE = HISTORY_FILE + ".previous"  # the newest checkpoint's history, while a fresh run has no checkpoint yet
_log = logging.getLogger(__name__)
_FIX = "resume from another checkpoint, or start fresh (log_history then starts empty)"


def _plain(value: Any) -> Any:
    """JSON for what a metric function may return besides Python numbers (numpy / torch scalars, arrays)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def verify(origin: str | os.PathLike, position: Any, *, source: str | os.PathLike) -> None:
    """Check that ``origin`` starts with the log history a checkpoint (``source``) recorded at ``position``.

    Raises ``ValueError`` naming the file and the checkpoint otherwise; reads, never writes.
    """
    origin = Path(origin)
    if not (
        isinstance(position, Mapping)
        and sorted(position) == ["crc32", "entries", "file", "offset"]
        and all(
            isinstance(position[k], int) and not isinstance(position[k], bool) and position[k] >= 0
            for k in ("crc32", "entries", "offset")
        )
    ):
        raise ValueError(
            f"{source}: field 'metadata.log' must be {{'file', 'offset', 'entries', 'crc32'}} "
            f"with counts, got {position!r:.100}; {_FIX}"
        )
    size = origin.stat().st_size if origin.is_file() else -1
    if size < position["offset"]:
        raise ValueError(
            f"{origin} holds {max(size, 0)} bytes but {source} recorded the log history up to byte "
            f"{position['offset']}; the file was truncated or replaced; {_FIX}"
        )
    crc, entries = 0, 0
    with open(origin, "rb") as f:
        left = position["offset"]
        while left:
            chunk = f.read(min(left, 1 << 22))
            crc, entries, left = zlib.crc32(chunk, crc), entries + chunk.count(b"\n"), left - len(chunk)
    if crc != position["crc32"] or entries != position["entries"]:
        raise ValueError(
            f"{origin} differs from the log history {source} recorded (CRC-32 or entry count); "
            f"a later run rewrote it; {_FIX}"
        )


class HistoryFile:
    """Append log entries (JSON-ready dicts) to ``path``; ``position()`` says where the file stands.

    A new ``HistoryFile`` empties the file (a fresh start); ``HistoryFile.resume`` continues one.
    ``sync()`` makes the written entries durable before a checkpoint records the position.
    """

    def __init__(self, path: str | os.PathLike, *, _at: Mapping[str, int] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        at = _at or {"offset": 0, "entries": 0, "crc32": 0}
        _before_truncating(self.path, at["offset"])
        self._file = open(self.path, "ab", buffering=0)  # unbuffered: nothing is left to write at close
        self._file.truncate(at["offset"])
        self.offset, self.entries, self.crc = at["offset"], at["entries"], at["crc32"]

    @classmethod
    def resume(
        cls,
        path: str | os.PathLike,
        position: Any,
        *,
        source: str | os.PathLike,
        copy_from: str | os.PathLike | None = None,
    ) -> HistoryFile:
        """Continue the history at a checkpoint's ``position`` (its sidecar's ``metadata.log``).

        ``copy_from`` is the history file next to that checkpoint when it is not ``path`` (a
        checkpoint of another output_dir). Raises ``ValueError`` naming the file and the
        checkpoint (``source``) when the bytes are not the ones the checkpoint recorded.
        """
        path = Path(path)
        origin = Path(copy_from) if copy_from is not None else path
        verify(origin, position, source=source)
        if origin != path:
            _before_truncating(path, 0)
            with open(origin, "rb") as src, open(path, "wb") as dst:
                left = position["offset"]
                while left:
                    chunk = src.read(min(left, 1 << 22))
                    dst.write(chunk)
                    left -= len(chunk)
        return cls(path, _at=position)

    @staticmethod
    def span(path: str | os.PathLike) -> dict[str, int]:
        """Return ``{"end": bytes, "entries": lines}`` of a whole history file (for ``LogHistory``)."""
        data = Path(path).read_bytes()
        return {"end": len(data), "entries": data.count(b"\n")}

    def append(self, entry: Mapping[str, Any]) -> None:
        """Write ``entry`` as one line (written through, not fsynced: ``sync`` does that before a save).

        A failed write (a full disk: ``OSError(ENOSPC)`` naming the file, the bytes and the intact checkpoint)
        leaves the file as it was before it: a part of the line written is cut off again."""
        line = (json.dumps(dict(entry), default=_plain) + "\n").encode()
        try:
            done = 0
            while done < len(line):  # an unbuffered write may write a part
                done += self._file.write(line[done:])
        except OSError as e:
            with contextlib.suppress(OSError):
                self._file.truncate(self.offset)
            if not is_disk_full(e):
                raise
            what = f"the log entry of step {entry.get('step', '?')} could not be appended to {self.path}"
            raise disk_full(e, self.path, what, len(line)) from e
        self.offset, self.entries, self.crc = self.offset + len(line), self.entries + 1, zlib.crc32(line, self.crc)

    def checkpointed(self) -> None:
        """Say that a checkpoint of this run is complete: the history a fresh start set aside is not needed anymore."""
        self.path.with_name(PREVIOUS_FILE).unlink(missing_ok=True)

    def sync(self) -> None:
        """Make every appended entry durable (called before a checkpoint records ``position()``)."""
        os.fsync(self._file.fileno())

    def position(self) -> dict[str, Any]:
        """Return what a checkpoint's sidecar keeps: the file's name, bytes, entries and CRC-32."""
        return {"file": self.path.name, "offset": self.offset, "entries": self.entries, "crc32": self.crc}

    def history(self) -> LogHistory:
        """Return the entries written so far, as a lazy sequence."""
        return LogHistory(self.path, self.offset, self.entries, self.crc)

    def close(self) -> None:
        """Close the file; safe to call twice."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> HistoryFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LIVE: weakref.WeakValueDictionary[int, LogHistory] = weakref.WeakValueDictionary()


def _before_truncating(path: Path, offset: int) -> None:
    """Let the live ``LogHistory`` objects of ``path`` that reach past ``offset`` read their entries first."""
    if not path.exists():
        return
    for history in list(_LIVE.values()):
        if history.end > offset and history._held is None and history.path.exists() and history.path.samefile(path):
            history._held = list(history._read())


class LogHistory(Sequence[dict[str, Any]]):
    """The first ``entries`` entries (``end`` bytes) of a history file, read when asked, never held.

    Indexing, slicing, ``len``, iteration and ``==`` with a list work as on a list; ``list(h)``
    makes one (e.g. for ``json.dump``). Reading a large history from the start costs a pass over
    the file each time: iterate once where you can. When a later run in this process rewrites the
    file, the entries are read into memory first, so the sequence does not change; when another
    process rewrote it, reading raises ``ValueError`` (the file's CRC-32 no longer matches ``crc32``).
    """

    def __init__(self, path: str | os.PathLike, end: int, entries: int, crc32: int | None = None) -> None:
        self.path, self.end, self.entries, self.crc32 = Path(path), int(end), int(entries), crc32
        self._held: list[dict[str, Any]] | None = None
        _LIVE[id(self)] = self

    def _read(self) -> Iterator[dict[str, Any]]:
        crc, left = 0, self.end
        with open(self.path, "rb") as f:
            for line in f:
                if left <= 0:
                    break
                line = line[:left]
                left -= len(line)
                crc = zlib.crc32(line, crc)
                try:
                    entry = json.loads(line)
                except ValueError:
                    raise self._changed() from None
                yield entry
        if left > 0 or (self.crc32 is not None and crc != self.crc32):
            raise self._changed()

    def _changed(self) -> ValueError:
        return ValueError(
            f"{self.path} changed since this log history was written (another run in the same "
            "output_dir rewrote it); keep list(result.log_history) before starting another run there"
        )

    def __len__(self) -> int:
        return self.entries

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._held is not None:
            return iter(self._held)
        return self._read()

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            wanted = range(self.entries)[index]
            picked = set(wanted)
            rows = {i: e for i, e in enumerate(self) if i in picked}
            return [rows[i] for i in wanted]
        i = range(self.entries)[index]  # IndexError as a list raises it
        for k, entry in enumerate(self):
            if k == i:
                return entry
        raise IndexError(f"{self.path} holds fewer than {i + 1} entries")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LogHistory, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LogHistory({str(self.path)!r}, {self.entries} entries)"


def start(
    output_dir: str | os.PathLike, source: str | os.PathLike | None, metadata: Mapping[str, Any] | None, *, writer: bool
) -> HistoryFile | list[dict[str, Any]]:
    """Return where a run logs: a ``HistoryFile`` in ``output_dir`` (the writer) or a list (other ranks).

    A fresh start (``source`` None) empties the file; when the newest checkpoint of ``output_dir`` recorded
    it, it is first moved aside as ``log_history.jsonl.previous``, kept until the new run's first checkpoint
    is complete (``HistoryFile.checkpointed``): a resume that goes back to that checkpoint meanwhile (the
    new run died before saving) continues it from there. A resume continues the history from the
    checkpoint's ``metadata.log`` position (copying the prefix when the checkpoint lies in another
    directory, or in the set-aside file), or from a format-1 sidecar's ``metadata.log_history`` list. A
    history file that no longer matches the checkpoint (a flipped bit, a truncation) is set aside as
    ``log_history.jsonl.damaged`` (the writer renames it, never deletes it); its readable lines are kept
    (an unreadable line is dropped, the lines after it kept), and a warning names the file, the cause,
    the lines dropped and the steps whose logs were cut off (the training state is not affected).
    """
    out = Path(output_dir) / HISTORY_FILE
    if source is None:
        return _written(out, [], writer=writer, fresh=True)
    sidecar = Path(source) / "trainfold.json"
    metadata = metadata or {}
    if "log" in metadata:
        return _continued(out, Path(source), _log_position(metadata["log"], sidecar), sidecar, writer=writer)
    return _written(out, _legacy_entries(metadata.get("log_history"), sidecar), writer=writer, fresh=False)


def _log_position(position: Any, sidecar: Path) -> Mapping[str, Any]:
    """Return a checkpoint's ``metadata.log`` (where its history ends), refusing one that names another file."""
    if not (
        isinstance(position, Mapping) and isinstance(position.get("file"), str) and position["file"] == HISTORY_FILE
    ):
        raise ValueError(f"{sidecar}: field 'metadata.log' must name {HISTORY_FILE}, got {position!r:.100}; {_FIX}")
    return position


def _legacy_entries(legacy: Any, sidecar: Path) -> list[dict[str, Any]]:
    """Return a format-1 sidecar's ``metadata.log_history`` list (none: empty)."""
    if legacy is not None and not (isinstance(legacy, list) and all(isinstance(e, dict) for e in legacy)):
        raise ValueError(
            f"{sidecar}: field 'metadata.log_history' must be a list of dicts, "
            f"got {type(legacy).__name__} {legacy!r:.60}; {_FIX}"
        )
    return legacy or []


def _continued(
    out: Path, source: Path, position: Mapping[str, Any], sidecar: Path, *, writer: bool
) -> HistoryFile | list[dict[str, Any]]:
    """Return the history continued from the checkpoint's ``position``, or what is salvaged of a damaged one."""
    origin = _recorded_in(source.parent, position, sidecar)
    try:
        if writer:
            copy = None if origin.resolve() == out.resolve() else origin
            return HistoryFile.resume(out, position, source=sidecar, copy_from=copy)
        verify(origin, position, source=sidecar)
        return list(LogHistory(origin, position["offset"], position["entries"]))
    except (OSError, ValueError) as e:
        if "metadata.log" in str(e):
            raise
        entries = _salvage(origin, position, e, sidecar, aside=writer and origin.resolve() == out.resolve())
    return _written(out, entries, writer=writer, fresh=False)


def _written(out: Path, entries: list[dict[str, Any]], *, writer: bool, fresh: bool) -> HistoryFile | list[dict]:
    """Return the writer's ``HistoryFile`` holding ``entries`` (a fresh start first keeps the old file for the
    checkpoints that recorded it), or, on the other ranks, the list."""
    if not writer:
        return list(entries)
    if fresh:
        _keep_for_checkpoints(out)
    history = HistoryFile(out)
    for entry in entries:
        history.append(entry)
    return history


def _keep_for_checkpoints(out: Path) -> None:
    """Before a fresh start empties ``out``: move it aside (``PREVIOUS_FILE``) when the newest complete checkpoint
    of its directory recorded it, so that a resume from that checkpoint still finds its history."""
    if not out.is_file() or out.stat().st_size == 0:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a malformed checkpoint: the resume that may come names it
        logged = [(p, m["metadata"]["log"]) for p, m in catalog(out.parent) if "log" in (m.get("metadata") or {})]
    if logged:
        with contextlib.suppress(OSError, ValueError):
            verify(out, logged[-1][1], source=logged[-1][0])
            os.replace(out, out.with_name(PREVIOUS_FILE))


def _recorded_in(folder: Path, position: Any, sidecar: Path) -> Path:
    """Return the history file of ``folder`` that holds what a checkpoint recorded: ``HISTORY_FILE``, or the one a
    fresh start set aside (``PREVIOUS_FILE``) when that run died before its first checkpoint."""
    origin, previous = folder / HISTORY_FILE, folder / PREVIOUS_FILE
    if not previous.is_file():
        return origin
    for candidate in (origin, previous):
        with contextlib.suppress(OSError, ValueError):
            verify(candidate, position, source=sidecar)
            if candidate == previous:
                _log.info("continuing the log history of %s from %s (set aside by a later start)", sidecar, previous)
            return candidate
    return origin


def _salvage(origin: Path, position: Mapping[str, Any], cause: Exception, sidecar: Path, *, aside: bool) -> list[Any]:
    """Return the readable entries of a damaged history file up to the checkpoint's position (an unreadable line
    is dropped, the lines after it kept); set the file aside (``aside``) and warn what was lost."""
    data = origin.read_bytes()[: position["offset"]] if origin.is_file() else b""
    lines = data.split(b"\n")[:-1][: position["entries"]]  # whole lines: a line cut off at the end is lost
    parsed = [_entry(line) for line in lines]
    kept, bad = (
        [e for e in parsed if isinstance(e, dict)],
        [n for n, e in enumerate(parsed, 1) if not isinstance(e, dict)],
    )
    where = ""
    if aside and origin.is_file():
        target, n = origin.with_name(origin.name + ".damaged"), 1
        while target.exists():
            n += 1
            target = origin.with_name(f"{origin.name}.damaged-{n}")
        os.replace(origin, target)
        where = f"; the file is kept as {target.name}"
    try:
        step: Any = json.loads(sidecar.read_bytes())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        step = "?"
    last = next((e["step"] for e in reversed(kept) if isinstance(e.get("step"), int)), 0)
    cut, said = position["entries"] - len(lines), f"kept {len(kept)} of its {position['entries']} entries"
    if bad:
        said += f"; dropped line {', '.join(map(str, bad))}, which could not be read"
    if cut:
        said += f"; lost the last {cut} (the file was cut: the logs of steps {last + 1} to {step})"
    if not bad and not cut:
        said += "; every line reads, but a logged value may differ from what was logged"
    text = f"{origin} does not match the log history {sidecar} recorded ({cause}){where}; {said}"
    warnings.warn(text, UserWarning, stacklevel=3)
    return kept


def _entry(line: bytes) -> Any:
    """Return the JSON value of a history ``line``, or None where it does not parse (a damaged line)."""
    with contextlib.suppress(ValueError):
        return json.loads(line)
    return None
