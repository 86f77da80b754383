"""trainfold.testing.check_resume: a user's own run, stopped by SIGTERM and resumed in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainfold.ckpt import list_checkpoints
from trainfold.testing import ResumeCheck, check_resume

RUNS = Path(__file__).resolve().parent / "resume_runs.py"


def test_a_run_that_resumes_bitwise_passes(tmp_path):
    check = check_resume(f"{RUNS}:tinylm", stop_at=3, workdir=tmp_path)
    assert check == ResumeCheck(stopped_at=3, final_step=8, differing=(), differing_logs=())
    assert check.ok and str(check) == "stopped at step 3, resumed to step 8: bitwise equal"
    kept = [p.name for p in list_checkpoints(tmp_path / "interrupted" / "output")]
    assert kept == ["checkpoint-6", "checkpoint-8"]  # save_total_limit=2: the JIT checkpoint-3 it resumed from rotated


@pytest.mark.slow
def test_a_run_that_does_not_resume_bitwise_names_the_tensors_and_the_steps(tmp_path):
    check = check_resume(f"{RUNS}:tinylm_other_data_on_resume", stop_at=4, workdir=tmp_path)
    assert not check.ok and check.stopped_at == 4
    assert any(k.startswith("params.") for k in check.differing) and "step" not in check.differing
    assert check.differing_logs and min(check.differing_logs) == 5  # steps 1-4 came from the checkpoint
    assert "tensors differ ['" in str(check)


@pytest.mark.slow
def test_a_run_without_jit_checkpoints_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="was not preempted .*enable_jit_checkpoint=True and the observers to train"):
        check_resume(f"{RUNS}:tinylm_without_jit", stop_at=3, workdir=tmp_path)


def test_a_failing_run_raises_with_its_stderr(tmp_path):
    failed = r"(?s)the (uninterrupted|interrupted) run of .*no_such_fn.* exited 1:.*KeyError"
    with pytest.raises(RuntimeError, match=failed):
        check_resume(f"{RUNS}:no_such_fn", stop_at=3, workdir=tmp_path)
