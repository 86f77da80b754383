"""The output directory of a run: which run it holds, what to resume, and the claim that takes it.

``claim`` takes the lock and removes leftovers (``run_lock``), decides what to resume (``resumable``:
the latest complete checkpoint of this run's fingerprint and lineage; never another run's, a symbolic
link, or one whose name and step disagree), refuses a fresh start among another run's checkpoints
naming the settings that differ (unless ``overwrite_output_dir``), and records the run in
``trainfold-run.json``. ``elastic_args`` keeps a resumed run's global batch on another number of ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import types
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from trainfold.ckpt.listing import is_complete, list_checkpoints, resume_checkpoint
from trainfold.ckpt.policy import check_compatible
from trainfold.ckpt.run_identity import RUN_FILE, RunIdentity, RunSettings, model_signature, settings_fingerprint
from trainfold.ckpt.run_lock import lock, remove_leftovers
from trainfold.ckpt.sidecar import SIDECAR_FILE, CheckpointError, CheckpointWarning, read_metadata
from trainfold.ckpt.writer import disk_full, is_disk_full
from trainfold.core.state import split_module
from trainfold.data.global_batch import BATCH_KEYS, global_batch, split_global_batch

__all__ = [
    "Claim",
    "read_run_file",
    "resumable",
    "candidates",
    "claim",
    "already_saved",
    "check_step",
    "resume_point",
    "elastic_args",
]


def read_run_file(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Return ``output_dir/trainfold-run.json`` (``run_id``, ``fingerprint``, ``settings``), or None.

    A malformed file is reported with a warning and treated as absent.
    """
    path = Path(output_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring {path}: not valid JSON ({e})", CheckpointWarning, stacklevel=2)
        return None
    if not (
        isinstance(record, dict)
        and isinstance(record.get("run_id"), str)
        and isinstance(record.get("fingerprint"), str)
        and isinstance(record.get("settings"), dict)
    ):
        warnings.warn(f"ignoring {path}: it lacks run_id, fingerprint or settings", CheckpointWarning, stacklevel=2)
        return None
    return record


def _write_run_file(output_dir: Path, run: RunIdentity, settings: RunSettings) -> None:
    record = {
        "format": "trainfold-run",
        "run_id": run.id,
        "fingerprint": run.fingerprint,
        "settings": settings.trajectory(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    tmp = output_dir / f".{RUN_FILE}.tmp-{os.getpid()}"
    text = json.dumps(record, indent=2, default=repr) + "\n"
    try:
        tmp.write_text(text)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if not is_disk_full(e):
            raise
        raise disk_full(
            e, output_dir / RUN_FILE, f"the run file {output_dir / RUN_FILE} could not be written", len(text)
        ) from e
    os.replace(tmp, output_dir / RUN_FILE)


def _catalog(output_dir: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """Return ``(path, sidecar)`` of each complete checkpoint in ``output_dir``, oldest first."""
    out = []
    for path in list_checkpoints(output_dir):
        with contextlib.suppress(OSError, ValueError):
            out.append((path, read_metadata(path)))
    return out


def resumable(output_dir: str | os.PathLike, fingerprint: str) -> Path | None:
    """Return the latest complete checkpoint in ``output_dir`` of the run with ``fingerprint``, or None.

    When ``output_dir/trainfold-run.json`` records a run with this fingerprint, its lineage (its
    run id) comes first: a fresh start of the same settings resumes its own checkpoints, not an
    older lineage's later ones (an older lineage's are taken only when it has none).
    This is what ``resume_from_checkpoint=True`` (and the CLI's ``--resume``) takes; if it fails to
    load, the resume sets it aside and takes the previous one (``candidates``, ``listing.set_aside``).

    >>> resumable("no/such/dir", "f00d") is None
    True
    """
    found = candidates(output_dir, fingerprint)
    return found[0] if found else None


def candidates(output_dir: str | os.PathLike, fingerprint: str) -> list[Path]:
    """Return the complete checkpoints of the run with ``fingerprint`` a resume may take, newest first."""
    found = [(p, m) for p, m in _catalog(output_dir) if (m.get("run") or {}).get("fingerprint") == fingerprint]
    recorded = read_run_file(output_dir)
    if recorded is not None and recorded["fingerprint"] == fingerprint:
        own = [(p, m) for p, m in found if m["run"]["id"] == recorded["run_id"]]
        found = own or found  # a lineage killed before its first save: the same settings' latest
    return [p for p, _ in reversed(found)]


def _describe_others(output_dir: Path, settings: RunSettings, fingerprint: str) -> str:
    parts = []
    for path, meta in _catalog(output_dir):
        run = meta.get("run")
        if run is None:
            parts.append(f"{path.name} (written without a run identity)")
        elif run["fingerprint"] != fingerprint:
            diffs = settings.differences(meta.get("settings", {})) or ["the model's parameters differ"]
            parts.append(f"{path.name} (run {run['id']}: {'; '.join(diffs[:4])})")
        else:
            parts.append(f"{path.name} (an earlier lineage {run['id']} of the same settings)")
    return ", ".join(parts[-4:]) or "no complete checkpoint"


# -- the claim ------------------------------------------------------------------------------------------


@attrs.define
class Claim:
    """What ``claim`` decided: the run's identity, the checkpoint to resume (or None), the held lock."""

    run: RunIdentity
    source: Path | None
    _stack: contextlib.ExitStack | None = None
    fallback: list[Path] = attrs.Factory(list)  # older checkpoints of the run, newest first (resume=True only)

    def on_release(self, fn: Any) -> None:
        """Call ``fn()`` when the claim is released (e.g. close the history file)."""
        if self._stack is not None:
            self._stack.callback(fn)

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    @contextlib.contextmanager
    def releasing_on_error(self) -> Iterator[Claim]:
        """Release the lock if the block raises (the run never started)."""
        try:
            yield self
        except BaseException:
            self.release()
            raise

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _explicit_source(path: Path, settings: RunSettings, fp: str) -> tuple[Path, RunIdentity]:
    source = resume_checkpoint(path, path.parent)
    assert source is not None
    meta = read_metadata(source)
    check_compatible(meta["settings"], settings, source=source)  # the sample order cannot change at all
    run = meta.get("run")
    if run is not None and run["fingerprint"] == fp:
        return source, RunIdentity(run["id"], fp)
    diffs = settings.differences(meta["settings"]) or ["the model's parameters or the run identity"]
    warnings.warn(
        f"resuming {source} with different settings ({'; '.join(diffs)}): this continues as a new run, "
        "not the one that wrote the checkpoint",
        UserWarning,
        stacklevel=3,
    )
    return source, RunIdentity.new(fp)


def _output_dir(output_dir: str | os.PathLike) -> Path:
    if not str(output_dir).strip():
        raise ValueError(
            f"output_dir={output_dir!r} names no directory (the checkpoints, run file and log history would land in "
            "the current directory); pass a directory, e.g. output_dir='out' (use '.' to mean the current one)"
        )
    return Path(output_dir)


def claim(
    output_dir: str | os.PathLike,
    resume_from_checkpoint: bool | str | os.PathLike | None,
    settings: RunSettings,
    fingerprint: str,
    *,
    overwrite_output_dir: bool = False,
    writer: bool = True,
) -> Claim:
    """Take ``output_dir`` for a run: lock it, clean it, decide what to resume, record the run.

    ``writer=False`` (ranks other than 0) only decides what to resume. Raises when another run
    holds the lock, when ``resume_from_checkpoint=True`` finds no checkpoint of this run (naming
    what it skipped), or when a fresh start would mix with another run's checkpoints and
    ``overwrite_output_dir`` is False. Use the returned ``Claim`` as a context manager: leaving
    it releases the lock.
    """
    root = _output_dir(output_dir)
    stack = contextlib.ExitStack()
    try:
        if writer:
            previous = stack.enter_context(lock(root))
            if previous and previous.get("pid") != os.getpid():
                print(
                    f"trainfold: took over the lock of {root} left by pid {previous.get('pid')} on host "
                    f"{previous.get('host')} (no longer running)",
                    file=sys.stderr,
                    flush=True,
                )
            remove_leftovers(root)
        recorded = read_run_file(root)
        if resume_from_checkpoint is True:
            found = candidates(root, fingerprint)
            source, fallback = (found[0], found[1:]) if found else (None, [])
            if source is None:
                others = _catalog(root)
                raise (ValueError if others else FileNotFoundError)(
                    f"resume_from_checkpoint=True but {root} holds no complete checkpoint of this run "
                    f"(fingerprint {fingerprint}); found: {_describe_others(root, settings, fingerprint)}; resume "
                    "with the settings that wrote them, pass a checkpoint path, or resume_from_checkpoint=None "
                    "to start fresh"
                )
            run = RunIdentity(read_metadata(source)["run"]["id"], fingerprint)
        elif resume_from_checkpoint is None or resume_from_checkpoint is False:
            source, run, fallback = None, RunIdentity.new(fingerprint, shared=True), []
        else:
            source, run = _explicit_source(Path(resume_from_checkpoint), settings, fingerprint)
            fallback = []
        if source is not None:
            _warn_length(source, settings)
        if writer and not overwrite_output_dir:
            _refuse_other_runs(root, recorded, settings, fingerprint)
        if writer:
            _write_run_file(root, run, settings)
    except BaseException:
        stack.close()
        raise
    return Claim(run, source, stack, fallback=fallback)


def _warn_length(source: Path, settings: RunSettings) -> None:
    saved = read_metadata(source)["settings"]
    changed = [
        f"{k} {saved[k]!r} -> {settings.values[k]!r}"
        for k in settings.length
        if k in saved and k in settings.values and saved[k] != settings.values[k]
    ]
    if changed:
        warnings.warn(
            f"resuming {source} with {', '.join(changed)}: the run goes on for a different number of steps, "
            "so a schedule that depends on the total (linear, cosine, ...) differs from the saved run's",
            UserWarning,
            stacklevel=3,
        )


def _refuse_other_runs(root: Path, recorded: Mapping[str, Any] | None, settings: RunSettings, fingerprint: str) -> None:
    """Refuse a run into a directory holding checkpoints of another run (a run file alone is taken over)."""
    if recorded is not None and recorded["fingerprint"] == fingerprint:
        return  # this run was let in before (overwrite_output_dir), and goes on
    foreign = [p for p, m in _catalog(root) if (m.get("run") or {}).get("fingerprint") != fingerprint]
    if not foreign:
        return
    owner = f" (its run file names run {recorded['run_id']})" if recorded is not None else ""
    raise ValueError(
        f"{root} holds checkpoints of another run{owner}: {_describe_others(root, settings, fingerprint)}; "
        "choose another output_dir, resume that run with its own settings, or write this run there anyway with "
        "trainfold's overwrite_output_dir=True (args.replace(overwrite_output_dir=True), or "
        "TrainingArguments.from_hf(hf_args, overwrite_output_dir=True): transformers 5 has no such setting)"
    )


def already_saved(path: str | os.PathLike, run: Mapping[str, str] | None, step: int, save_only_model: bool) -> bool:
    """Say whether ``path`` is a complete checkpoint this run wrote at ``step`` (so a JIT save may keep it).

    >>> already_saved("no/such/checkpoint-3", {"id": "a", "fingerprint": "b"}, 3, False)
    False
    """
    if run is None or not is_complete(path):
        return False
    try:
        meta = read_metadata(path)
    except (OSError, ValueError):
        return False
    return meta.get("run") == dict(run) and meta["step"] == step and meta["save_only_model"] == save_only_model


def check_step(meta: Mapping[str, Any], source: str | os.PathLike, total_steps: int) -> None:
    """Refuse a checkpoint whose step lies beyond the run's ``total_steps``, naming the path and field.

    >>> check_step({"step": 10**15}, "out/checkpoint-9", 100)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    trainfold.ckpt.sidecar.CheckpointError: out/checkpoint-9/trainfold.json: field 'step' is 1000000000000000, beyond
    this run's 100 steps (max_steps / num_train_epochs); it is not a checkpoint of this run: resume from another
    checkpoint, or raise max_steps
    """
    if meta["step"] > total_steps:
        raise CheckpointError(
            f"{Path(source) / SIDECAR_FILE}: field 'step' is {meta['step']}, beyond this run's {total_steps} "
            "steps (max_steps / num_train_epochs); it is not a checkpoint of this run: resume from another "
            "checkpoint, or raise max_steps"
        )


def resume_point(args: Any, model: Any, *, world_size: int = 1) -> Path | None:
    """Return the checkpoint ``train(model, args, ..., resume_from_checkpoint=True)`` would resume, or None.

    For a command line's ``--resume``: it computes the run's fingerprint as ``train`` does (the
    settings, the world size, the model's parameter shapes) and calls ``resumable``.
    """
    params, buffers = split_module(model)
    signature = model_signature(types.SimpleNamespace(params=params, buffers=buffers))
    return resumable(args.output_dir, settings_fingerprint(RunSettings.of(args, world_size=world_size), signature))


def _saved_settings(
    resume_from_checkpoint: Any, output_dir: str | os.PathLike, here: RunSettings
) -> Mapping[str, Any] | None:
    if resume_from_checkpoint is True:  # the newest checkpoint of this run but for the batch split: claim resumes it
        for _, meta in reversed(_catalog(output_dir)):
            if not [d for d in here.differences(meta["settings"]) if d.split(":")[0] not in BATCH_KEYS]:
                return meta["settings"]
        return None
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    try:
        return read_metadata(Path(resume_from_checkpoint))["settings"]
    except (OSError, ValueError):
        return None  # claim names what is wrong with it


def elastic_args(args: Any, resume_from_checkpoint: Any, world_size: int) -> Any:
    """Return ``args`` with the batch split that keeps the resumed run's global batch on ``world_size`` ranks.

    The split is read from the checkpoint the resume takes (never from ``trainfold-run.json``, which
    each start rewrites). Unchanged when not resuming, when the checkpoint was written on as many
    ranks, or when ``args`` already make its global batch; otherwise ``per_device_train_batch_size`` and
    ``gradient_accumulation_steps`` follow ``split_global_batch``, with a warning that says so.
    """
    here = RunSettings.of(args, world_size=world_size)
    saved = _saved_settings(resume_from_checkpoint, args.output_dir, here)
    batch = global_batch(saved or {})
    if saved is None or batch is None or saved["world_size"] == world_size or batch == global_batch(here.values):
        return args
    if [d for d in here.differences(saved) if d.split(":")[0] in set(saved) - set(BATCH_KEYS)]:
        return args  # another run's settings: claim refuses it, naming them
    size, steps = split_global_batch(batch, world_size=world_size, per_device=args.per_device_train_batch_size)
    warnings.warn(
        f"resuming a run of {saved['world_size']} ranks on {world_size}: per_device_train_batch_size "
        f"{args.per_device_train_batch_size} -> {size}, gradient_accumulation_steps {args.gradient_accumulation_steps} "
        f"-> {steps} keep its global batch of {batch} samples per step (trainfold.data.global_batch)",
        UserWarning,
        stacklevel=3,
    )
    return args.replace(per_device_train_batch_size=size, gradient_accumulation_steps=steps)
