"""The output directory of a run: which run it holds, what to resume, and the claim that takes it.

``claim`` takes the lock, removes leftovers (``run_lock``), picks what to resume (``candidates``), refuses a start
among another run's (or an earlier format's) checkpoints naming the differing settings (unless
``overwrite_output_dir``) and records the run in ``trainfold-run.json``."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from trainfold.ckpt.listing import catalog, resume_checkpoint
from trainfold.ckpt.policy import check_compatible
from trainfold.ckpt.run_identity import RUN_FILE, RunIdentity, RunSettings
from trainfold.ckpt.run_lock import lock, read_record, remove_leftovers
from trainfold.ckpt.sidecar import CheckpointWarning, OldFormatError, read_metadata
from trainfold.ckpt.writer import disk_full, is_disk_full

__all__ = ["Claim", "candidates", "claim"]


def _recorded(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Return ``trainfold-run.json`` (``run_id``, ``fingerprint``, ``settings``), or None (warned if malformed)."""
    path = Path(output_dir) / RUN_FILE
    record = read_record(path)
    if all(isinstance(record.get(k), str) for k in ("run_id", "fingerprint")):
        return record
    if path.exists():
        warnings.warn(f"ignoring {path}: it is not JSON with a run_id and a fingerprint", CheckpointWarning, 2)
    return None


def _write_run_file(output_dir: Path, run: RunIdentity, settings: RunSettings) -> None:
    record = dict(format="trainfold-run", run_id=run.id, fingerprint=run.fingerprint, settings=settings.trajectory())
    tmp, path = output_dir / f".{RUN_FILE}.tmp-{os.getpid()}", output_dir / RUN_FILE
    text = json.dumps(record, indent=2, default=repr) + "\n"
    try:
        tmp.write_text(text)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full(e, path, f"the run file {path} could not be written", len(text)) from e
        raise
    os.replace(tmp, path)


def _fingerprint(meta: Mapping[str, Any]) -> str | None:
    return (meta["run"] or {}).get("fingerprint")


def candidates(output_dir: str | os.PathLike, fingerprint: str) -> list[Path]:
    """Return the complete checkpoints of the run with ``fingerprint`` a resume may take, newest first: those of
    the lineage ``trainfold-run.json`` records first (a fresh start of the same settings resumes its own).
    ``resume_from_checkpoint=True`` takes the first, and falls back on the others in turn if it cannot load it.

    >>> candidates("no/such/dir", "f00d")
    []
    """
    lineage = (_recorded(output_dir) or {}).get("run_id")  # a lineage id has one fingerprint
    found = [(p, m["run"]["id"]) for p, m in reversed(catalog(output_dir)) if _fingerprint(m) == fingerprint]
    return [p for p, i in found if i == lineage] or [p for p, _ in found]


def _describe(catalog: list[tuple[Path, dict[str, Any]]], settings: RunSettings, fingerprint: str) -> str:
    """Say whose each of the last four checkpoints of ``catalog`` is, and the settings that differ from these."""
    parts = []
    for path, meta in catalog[-4:]:
        run = meta["run"]
        if run is None:
            parts.append(f"{path.name} (written without a run identity)")
        elif run["fingerprint"] == fingerprint:
            parts.append(f"{path.name} (an earlier lineage {run['id']} of the same settings)")
        else:
            diffs = settings.differences(meta["settings"]) or ["the model's parameters differ"]
            parts.append(f"{path.name} (run {run['id']}: {'; '.join(diffs[:4])})")
    return ", ".join(parts) or "no complete checkpoint"


class Claim(contextlib.ExitStack):
    """What ``claim`` decided: the run's identity, the checkpoint to resume (or None) and, under
    ``resume_from_checkpoint=True``, older ones to fall back on; leaving it releases the lock (and ``callback``s)."""

    run: RunIdentity
    source: Path | None = None
    fallback: tuple[Path, ...] = ()


def _source(
    root: Path, resume: bool | str | os.PathLike | None, settings: RunSettings, fp: str
) -> tuple[Path | None, tuple[Path, ...], RunIdentity]:
    """Return the checkpoint to resume, the older ones to fall back on, and the run's identity."""
    if resume is None or resume is False:
        return None, (), RunIdentity.new(fp)
    found = candidates(root, fp) if resume is True else [cast(Path, resume_checkpoint(resume, root))]  # or refused
    if not found:
        others = catalog(root)
        raise (ValueError if others else FileNotFoundError)(
            f"resume_from_checkpoint=True but {root} holds no complete checkpoint of this run (fingerprint "
            f"{fp}); found: {_describe(others, settings, fp)}; resume with the settings that wrote them, "
            "pass a checkpoint path, or resume_from_checkpoint=None to start fresh"
        )
    source, meta, here = found[0], read_metadata(found[0]), settings.values
    saved = meta["settings"]
    check_compatible(saved, settings, source=source)  # the sample order cannot change at all
    if changed := [f"{k} {saved[k]!r} -> {here[k]!r}" for k in settings.length if saved.get(k, here[k]) != here[k]]:
        warnings.warn(
            f"resuming {source} with {', '.join(changed)}: the run goes on for a different number of steps, "
            "so a schedule that depends on the total (linear, cosine, ...) differs from the saved run's",
            stacklevel=3,
        )
    if _fingerprint(meta) == fp:
        return source, tuple(found[1:]), RunIdentity(meta["run"]["id"], fp)
    diffs = settings.differences(saved) or ["the model's parameters or the run identity"]
    warnings.warn(
        f"resuming {source} with different settings ({'; '.join(diffs)}): this continues as a new run, "
        "not the one that wrote the checkpoint",
        stacklevel=3,
    )
    return source, (), RunIdentity.new(fp)


def claim(
    output_dir: str | os.PathLike,
    resume_from_checkpoint: bool | str | os.PathLike | None,
    settings: RunSettings,
    fingerprint: str,
    *,
    overwrite_output_dir: bool = False,
    writer: bool = True,
) -> Claim:
    """Take ``output_dir`` for a run (the module's docstring says how); leaving the ``Claim`` releases the lock.

    ``writer=False`` (ranks other than 0) only decides what to resume.
    """
    if not str(output_dir).strip():
        raise ValueError(
            f"output_dir={output_dir!r} names no directory (the checkpoints, run file and log history would land in "
            "the current directory); pass a directory, e.g. output_dir='out' (use '.' to mean the current one)"
        )
    root, held = Path(output_dir), Claim()
    try:
        if writer:
            held.enter_context(lock(root))
            remove_leftovers(root)
        held.source, held.fallback, held.run = _source(root, resume_from_checkpoint, settings, fingerprint)
        if writer and not overwrite_output_dir:
            _refuse_other_runs(root, settings, fingerprint)
        if writer:
            _write_run_file(root, held.run, settings)
    except BaseException:
        held.close()  # the run never started: the lock is released
        raise
    return held


def _refuse_other_runs(root: Path, settings: RunSettings, fingerprint: str) -> None:
    """Refuse a run into a directory holding checkpoints of another run (a run file alone is taken over)."""
    if (recorded := _recorded(root)) is not None and recorded["fingerprint"] == fingerprint:
        return  # this run was let in before (overwrite_output_dir), and goes on
    complete, older = catalog(root), []
    for path in sorted(root.glob("checkpoint-*")):  # an earlier format's: list_checkpoints skips it, not this run's
        try:
            read_metadata(path)
        except OldFormatError:
            older.append(f"{path.name} (an earlier checkpoint format, another trainfold release's)")
        except (OSError, ValueError):
            pass
    if all(_fingerprint(m) == fingerprint for _, m in complete) and not older:
        return
    owner = f" (its run file names run {recorded['run_id']})" if recorded is not None else ""
    found = ", ".join([*older, _describe(complete, settings, fingerprint)] if complete else older)
    raise ValueError(
        f"{root} holds checkpoints of another run{owner}: {found}; "
        "choose another output_dir, resume that run with its own settings, or write this run there anyway with "
        "trainfold's overwrite_output_dir=True (args.replace(overwrite_output_dir=True), or "
        "TrainingArguments.from_hf(hf_args, overwrite_output_dir=True): transformers 5 has no such setting)"
    )
