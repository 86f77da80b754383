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
from trainfold.ckpt.run_identity import RunSettings, settings_fingerprint
from trainfold.ckpt.sidecar import CheckpointWarning
from trainfold.core.state import TrainState
from trainfold.observe import history as log_file

__all__ = ["RunDir", "open_run_dir", "load_newest", "set_aside", "already_saved"]


@attrs.define(eq=False)
class RunDir:
    """A claimed run directory: the claim (lock, identity, what to resume), its settings and its log history."""

    root: Path
    claim: run_dir.Claim
    settings: dict[str, Any]
    history: Any = None  # a history.HistoryFile once started

    def start(
        self, state: TrainState, check: Callable[[Mapping[str, Any], Any], None] | None = None
    ) -> tuple[TrainState, Path | None]:
        """Return ``(state, source)``: ``state`` loaded from the newest intact checkpoint on a resume (``check``
        judges each candidate's sidecar first), else as given; continue or begin the log history."""
        source, meta = None, None
        if self.claim.source is not None:
            state, source, meta = load_newest(self.claim, state, check=check)
        self.history = log_file.start(self.root, source, meta["metadata"] if meta is not None else None, writer=True)
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
    ) -> Path:
        """Write ``state`` as ``checkpoint-{step}`` (atomic, hashed); then keep ``keep_total`` of this run's
        (never the newest, one in ``keep``, or a JIT one); ``jit``: the preemption checkpoint, never rotated."""
        path, run = ckpt.checkpoint_path(self.root, int(state.step)), attrs.asdict(self.claim.run)
        self.history.sync()  # the entries the sidecar's offset covers are on disk first
        metadata = {**(metadata or {}), "log": self.history.position()}
        if jit and already_saved(path, run, int(state.step), False):
            return ckpt.mark_jit(path)  # the same state is there, complete: mark it
        ckpt.save(state, path, model=model, metadata=metadata, settings=self.settings, run=run, jit=jit)
        if not jit:
            policy.rotate(self.root, keep_total, keep=[path, *keep], run_id=run["id"])
        return path


@contextlib.contextmanager
def open_run_dir(
    output_dir: str | os.PathLike,
    state: TrainState,
    *,
    resume: bool | str | os.PathLike = False,
    settings: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Iterator[RunDir]:
    """Claim ``output_dir`` for a run of ``state``'s model with ``settings`` (its identity: their values and the
    model's tensor names, shapes, dtypes); the lock is held until the block ends, also when it raises."""
    values = dict(settings or {})
    run_settings = RunSettings(values)
    fingerprint = settings_fingerprint(run_settings, state.params, state.buffers)
    try:
        claim = run_dir.claim(output_dir, resume or None, run_settings, fingerprint, overwrite_output_dir=overwrite)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"resume={resume!r} but {output_dir} holds no checkpoint to resume: {e}; run with resume=False to start"
        ) from None
    with claim:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        yield RunDir(Path(output_dir), claim, values)


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
    return meta["run"] == dict(run) and meta["step"] == step and meta["save_only_model"] == save_only_model
