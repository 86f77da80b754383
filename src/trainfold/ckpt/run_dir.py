"""The output directory of a run: who may write there, which run it holds, what to resume.

- **Identity.** A run is defined by the settings that fix its trajectory (everything in
  ``TrainingArguments`` but logging, saving, evaluation, reporting and data-loader plumbing), the
  world size, and the model's parameter names, shapes and dtypes: their hash is the run's
  ``fingerprint``. Two processes with the same fingerprint are the same run; a restart after a
  preemption computes the same fingerprint and so finds its checkpoints. The run ``id`` names a
  lineage: it is drawn at a fresh start, inherited on resume, and recorded in every checkpoint's
  sidecar and in ``output_dir/trainfold-run.json``.
- **Lock.** ``claim`` takes an exclusive ``flock`` on ``output_dir/trainfold.lock`` for as long as
  the run writes; a second run is refused with the holder's pid and host. The kernel drops the
  lock of a dead process, so a killed run's lock is simply taken over (and said so).
- **Leftovers.** The run holding the lock removes the ``.tmp-*``, ``.old-*`` and ``.deleting-*``
  directories of dead writers, in one line on stderr.
- **Resume.** ``resumable`` returns the latest complete checkpoint of this run (same fingerprint,
  and the lineage recorded in the output_dir when there is one); checkpoints of other runs,
  symbolic links and directories whose name and step disagree are never taken.
- **Other runs.** A run into an output_dir holding another run's checkpoints is refused, naming
  the settings that differ, unless ``overwrite_output_dir=True`` (a directory holding only another
  run's log and run file, e.g. of a ``save_strategy="no"`` run, is taken over).

>>> fingerprint({"learning_rate": 0.1, "logging_steps": 5}) == fingerprint({"learning_rate": 0.1, "logging_steps": 1})
True
>>> trajectory_differences({"learning_rate": 0.1, "seed": 1}, {"learning_rate": 0.2, "seed": 1})
['learning_rate: 0.1 there, 0.2 here']
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from trainfold.ckpt import checkpoint as ckpt

__all__ = [
    "LOCK_FILE",
    "RUN_FILE",
    "NOT_TRAJECTORY",
    "RUN_LENGTH",
    "RunIdentity",
    "Claim",
    "trajectory_settings",
    "trajectory_differences",
    "fingerprint",
    "model_signature",
    "lock",
    "remove_leftovers",
    "read_run_file",
    "resumable",
    "claim",
    "already_saved",
    "check_step",
    "resume_point",
]

LOCK_FILE = "trainfold.lock"
RUN_FILE = "trainfold-run.json"

# Settings that do not change which states a run goes through: where and how often it logs, saves,
# evaluates and reports, and how the data loader is run. Everything else is in the fingerprint.
NOT_TRAJECTORY = frozenset(
    {
        "output_dir",
        "overwrite_output_dir",
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "logging_nan_inf_filter",
        "report_to",
        "run_name",
        "disable_tqdm",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "save_only_model",
        "enable_jit_checkpoint",
        "eval_strategy",
        "eval_steps",
        "eval_on_start",
        "async_save",
        "save_consolidated_model",
        "fsdp",  # sharded or replicated: the same samples, split otherwise
        "eval_delay",
        "eval_accumulation_steps",
        "per_device_eval_batch_size",
        "prediction_loss_only",
        "metric_for_best_model",
        "greater_is_better",
        "load_best_model_at_end",
        "dataloader_num_workers",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_pin_memory",
        # recomputing activations gives the same gradients bitwise (tests/test_recompute.py): turn it on to fit memory
        "activation_checkpointing",
        "activation_checkpointing_kwargs",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
    }
)

# How long the run goes on: not part of the fingerprint, so a run can be continued for more steps
# (HF's resume with a larger max_steps); a resume that changes it says that the schedule changes.
RUN_LENGTH = ("max_steps", "num_train_epochs")

_LEFTOVER = re.compile(r"^\.checkpoint-\d+\.(tmp|old|deleting)-(?:(\d+)-)?[0-9a-f]+$")
_FILE_LEFTOVER = re.compile(r"^\.(?:trainfold\.json|trainfold-run\.json)\.tmp-(\d+)(?:-[0-9a-f]+)?$")


def trajectory_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Return the settings that define the trajectory (all but ``NOT_TRAJECTORY`` and ``RUN_LENGTH``), by name.

    >>> trajectory_settings({"seed": 3, "save_steps": 10, "learning_rate": 0.1})
    {'learning_rate': 0.1, 'seed': 3}
    """
    return {k: settings[k] for k in sorted(settings) if k not in NOT_TRAJECTORY and k not in RUN_LENGTH}


def trajectory_differences(there: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    """List every trajectory setting whose value differs between two settings dicts."""
    a, b = trajectory_settings(there), trajectory_settings(here)
    return [
        f"{k}: {a.get(k, 'unset')!r} there, {b.get(k, 'unset')!r} here"
        for k in sorted(set(a) | set(b))
        if a.get(k, "unset") != b.get(k, "unset")
    ]


def model_signature(state: Any) -> dict[str, list[Any]]:
    """Return ``{name: [shape, dtype]}`` of a state's params and buffers (part of the fingerprint)."""
    tensors = {
        **{f"buffers.{k}": v for k, v in state.buffers.items()},
        **{f"params.{k}": v for k, v in state.params.items()},
    }
    return {k: [list(v.shape), str(v.dtype)] for k, v in sorted(tensors.items())}


def fingerprint(settings: Mapping[str, Any], model: Mapping[str, Any] | None = None) -> str:
    """Return the hash (16 hex digits) of the trajectory settings and the model signature.

    The batch enters as the global batch (``trainfold.ckpt.elastic``): a run resumed on another number
    of ranks with the same samples per step is the same run.
    """
    body = {"settings": _batch_as_global(trajectory_settings(settings)), "model": dict(model or {})}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _batch_as_global(settings: dict[str, Any]) -> dict[str, Any]:
    from trainfold.ckpt.elastic import BATCH_KEYS, global_batch  # noqa: PLC0415

    batch = global_batch(settings)
    if batch is None:
        return settings
    return {**{k: v for k, v in settings.items() if k not in BATCH_KEYS}, "global_train_batch_size": batch}


@attrs.frozen
class RunIdentity:
    """A run's lineage ``id`` and the ``fingerprint`` of its trajectory; ``as_dict`` goes into the sidecar.

    >>> RunIdentity("ab12", "f00d").as_dict()
    {'id': 'ab12', 'fingerprint': 'f00d'}
    """

    id: str
    fingerprint: str

    @classmethod
    def new(cls, fingerprint: str) -> RunIdentity:
        """Draw a fresh lineage id for a run with this fingerprint."""
        return cls(f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}", fingerprint)

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "fingerprint": self.fingerprint}


# -- the lock -------------------------------------------------------------------------------------------


def _holder_text() -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def lock(output_dir: str | os.PathLike) -> Iterator[dict[str, Any] | None]:
    """Hold an exclusive lock on ``output_dir`` while the block runs; yield the previous holder's record.

    A second holder is refused with ``RuntimeError`` naming the holder's pid and host. The lock
    of a dead process is gone with it (``flock``), and the yielded record is that process's.

    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> with lock(out):
    ...     try:
    ...         with lock(out):
    ...             pass
    ...     except RuntimeError as e:
    ...         print(str(e).split(" (")[0])
    ...
    another trainfold run is writing to this output_dir
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            raise RuntimeError(
                f"another trainfold run is writing to this output_dir (pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')}, lock {path}); wait for it to finish, or give this run another "
                "output_dir"
            ) from None
        previous = _read_holder(fd) or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_text().encode(), 0)
        os.fsync(fd)
        yield previous
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


# -- leftovers ------------------------------------------------------------------------------------------


def _size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def remove_leftovers(output_dir: str | os.PathLike, *, quiet: bool = False) -> list[Path]:
    """Remove the ``.tmp-*``, ``.old-*``, ``.deleting-*`` checkpoint directories of dead writers; return them.

    Call it holding ``lock(output_dir)``. A directory whose name carries the pid of a live process
    other than this one is left alone. Prints one line to stderr when it removed anything.

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> (out / ".checkpoint-4.tmp-999999999-ab12").mkdir()
    >>> [p.name for p in remove_leftovers(out, quiet=True)], list(out.iterdir())
    (['.checkpoint-4.tmp-999999999-ab12'], [])
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    gone, freed = [], 0
    candidates = [(p, _LEFTOVER.match(p.name)) for p in sorted(root.iterdir())]
    for sub in sorted(root.glob("checkpoint-*")) + [root]:  # a sidecar or run file rewrite cut short
        if sub.is_dir() and not sub.is_symlink():
            candidates += [(p, _FILE_LEFTOVER.match(p.name)) for p in sorted(sub.iterdir())]
    for path, m in candidates:
        if m is None or path.is_symlink():
            continue
        pid_text = m.group(2) if m.re is _LEFTOVER else m.group(1)
        pid = int(pid_text) if pid_text else None
        if pid is not None and (pid == os.getpid() or _alive(pid)):
            continue
        freed += _size(path) if path.is_dir() else path.stat().st_size
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        gone.append(path)
    if gone and not quiet:
        names = ", ".join(p.name for p in gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        print(
            f"trainfold: removed {len(gone)} leftover(s) of interrupted checkpoint writes in {root} "
            f"({freed / 1e6:.1f} MB): {names}",
            file=sys.stderr,
            flush=True,
        )
    return gone


# -- which run the output_dir holds ---------------------------------------------------------------------


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
        warnings.warn(f"ignoring {path}: not valid JSON ({e})", ckpt.CheckpointWarning, stacklevel=2)
        return None
    if not (
        isinstance(record, dict)
        and isinstance(record.get("run_id"), str)
        and isinstance(record.get("fingerprint"), str)
        and isinstance(record.get("settings"), dict)
    ):
        warnings.warn(
            f"ignoring {path}: it lacks run_id, fingerprint or settings", ckpt.CheckpointWarning, stacklevel=2
        )
        return None
    return record


def _write_run_file(output_dir: Path, run: RunIdentity, settings: Mapping[str, Any]) -> None:
    record = {
        "format": "trainfold-run",
        "run_id": run.id,
        "fingerprint": run.fingerprint,
        "settings": trajectory_settings(settings),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    tmp = output_dir / f".{RUN_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2, default=repr) + "\n")
    os.replace(tmp, output_dir / RUN_FILE)


def _run_of(path: Path) -> dict[str, str] | None:
    try:
        return ckpt.read_metadata(path).get("run")
    except (OSError, ValueError):
        return None


def _catalog(output_dir: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """Return ``(path, sidecar)`` of each complete checkpoint in ``output_dir``, oldest first."""
    out = []
    for path in ckpt.list_checkpoints(output_dir):
        with contextlib.suppress(OSError, ValueError):
            out.append((path, ckpt.read_metadata(path)))
    return out


def resumable(output_dir: str | os.PathLike, fingerprint: str) -> Path | None:
    """Return the latest complete checkpoint in ``output_dir`` of the run with ``fingerprint``, or None.

    When ``output_dir/trainfold-run.json`` records a run with this fingerprint, its lineage (its
    run id) comes first: a fresh start of the same settings resumes its own checkpoints, not an
    older lineage's later ones (an older lineage's are taken only when it has none).
    This is what ``resume_from_checkpoint=True`` (and the CLI's ``--resume``) takes.

    >>> resumable("no/such/dir", "f00d") is None
    True
    """
    found = [(p, m) for p, m in _catalog(output_dir) if (m.get("run") or {}).get("fingerprint") == fingerprint]
    recorded = read_run_file(output_dir)
    if recorded is not None and recorded["fingerprint"] == fingerprint:
        own = [(p, m) for p, m in found if m["run"]["id"] == recorded["run_id"]]
        found = own or found  # a lineage killed before its first save: the same settings' latest
    return found[-1][0] if found else None


def _describe_others(output_dir: Path, settings: Mapping[str, Any], fingerprint: str) -> str:
    parts = []
    for path, meta in _catalog(output_dir):
        run = meta.get("run")
        if run is None:
            parts.append(f"{path.name} (written without a run identity)")
        elif run["fingerprint"] != fingerprint:
            diffs = trajectory_differences(meta.get("settings", {}), settings) or ["the model's parameters differ"]
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


def _explicit_source(path: Path, settings: Mapping[str, Any], fp: str) -> tuple[Path, RunIdentity]:
    from trainfold.ckpt.policy import check_compatible

    source = ckpt.resume_checkpoint(path, path.parent)
    assert source is not None
    meta = ckpt.read_metadata(source)
    check_compatible(meta["settings"], settings, source=source)  # the sample order cannot change at all
    run = meta.get("run")
    if run is not None and run["fingerprint"] == fp:
        return source, RunIdentity(run["id"], fp)
    diffs = trajectory_differences(meta["settings"], settings) or ["the model's parameters or the run identity"]
    warnings.warn(
        f"resuming {source} with different settings ({'; '.join(diffs)}): this continues as a new run, "
        "not the one that wrote the checkpoint",
        UserWarning,
        stacklevel=3,
    )
    return source, RunIdentity.new(fp)


def claim(
    output_dir: str | os.PathLike,
    resume_from_checkpoint: bool | str | os.PathLike | None,
    settings: Mapping[str, Any],
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
    root = Path(output_dir)
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
            source = resumable(root, fingerprint)
            if source is None:
                others = _catalog(root)
                raise (ValueError if others else FileNotFoundError)(
                    f"resume_from_checkpoint=True but {root} holds no complete checkpoint of this run "
                    f"(fingerprint {fingerprint}); found: {_describe_others(root, settings, fingerprint)}; resume "
                    "with the settings that wrote them, pass a checkpoint path, or resume_from_checkpoint=None "
                    "to start fresh"
                )
            run = RunIdentity(ckpt.read_metadata(source)["run"]["id"], fingerprint)
        elif resume_from_checkpoint is None or resume_from_checkpoint is False:
            source, run = None, RunIdentity.new(fingerprint)
        else:
            source, run = _explicit_source(Path(resume_from_checkpoint), settings, fingerprint)
        if source is not None:
            _warn_length(source, settings)
        if writer and not overwrite_output_dir:
            _refuse_other_runs(root, recorded, settings, fingerprint)
        if writer:
            _write_run_file(root, run, settings)
    except BaseException:
        stack.close()
        raise
    return Claim(run, source, stack)


def _warn_length(source: Path, settings: Mapping[str, Any]) -> None:
    saved = ckpt.read_metadata(source)["settings"]
    changed = [
        f"{k} {saved[k]!r} -> {settings[k]!r}"
        for k in RUN_LENGTH
        if k in saved and k in settings and saved[k] != settings[k]
    ]
    if changed:
        warnings.warn(
            f"resuming {source} with {', '.join(changed)}: the run goes on for a different number of steps, "
            "so a schedule that depends on the total (linear, cosine, ...) differs from the saved run's",
            UserWarning,
            stacklevel=3,
        )


def _refuse_other_runs(
    root: Path, recorded: Mapping[str, Any] | None, settings: Mapping[str, Any], fingerprint: str
) -> None:
    """Refuse a run into a directory holding checkpoints of another run (a run file alone is taken over)."""
    if recorded is not None and recorded["fingerprint"] == fingerprint:
        return  # this run was let in before (overwrite_output_dir), and goes on
    foreign = [p for p, m in _catalog(root) if (m.get("run") or {}).get("fingerprint") != fingerprint]
    if not foreign:
        return
    owner = f" (its run file names run {recorded['run_id']})" if recorded is not None else ""
    raise ValueError(
        f"{root} holds checkpoints of another run{owner}: {_describe_others(root, settings, fingerprint)}; pass "
        "overwrite_output_dir=True to write this run there anyway, resume that run with its own settings, or "
        "choose another output_dir"
    )


def already_saved(path: str | os.PathLike, run: Mapping[str, str] | None, step: int, save_only_model: bool) -> bool:
    """Say whether ``path`` is a complete checkpoint this run wrote at ``step`` (so a JIT save may keep it).

    >>> already_saved("no/such/checkpoint-3", {"id": "a", "fingerprint": "b"}, 3, False)
    False
    """
    if run is None or not ckpt.is_complete(path):
        return False
    try:
        meta = ckpt.read_metadata(path)
    except (OSError, ValueError):
        return False
    return meta.get("run") == dict(run) and meta["step"] == step and meta["save_only_model"] == save_only_model


def check_step(meta: Mapping[str, Any], source: str | os.PathLike, total_steps: int) -> None:
    """Refuse a checkpoint whose step lies beyond the run's ``total_steps``, naming the path and field.

    >>> check_step({"step": 10**15}, "out/checkpoint-9", 100)
    Traceback (most recent call last):
    ...
    trainfold.ckpt.checkpoint.CheckpointError: out/checkpoint-9/trainfold.json: field 'step' is 1000000000000000, beyond this run's 100 steps (max_steps / num_train_epochs); it is not a checkpoint of this run: resume from another checkpoint, or raise max_steps
    """
    if meta["step"] > total_steps:
        raise ckpt.CheckpointError(
            f"{Path(source) / ckpt.SIDECAR_FILE}: field 'step' is {meta['step']}, beyond this run's {total_steps} "
            "steps (max_steps / num_train_epochs); it is not a checkpoint of this run: resume from another "
            "checkpoint, or raise max_steps"
        )


def resume_point(args: Any, model: Any, *, world_size: int = 1) -> Path | None:
    """Return the checkpoint ``train(model, args, ..., resume_from_checkpoint=True)`` would resume, or None.

    For a command line's ``--resume``: it computes the run's fingerprint as ``train`` does (the
    settings, the world size, the model's parameter shapes) and calls ``resumable``.
    """
    import types  # noqa: PLC0415

    from trainfold.core.state import split_module  # noqa: PLC0415

    params, buffers = split_module(model)
    settings = {**args.to_dict(), "world_size": world_size}
    signature = model_signature(types.SimpleNamespace(params=params, buffers=buffers))
    return resumable(args.output_dir, fingerprint(settings, signature))
