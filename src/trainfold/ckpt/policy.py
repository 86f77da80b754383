"""Checkpoint policy: when to save, which checkpoints to keep (``rotate``), the best one, what a resume may change."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from trainfold.ckpt.best import BestMetric
from trainfold.ckpt.faults import point
from trainfold.ckpt.listing import catalog, checkpoint_path, is_complete
from trainfold.ckpt.run_identity import RunSettings
from trainfold.core.fold import steps_interval
from trainfold.data import global_batch as elastic

__all__ = [
    "SAVE_STRATEGIES",
    "should_save",
    "rotate",
    "best_checkpoint",
    "check_compatible",
]

# The values of ``save_strategy`` (HF's, and "best": save when the metric improves).
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")


def should_save(
    step: int,
    *,
    save_strategy: str,
    save_steps: float = 500,
    epoch_end: bool = False,
    max_steps: int | None = None,
    new_best: bool = False,
    last: bool = False,
) -> bool:
    """Say whether to save after optimizer step ``step`` (HF ``save_strategy`` semantics).

    ``"steps"``: every ``save_steps`` steps (a fraction ``< 1`` is a share of ``max_steps``), epoch
    end or not, and at the run's last step (``last``, or ``step >= max_steps``); ``"epoch"``: when
    ``epoch_end``, and at the last step when it ends an epoch early (HF ends the epoch there);
    ``"best"``: when the metric reached a ``new_best``. Call it once per step.

    >>> [s for s in range(1, 8) if should_save(s, save_strategy="steps", save_steps=3, max_steps=7)]
    [3, 6, 7]
    """
    if save_strategy not in SAVE_STRATEGIES:
        raise ValueError(f"save_strategy {save_strategy!r} is not one of {list(SAVE_STRATEGIES)}")
    last = last or (max_steps is not None and step >= max_steps)
    if save_strategy != "steps":
        return {"no": False, "epoch": epoch_end or last, "best": new_best}[save_strategy]
    return step > 0 and (step % steps_interval(save_steps, max_steps, "save_steps") == 0 or last)


def rotate(
    output_dir: str | os.PathLike,
    save_total_limit: int | None,
    *,
    keep: Collection[str | os.PathLike] = (),
    run_id: str | None = None,
) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``save_total_limit``; return what was deleted.

    Never deleted: the latest checkpoint and any path in ``keep`` (e.g. the best). A JIT checkpoint
    is rotated like any other once a newer complete one exists (HF rotates it too), so a run preempted
    again and again keeps ``save_total_limit`` of them. So ``save_total_limit=1`` with a best
    checkpoint keeps both the best and the latest. Incomplete directories are left alone (and
    malformed ones skipped with a warning).
    With ``run_id`` only that run's checkpoints are counted and deleted; other runs' stay.

    >>> import tempfile, attrs, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state, scalar
    >>> from trainfold.ckpt import save
    >>> out, state = tempfile.mkdtemp(), init_state(torch.nn.Linear(2, 1), sgd(0.1))
    >>> for step in (1, 2, 3, 4):
    ...     _ = save(attrs.evolve(state, step=scalar(step)), checkpoint_path(out, step))
    >>> [p.name for p in rotate(out, 1, keep=[checkpoint_path(out, 2)])]
    ['checkpoint-1', 'checkpoint-3']
    """
    if save_total_limit is None:
        return []
    if isinstance(save_total_limit, bool) or not isinstance(save_total_limit, int) or save_total_limit < 1:
        raise ValueError(f"save_total_limit must be a positive int or None, got {save_total_limit!r}")
    sidecars = dict(catalog(output_dir))  # the complete ones
    found = [p for p, m in sidecars.items() if run_id is None or (m.get("run") or {}).get("id") == run_id]
    protected = {Path(p).resolve() for p in [*keep, *found[-1:]] if p is not None}
    deletable = [p for p in found if p.resolve() not in protected]
    doomed = deletable[: max(0, len(found) - save_total_limit)]
    for path in doomed:
        trash = path.parent / f".{path.name}.deleting-{os.getpid()}-{secrets.token_hex(4)}"
        point(f"rotate:before:{path.name}")
        os.rename(path, trash)  # a half-deleted directory never looks like a checkpoint
        point(f"rotate:renamed:{path.name}")
        shutil.rmtree(trash, ignore_errors=True)
        point(f"rotate:removed:{path.name}")
    return doomed


def best_checkpoint(output_dir: str | os.PathLike, best: BestMetric) -> Path | None:
    """Return the complete checkpoint of the best step, or ``None`` if there is none on disk."""
    if int(best.step) < 0:
        return None
    path = checkpoint_path(output_dir, int(best.step))
    return path if is_complete(path) else None


def check_compatible(
    saved_settings: Mapping[str, Any], settings: RunSettings, *, source: str | os.PathLike = "the checkpoint"
) -> None:
    """Raise ``ValueError`` listing every sample-order setting (``settings.samples``) the new run changes.

    Those settings (declared ``SAMPLE_ORDER`` on their fields, and the world size) fix which samples
    make each step, so an exact resume needs them unchanged; the batch split may change when the
    global batch does not (``trainfold.data.global_batch``: another number of ranks). Other settings
    (schedule, logging, saving) may differ: they come from the new run.
    """
    new_settings, keys = settings.values, settings.samples
    absent, batch = object(), elastic.global_batch(saved_settings)
    if batch is not None and batch == elastic.global_batch(new_settings):
        keys = tuple(k for k in keys if k not in elastic.BATCH_KEYS)  # the same samples per step, split otherwise
    diffs = [
        f"{k}: saved {saved_settings.get(k, 'unset')!r}, now {new_settings.get(k, 'unset')!r}"
        for k in keys
        if saved_settings.get(k, absent) != new_settings.get(k, absent)
    ]
    if diffs:
        raise ValueError(
            f"cannot resume from {source} with different settings: {'; '.join(diffs)}; "
            "resume with the saved values or start a new run (warm_start)"
        )
