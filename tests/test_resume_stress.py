"""Stress: SIGTERM at random moments under a concurrent CPU load, each run resumed in a fresh process.

For HF GPT-2 (``gelu_new``: the first ``torch.tanh`` of a process, issue 23) and Llama with
attention dropout, from small configs with random weights (``resume_runs.py``). Two uninterrupted
runs in separate processes must be bitwise equal; every trial (a SIGTERM at a random moment from
model building to the final save, exit 143 or 0, then a resume in a fresh process when it stopped
early) must end with every tensor ``torch.equal`` to them and the same logged values at every step.
By default one trial and one uninterrupted run per model; ``TRAINFOLD_SLOW=full`` runs two
uninterrupted runs and 20 trials per model. The concurrent load is a busy process of the test's own, except in a
reduced run beside other pytest-xdist workers (``make test``): the other worker's tests are its load there
(``TRAINFOLD_STRESS_TRIALS`` overrides the count; ``TRAINFOLD_TEST_NO_WARMUP=1`` measures without
the kernel warm-up).

Two cases are fixed rather than drawn: a SIGTERM after ``train`` has returned (the run must end 0, never
-15: issue 30), and the moments seed 77 drew for GPT-2 that once landed in the interpreter's teardown.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainfold.ckpt import latest_checkpoint, read_metadata
from trainfold.core.preempt import EXIT_PREEMPTED
from trainfold.testing import compare_results

RUNS = Path(__file__).resolve().parent / "resume_runs.py"


def sibling_workers() -> bool:
    """Whether other pytest-xdist workers run beside this test (``make test``'s two): they load the CPU."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


@contextlib.contextmanager
def cpu_load(seconds: float, *, busy: bool = True):
    """Keep one busy Python loop running beside the trials (ended at the block's end, or after ``seconds``);
    ``busy=False``: none (the CPU is loaded otherwise)."""
    if not busy:
        yield
        return
    loop = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", loop])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def start(name: str, out: Path, mode: str, result: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(RUNS), name, str(out), mode, str(result)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
    return proc


def finish(proc: subprocess.Popen) -> int:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode in (0, EXIT_PREEMPTED), f"exit {proc.returncode}: {err[-3000:]}"
    return proc.returncode


def trials(full_slow: bool) -> int:
    return int(os.environ.get("TRAINFOLD_STRESS_TRIALS", 20 if full_slow else 1))


def moments(name: str, seed: object, count: int) -> list[float]:
    """The fractions of one run's time (model build to final save) at which the trials send SIGTERM."""
    rng = random.Random(f"{name}-{seed}")
    return [rng.uniform(0.1, 1.0) for _ in range(count)]


# Seed 77's GPT-2 draws (issue 30): 0.964, 0.907 and 0.921 of the run signalled a finished run in its
# teardown, which then died by -15. The GPT-2 case runs them after its own draws: reduced, the latest of
# them; in full, all eight.
SEED_77 = moments("gpt2", 77, 8)


def stress(name: str, fractions: list[float], tmp_path: Path, *, twice: bool, busy: bool = True) -> list[str]:
    """SIGTERM one run at each fraction of a lone run's time; every run (resumed when stopped) must be bitwise."""
    outcomes: list[str] = []
    with cpu_load(3600, busy=busy):
        # Two uninterrupted runs at once (reduced: one; each trial's run is another separate process).
        refs = [start(name, tmp_path / f"ref{i}", "plain", tmp_path / f"ref{i}-result") for i in range(1 + twice)]
        began = time.monotonic()  # all imported: from here the model build, setup, steps and saves
        assert [finish(p) for p in refs] == [0] * len(refs)
        lone = (time.monotonic() - began) / len(refs)  # about one run's time after its imports, alone
        if twice:
            assert compare_results(tmp_path / "ref0-result", tmp_path / "ref1-result") == ((), ())
        for trial, fraction in enumerate(fractions):
            out, result = tmp_path / f"t{trial}", tmp_path / f"t{trial}-result"
            proc = start(name, out, "plain", result)
            time.sleep(fraction * lone)
            proc.send_signal(signal.SIGTERM)
            if finish(proc) == EXIT_PREEMPTED:
                saved = latest_checkpoint(out)
                outcomes.append(f"143@{read_metadata(saved)['step'] if saved else 'setup'}")
                assert finish(start(name, out, "resume", result)) == 0
            else:
                outcomes.append("0")  # the signal came after the last step: the run is complete
            differing, differing_logs = compare_results(tmp_path / "ref0-result", result)
            assert (differing, differing_logs) == ((), ()), f"trial {trial} ({outcomes[-1]}): {differing[:8]}"
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sigterm_at_random_moments_resumes_bitwise_in_a_fresh_process(name, tmp_path, full_slow):
    seed = os.environ.get("TRAINFOLD_STRESS_SEED", 23)
    fractions = moments(name, seed, trials(full_slow))
    if name == "gpt2":  # the fixed regression schedule rides along (one reference run serves both)
        fractions += SEED_77 if full_slow else [max(SEED_77)]
    outcomes = stress(name, fractions, tmp_path, twice=full_slow, busy=full_slow or not sibling_workers())
    print(f"{name}: {len(outcomes)} trials bitwise equal: {outcomes}")


def test_a_sigterm_after_train_returned_leaves_a_completed_run_at_exit_0(tmp_path):
    """The signal arrives for certain after ``train`` returned (the run says so, then waits): exit 0, not -15."""
    proc = subprocess.Popen(
        [sys.executable, str(RUNS), "tinylm", str(tmp_path / "out"), "hold", str(tmp_path / "result")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
    assert proc.stdout.readline().strip() == "trained", proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    proc.stdin.close()  # the run exits; a signal now lands in its teardown (or after it): still 0
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, f"exit {proc.returncode}: {proc.stderr.read()[-3000:]}"
