"""The directory a run owns: its lock and identity, the checkpoint a resume starts from, saves and the log history.

``open_run_dir(output_dir, state, resume=, settings=)`` claims the directory (``ckpt.run_dir.claim``: lock,
leftovers removed, another run's checkpoints refused, the run file written); ``RunDir.start`` loads the newest
intact checkpoint on a resume (a damaged one is set aside as ``<name>.damaged`` and the previous one taken) and
continues ``log_history.jsonl``; ``RunDir.save`` writes an atomic, verified checkpoint and rotates old ones.

>>> import tempfile, torch
>>> from trainfold.core.state import init_state
>>> from trainfold.optim import sgd
>>> state, out = init_state(torch.nn.Linear(2, 1), sgd(0.1)), tempfile.mkdtemp()
>>> with open_run_dir(out, state) as run_dir:
...     state, source = run_dir.start(state)
...     path = run_dir.save(state)
>>> source, path.name, [p.name for p in ckpt.list_checkpoints(out)]
(None, 'checkpoint-0', ['checkpoint-0'])
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
from torch import nn

from trainfold import ckpt
from trainfold.ckpt import policy, run_dir
from trainfold.ckpt.listing import damaged_checkpoints
from trainfold.ckpt.run_identity import RunSettings, settings_fingerprint
from trainfold.ckpt.sharded import Saver
from trainfold.ckpt.sidecar import CheckpointWarning, is_weights_only
from trainfold.core.state import TrainState
from trainfold.observe import history as log_file

__all__ = ["RunDir", "open_run_dir", "NoCheckpointError", "load_newest", "set_aside", "already_saved"]


class NoCheckpointError(FileNotFoundError, ValueError):
    """A resume finds no checkpoint: a ``FileNotFoundError``, and the ``ValueError`` that ``transformers.Trainer``
    raises, with its words ("Can't find a valid checkpoint at ...")."""


@attrs.define(eq=False)
class RunDir:
    """A claimed run directory: the claim (lock, identity, what to resume), its settings and its log history.

    ``writer=False`` (ranks other than 0 of a run of several processes) reads what the writer claimed, and
    writes nothing but its part of a sharded checkpoint."""

    root: Path
    claim: run_dir.Claim
    settings: dict[str, Any]
    history: Any = None  # a history.HistoryFile once started (a plain list on a rank that is not the writer)
    writer: bool = True
    resumed: dict[str, Any] | None = None  # the sidecar of the checkpoint the run continues (None: from the start)

    def start(
        self,
        state: TrainState,
        check: Callable[[Mapping[str, Any], Any], None] | None = None,
        *,
        weights_only: bool = False,
    ) -> tuple[TrainState, Path | None]:
        """Return ``(state, source)``: ``state`` loaded from the newest intact checkpoint on a resume (``check``
        judges each candidate's sidecar first), else as given; continue or begin the log history.

        ``weights_only``: the tensors of ``state`` that a checkpoint holds are loaded (``ckpt.warm_start``), the
        run starts afresh from them (``resumed`` stays None: a new history, the step counts of ``state``)."""
        source, meta = self.claim.source, None
        if source is not None and weights_only:
            if check is not None:
                check(ckpt.read_metadata(source), source)
            state = ckpt.warm_start(source, like=state)
        elif source is not None:
            state, source, meta = load_newest(self.claim, state, check=check, writer=self.writer)
        self.resumed = meta
        position = meta["metadata"] if meta is not None else None
        self.history = log_file.start(self.root, source if meta else None, position, writer=self.writer)
        if isinstance(self.history, log_file.HistoryFile):
            self.claim.callback(self.history.close)
        return state, source

    def entries(self) -> list[dict[str, Any]]:
        """Return the log history written so far (a resumed run's from its start)."""
        return list(self.history.history())

    def append(self, entry: Mapping[str, Any]) -> None:
        """Append a log entry to ``log_history.jsonl``."""
        self.history.append(entry)

    def save(
        self,
        state: TrainState,
        *,
        keep_total: int | None = None,
        keep: Collection[Path] = (),
        model: nn.Module | None = None,
        jit: bool = False,
        metadata: Mapping[str, Any] | None = None,
        save_only_model: bool = False,
        extra_files: Callable[[Path], Any] | None = None,
        saver: Saver | None = None,
    ) -> Path:
        """Write ``state`` as ``checkpoint-{step}`` (atomic, hashed); once complete keep ``keep_total`` of this
        run's (never the newest or one in ``keep``); ``jit``: the preemption checkpoint, marked as such.

        ``model``'s config (and ``extra_files(path)``: a tokenizer's ``save_pretrained``) go in beside the state;
        ``save_only_model`` writes the weights alone; ``saver`` writes it (``ckpt.sharded.Saver``: async, every
        rank of a sharded state; default: here and now)."""
        path, run = ckpt.checkpoint_path(self.root, int(state.step)), attrs.asdict(self.claim.run)
        saver = saver or Saver()
        if self.writer:  # the sidecar is the writer's (the other ranks of a sharded save write their shards)
            self.history.sync()  # the entries the sidecar's offset covers are on disk first
        metadata = {**(metadata or {}), "log": self.history.position() if self.writer else None}
        options: dict[str, Any] = dict(model=model, metadata=metadata, settings=self.settings, run=run)
        options.update(save_only_model=save_only_model, extra_files=extra_files)

        def committed(_: Path) -> None:  # once the checkpoint is complete
            policy.rotate(self.root, keep_total, keep=[path, *keep], run_id=run["id"])
            if isinstance(self.history, log_file.HistoryFile):
                self.history.checkpointed()  # an earlier run's history, kept until now, is no longer needed

        if not jit:
            return saver.save(state, path, on_commit=committed, **options)
        saver.wait()  # an async save in flight is complete (or raised) first
        if already_saved(path, run, int(state.step), save_only_model):
            return ckpt.mark_jit(path) if self.writer else path  # the same state is there, complete: mark it
        return saver.save(state, path, jit=True, wait=True, on_commit=committed, **options)


@contextlib.contextmanager
def open_run_dir(
    output_dir: str | os.PathLike,
    state: TrainState,
    *,
    resume: bool | str | os.PathLike | None = False,
    settings: Mapping[str, Any] | RunSettings | None = None,
    overwrite: bool = False,
    writer: bool = True,
) -> Iterator[RunDir]:
    """Claim ``output_dir`` for a run of ``state``'s model with ``settings`` (its identity: their values, or a
    ``RunSettings`` with what its fields declare, and the model's tensor names, shapes, dtypes); the lock is held
    until the block ends, also when it raises. ``resume=True``: this run's damaged checkpoints are set aside."""
    run_settings = settings if isinstance(settings, RunSettings) else RunSettings(dict(settings or {}))
    fingerprint = settings_fingerprint(run_settings, state.params, state.buffers)
    try:
        claim = run_dir.claim(
            output_dir, resume or None, run_settings, fingerprint, overwrite_output_dir=overwrite, writer=writer
        )
    except FileNotFoundError as e:
        lead = f"Can't find a valid checkpoint at {resume}"  # transformers.Trainer's words
        if resume is True:
            lead = f"No valid checkpoint found in output directory ({output_dir})"
        raise NoCheckpointError(f"{lead}: {e} (loop.run: resume=False starts afresh)") from None
    with claim:
        if resume is True and writer:  # held: a damaged one the run would save over is kept
            for path, why, meta in damaged_checkpoints(output_dir):
                if (meta.get("run") or {}).get("fingerprint") == claim.run.fingerprint:  # this run's, not another's
                    set_aside(path, why)
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        yield RunDir(Path(output_dir), claim, run_settings.values, writer=writer)


def load_newest(
    claim: Any, state: TrainState, *, check: Callable[[Mapping[str, Any], Any], None] | None = None, writer: bool = True
) -> tuple[TrainState, Any, dict[str, Any]]:
    """Return ``(state, source, meta)`` of the claimed checkpoint, loaded (its hashes checked).

    Under ``resume=True`` one that fails to load is set aside (``set_aside``, by the writer rank) and the next
    older one is tried; a named checkpoint is refused. ``check(meta, source)`` refuses another run's checkpoint
    (never set aside).
    """
    tried = [claim.source, *claim.fallback]
    for i, source in enumerate(tried):
        try:
            meta = ckpt.read_metadata(source)
        except (ckpt.CheckpointError, FileNotFoundError):
            meta = None  # the load names what is wrong
        if meta is not None and check is not None:  # a checkpoint of another run, or another model: refused
            check(meta, source)
        try:
            loaded = ckpt.load(source, like=state)
        except (ckpt.CheckpointError, FileNotFoundError) as e:
            if isinstance(e, ckpt.FrozenWeightsError) or not claim.fallback:
                raise  # the template's base weights, not the checkpoint, are wrong; or a path was named
            if writer:
                set_aside(source, e)
            if i == len(tried) - 1:
                raise ckpt.CheckpointError(
                    f"resume_from_checkpoint=True found no intact checkpoint of this run: each failed to load and "
                    f"was set aside as <name>.damaged ({', '.join(p.name for p in tried)}); the last: {e}; start "
                    "fresh with resume_from_checkpoint=None"
                ) from e
            continue
        return loaded, source, ckpt.read_metadata(source)
    raise AssertionError("unreachable")


def set_aside(path: str | os.PathLike, cause: BaseException | str) -> Path:
    """Rename the checkpoint ``path`` that failed to load to ``<name>.damaged`` (never deleted); warn naming both.

    ``list_checkpoints`` no longer sees it, so no later resume or rotation takes it; it stays for inspection.
    """
    path, n = Path(path), 1
    while (target := path.with_name(f"{path.name}.damaged" + (f"-{n}" if n > 1 else ""))).exists():
        n += 1
    os.replace(path, target)
    warnings.warn(
        f"resume_from_checkpoint=True set {path} aside as {target.name} (kept, not deleted): it failed to load: "
        f"{cause}; resuming from the previous complete checkpoint instead",
        CheckpointWarning,
        stacklevel=2,
    )
    return target


def already_saved(path: Path, run: Mapping[str, str] | None, step: int, save_only_model: bool) -> bool:
    """Say whether ``path`` is a complete checkpoint this run wrote at ``step`` (so the JIT save keeps it)."""
    if run is None or not ckpt.is_complete(path):
        return False
    meta = ckpt.read_metadata(path)
    return meta["run"] == dict(run) and meta["step"] == step and is_weights_only(meta) == save_only_model
