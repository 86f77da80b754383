"""Resume checked end to end: a run stopped by SIGTERM and resumed in a fresh process, against one never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

__all__ = ["ResumeCheck", "check_resume", "compare_results", "dump_result"]


# What each fresh process runs: the user's ``fn(output_dir, resume_from_checkpoint, observers)``, with
# an observer that sends this process SIGTERM once a step >= stop_at is logged (mode "interrupt").
_CHILD = """
import importlib, os, runpy, signal, sys
target, output_dir, mode, stop_at, result_dir = sys.argv[1:6]
where, _, name = target.rpartition(":")
space = runpy.run_path(where, run_name="__trainfold_check__") if where.endswith(".py") else vars(
    importlib.import_module(where))
sent = []
def interrupt(state, logs):
    if mode == "interrupt" and not sent and int(state.step) >= int(stop_at):
        sent.append(int(state.step))
        os.kill(os.getpid(), signal.SIGTERM)
result = space[name](output_dir, mode == "resume", [interrupt])
from trainfold.testing import dump_result
dump_result(result, result_dir)
"""

_UNLOGGED = ("runtime", "per_second", "train_")  # wall-clock numbers, and the summary of one process's part


def dump_result(result: Any, result_dir: str | os.PathLike) -> None:
    """Write a ``TrainResult``'s state (safetensors), status and log (JSON) for ``compare_results``."""
    import safetensors.torch

    from trainfold.core.tree import flatten

    Path(result_dir).mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in flatten(result.state).items()}
    safetensors.torch.save_file(tensors, os.path.join(result_dir, "state.safetensors"))
    logs = [
        {k: v for k, v in entry.items() if not any(u in k for u in _UNLOGGED)}
        for entry in result.log_history
        if "train_loss" not in entry
    ]  # not one process's summary
    record = {"status": result.status, "global_step": result.global_step, "log_history": logs}
    Path(result_dir, "result.json").write_text(json.dumps(record))


@attrs.frozen
class ResumeCheck:
    """The outcome of ``check_resume``: where the run stopped, and every difference from the run never stopped."""

    stopped_at: int
    final_step: int
    differing: tuple[str, ...]  # state keys whose tensors are not torch.equal
    differing_logs: tuple[int, ...]  # steps whose logged values (loss, grad_norm, eval_*, ...) differ

    @property
    def ok(self) -> bool:
        """Say whether the resumed run equals the uninterrupted one bitwise, state and logs."""
        return not self.differing and not self.differing_logs

    def __str__(self) -> str:
        if self.ok:
            return f"stopped at step {self.stopped_at}, resumed to step {self.final_step}: bitwise equal"
        return (
            f"stopped at step {self.stopped_at}, resumed to step {self.final_step}: tensors differ "
            f"{list(self.differing)[:8]}{' ...' if len(self.differing) > 8 else ''}, "
            f"logs differ at steps {list(self.differing_logs)[:8]}"
        )


def check_resume(
    target: str,
    *,
    stop_at: int,
    workdir: str | os.PathLike | None = None,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
) -> ResumeCheck:
    """Check that a run stopped by SIGTERM at step ``stop_at`` and resumed in a fresh process ends bitwise equal.

    ``target`` is ``"path/to/script.py:fn"`` or ``"package.module:fn"``, where
    ``fn(output_dir, resume_from_checkpoint, observers)`` builds the run and returns
    ``train(model, args, data, observers=observers, resume_from_checkpoint=resume_from_checkpoint)``
    with ``args.output_dir = output_dir`` and ``enable_jit_checkpoint=True`` (build everything
    inside ``fn``, seeded: each call is a fresh process). Three fresh processes run it: once to the
    end; once until an observer sends it SIGTERM after the first logged step ``>= stop_at`` (use
    ``logging_steps=1`` to stop exactly there); once resumed from that run's JIT checkpoint. Every
    tensor of the final states is compared with ``torch.equal`` and every logged value by step.

    ``check_resume("my_run.py:run", stop_at=5).ok`` is True when resume is bitwise; ``str()`` of the
    result names what differs. A process that fails raises ``RuntimeError`` with its stderr.
    """
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="trainfold-resume-"))
    child_env = {**os.environ, **(env or {})}

    runs = {name: (root / name / "output", root / name / "result") for name in ("uninterrupted", "interrupted")}
    procs = {
        name: _start(target, "interrupt" if name == "interrupted" else "plain", out, stop_at, result, child_env)
        for name, (out, result) in runs.items()
    }
    for name, proc in procs.items():
        _finish(proc, name, target, timeout)
    stopped = _read_result(runs["interrupted"][1])
    if stopped["status"] != "preempted":
        raise ValueError(
            f"check_resume: {target!r} was not preempted (status {stopped['status']!r} at step "
            f"{stopped['global_step']}): pass enable_jit_checkpoint=True and the observers to train, and "
            f"stop_at={stop_at} below the run's last step"
        )
    resumed_dir = root / "interrupted" / "resumed"
    _finish(
        _start(target, "resume", runs["interrupted"][0], stop_at, resumed_dir, child_env), "resumed", target, timeout
    )
    differing, differing_logs = compare_results(runs["uninterrupted"][1], resumed_dir)
    return ResumeCheck(
        int(stopped["global_step"]), int(_read_result(resumed_dir)["global_step"]), differing, differing_logs
    )


def _start(
    target: str, mode: str, out: Path, stop_at: int, result: Path, env: Mapping[str, str]
) -> subprocess.Popen[str]:
    """Start one fresh process running ``target`` in ``mode`` ("plain", "interrupt" or "resume")."""
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, target, str(out), mode, str(stop_at), str(result)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(proc: subprocess.Popen[str], what: str, target: str, timeout: float) -> None:
    """Wait for one run of ``check_resume``; raise with its stderr when it failed or never saw SIGTERM's checkpoint."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"check_resume: the {what} run of {target!r} took over {timeout} s") from None
    if proc.returncode == -signal.SIGTERM and what == "interrupted":
        raise ValueError(
            f"check_resume: {target!r} was not preempted (SIGTERM killed it): pass "
            "enable_jit_checkpoint=True and the observers to train"
        )
    if proc.returncode != 0:
        raise RuntimeError(f"check_resume: the {what} run of {target!r} exited {proc.returncode}:\n{err[-4000:]}")


def compare_results(expected: str | os.PathLike, got: str | os.PathLike) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Return ``(state keys whose tensors differ, steps whose logs differ)`` between two ``dump_result`` folders."""
    import safetensors.torch

    a = safetensors.torch.load_file(Path(expected) / "state.safetensors")
    b = safetensors.torch.load_file(Path(got) / "state.safetensors")
    differing = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    logs = _differing_logs(_read_result(Path(expected))["log_history"], _read_result(Path(got))["log_history"])
    return tuple(differing), logs


def _read_result(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "result.json").read_text())


def _differing_logs(want: list[dict[str, Any]], have: list[dict[str, Any]]) -> tuple[int, ...]:
    """Return the steps whose log entries differ (by kind: train logs and eval logs compared apart)."""

    def by_step(entries: list[dict[str, Any]]) -> dict[tuple[int, bool], dict[str, Any]]:
        return {(int(e.get("step", -1)), any(k.startswith("eval_") for k in e)): e for e in entries if "step" in e}

    a, b = by_step(want), by_step(have)
    return tuple(sorted({step for step, _ in a.keys() | b.keys() if a.get((step, _)) != b.get((step, _))}))
