"""Finding checkpoints: their names, which ones are complete (each sidecar read once), the latest, the one to resume."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from trainfold.ckpt.sidecar import CheckpointError, CheckpointWarning, check_name, read_metadata, step_in_name

__all__ = [
    "checkpoint_path",
    "is_complete",
    "catalog",
    "damaged_checkpoints",
    "list_checkpoints",
    "latest_checkpoint",
    "resume_checkpoint",
]


def checkpoint_path(output_dir: str | os.PathLike, step: int) -> Path:
    """Return ``output_dir/checkpoint-{step}``.

    >>> checkpoint_path("out", 12).as_posix()
    'out/checkpoint-12'
    """
    return Path(output_dir) / f"checkpoint-{int(step)}"


def _examine(directory: Path) -> dict[str, Any] | str:
    """Return the sidecar of the complete checkpoint ``directory``, or say why it is not a usable one."""
    if directory.is_symlink():
        return f"it is a symbolic link (to {os.path.realpath(directory)}); checkpoints must lie in the output_dir"
    try:
        check_name(directory, meta := read_metadata(directory))
    except (OSError, ValueError) as e:
        return str(e)
    for name, entry in meta["files"].items():  # sizes only: loading checks the hashes
        path = directory / name
        if path.is_symlink() or not path.is_file():
            return f"{path} is missing or not a plain file"
        if path.stat().st_size != entry["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, trainfold.json records {entry['bytes']}"
    return meta


def is_complete(directory: str | os.PathLike) -> bool:
    """Say whether ``directory`` is a finished checkpoint: no marker, a valid sidecar, every file at its size,
    step ``n`` if it is named ``checkpoint-{n}``, and no symbolic link.

    >>> is_complete("no/such/dir")
    False
    """
    return not isinstance(_examine(Path(directory)), str)


def catalog(output_dir: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """Return ``(path, sidecar)`` of each complete ``checkpoint-{step}`` directory in ``output_dir``, oldest step first.

    Never raises: a directory named like one that is not a complete checkpoint (``is_complete``) is skipped
    with a ``CheckpointWarning`` saying why.

    >>> catalog("no/such/dir")
    []
    """
    root, out = Path(output_dir), []
    found = sorted((s, p) for p in (root.iterdir() if root.is_dir() else ()) if (s := step_in_name(p)) is not None)
    for _, path in found:
        if isinstance(meta := _examine(path), str):
            warnings.warn(f"skipping {path}: {meta}", CheckpointWarning, stacklevel=2)
        else:
            out.append((path, meta))
    return out


def damaged_checkpoints(output_dir: str | os.PathLike) -> list[tuple[Path, str, dict[str, Any]]]:
    """Return ``(path, why, sidecar)`` of each ``checkpoint-{step}`` directory of ``output_dir`` whose sidecar is
    intact but whose files are not (one missing or of another size): a checkpoint trainfold wrote (writes are
    renamed into place only once complete) damaged since. A directory whose sidecar cannot be read (another
    tool's, a malformed sibling) is not listed.

    >>> damaged_checkpoints("no/such/dir")
    []
    """
    root = Path(output_dir)
    found = sorted((s, p) for p in (root.iterdir() if root.is_dir() else ()) if (s := step_in_name(p)) is not None)
    out = []
    for _, path in found:
        if not path.is_dir() or path.is_symlink():
            continue
        try:
            check_name(path, meta := read_metadata(path))
        except (OSError, ValueError):
            continue
        if isinstance(why := _examine(path), str):
            out.append((path, why, meta))
    return out


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Return the paths of ``catalog(output_dir)``: the complete checkpoints, oldest step first."""
    return [path for path, _ in catalog(output_dir)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """Return the complete checkpoint with the highest step in ``output_dir``, or ``None``.

    It may be any run's; ``trainfold.ckpt.run_dir.candidates`` lists one run's.

    >>> latest_checkpoint("no/such/dir") is None
    True
    """
    return next(reversed(list_checkpoints(output_dir)), None)


def resume_checkpoint(
    resume_from_checkpoint: bool | str | os.PathLike | None, output_dir: str | os.PathLike
) -> Path | None:
    """Return the checkpoint that ``resume_from_checkpoint`` (HF semantics) names, or ``None``.

    ``None``/``False``: start fresh; ``True``: the latest complete one in ``output_dir`` (an error if none); a
    path: that one, which must be complete. (``train``'s ``run_dir.claim`` takes only the same run's.)

    >>> resume_checkpoint(False, "out") is None
    True
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        if (found := latest_checkpoint(output_dir)) is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint-<step> "
                "directory; pass a checkpoint path, or resume_from_checkpoint=None to start fresh"
            )
        return found
    path = Path(resume_from_checkpoint)
    read_metadata(path)  # names the path, the field and what is wrong with it
    if isinstance(problem := _examine(path), str):
        raise CheckpointError(
            f"{path} is incomplete or unusable ({problem}); resume from latest_checkpoint({str(path.parent)!r}) instead"
        )
    return path
