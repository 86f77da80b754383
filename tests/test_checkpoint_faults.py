"""Fault injection: kill the writer at every point of a save, a rotation, a replace and a JIT mark in turn.

Each trial runs ``train`` in a fresh process that dies (``os._exit``, or SIGKILL from here) at one
point; then this process checks that a complete checkpoint of the run is found, resumes from it
with ``resume_from_checkpoint=True``, and requires the final state to equal an uninterrupted run's
bitwise and no leftover directory to survive. Reduced by default; ``TRAINFOLD_SLOW=full`` tries
every point and more SIGKILLs.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from resume_fixture import collate, model, rows

from trainfold import TrainingArguments, train
from trainfold import ckpt as checkpoint
from trainfold.ckpt import faults, run_dir, run_lock
from trainfold.core.tree import flatten

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

BASE = dict(
    max_steps=8,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    warmup_steps=2,
    weight_decay=0.1,
    max_grad_norm=1.0,
    seed=11,
    logging_steps=1,
    save_strategy="steps",
    save_steps=2,
    save_total_limit=1,
    enable_jit_checkpoint=True,
    report_to="none",
    disable_tqdm=True,
)

# scenario -> (resume_from_checkpoint of the killed run, the step it is preempted at (a JIT save), or None)
# "resume": resumes checkpoint-2, saves 4 and 6 (each rotating the one before), is preempted at 6: the JIT
#           save finds checkpoint-6 and only marks it.
# "replace": a fresh start of the same settings over an older lineage's checkpoint-2: the save swaps it.
SCENARIOS = {"resume": (True, 6), "replace": (None, 3)}

CHILD = textwrap.dedent(f"""
    import os, signal, sys, time
    sys.path.insert(0, {str(HERE)!r})
    import torch
    torch.set_num_threads({torch.get_num_threads()})
    from resume_fixture import collate, model, rows
    from trainfold import TrainingArguments, train
    from trainfold import ckpt as checkpoint
    from trainfold.ckpt import faults
    out, resume, preempt_at, mode, target = sys.argv[1], sys.argv[2] == "True", int(sys.argv[3]), sys.argv[4], \
        int(sys.argv[5])
    count = [0]
    def hook(label):
        count[0] += 1
        if count[0] == target:
            if mode == "exit":
                os._exit(17)
            print("at", label, flush=True)
            time.sleep(120)  # the test SIGKILLs us here
    faults.fault_hook = hook
    sent = []
    def preempt(s):
        if int(s.step) == preempt_at and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return False
    args = TrainingArguments(output_dir=out, **{BASE!r})
    r = train(model(), args, rows(), data_collator=collate, stop=preempt,
              resume_from_checkpoint=True if resume else None)
    print("finished", r.status, flush=True)
""")


def _train(out: Path, resume, stop=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
        return train(
            model(),
            TrainingArguments(output_dir=str(out), **BASE),
            rows(),
            data_collator=collate,
            stop=stop,
            resume_from_checkpoint=resume,
        )


def _base(tmp: Path) -> Path:
    """A directory holding this run's checkpoint-2 (stopped there)."""
    out = tmp / "base"
    if not out.exists():
        _train(out, None, stop=lambda s: int(s.step) >= 2)
    return out


def _labels(tmp: Path, scenario: str) -> list[str]:
    """The fault points the killed run passes, in order (recorded in this process)."""
    resume, preempt_at = SCENARIOS[scenario]
    out = tmp / f"labels-{scenario}"
    shutil.copytree(_base(tmp), out)
    seen: list[str] = []
    sent: list[int] = []

    def preempt(s):
        if int(s.step) == preempt_at and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return False

    faults.fault_hook = seen.append
    try:
        _train(out, resume, stop=preempt)
    finally:
        faults.fault_hook = None
    return seen


_LEFT = re.compile(r"\.(tmp|old|deleting)-")


def _leftovers(out: Path) -> list[str]:
    found = [p.name for p in out.iterdir() if p.name.startswith(".checkpoint") and _LEFT.search(p.name)]
    found += [f"{d.name}/{p.name}" for d in out.glob("checkpoint-*") for p in d.glob(".trainfold.json.tmp-*")]
    return found


def _trial(tmp: Path, scenario: str, index: int, mode: str, straight, fp: str) -> str:
    resume, preempt_at = SCENARIOS[scenario]
    out = tmp / f"{scenario}-{mode}-{index}"
    shutil.copytree(_base(tmp), out)
    cmd = [sys.executable, "-c", CHILD, str(out), str(resume), str(preempt_at), mode, str(index)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if mode == "kill":
        line = proc.stdout.readline()
        assert line.startswith("at "), (line, proc.stderr.read()[-2000:])
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    died = proc.returncode in (17, -signal.SIGKILL)
    assert died, (proc.returncode, err[-2000:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
        run_lock.remove_leftovers(out)  # what the next run's claim does first (puts a moved-aside one back)
        found = next(iter(run_dir.candidates(out, fp)), None)
    assert found is not None and checkpoint.is_complete(found), f"{scenario} #{index}: no checkpoint of the run"
    resumed = _train(out, True)
    assert resumed.global_step == 8
    a, b = flatten(resumed.state), flatten(straight.state)
    for key in a:
        if key != "metrics.num_items":
            assert torch.equal(a[key], b[key]), f"{scenario} #{index} ({mode}): {key} differs after the resume"
    assert _leftovers(out) == [], f"{scenario} #{index}: leftovers survived the next run"
    shutil.rmtree(out)
    return found.name


@pytest.mark.slow
def test_a_killed_writer_always_leaves_a_checkpoint_of_the_run_that_resumes_bitwise(tmp_path, full_slow):
    straight = _train(tmp_path / "straight", None)
    fp = checkpoint.read_metadata(tmp_path / "straight" / "checkpoint-8")["run"]["fingerprint"]
    outcomes = []
    for scenario in SCENARIOS:
        labels = _labels(tmp_path, scenario)
        assert any(lb.startswith("rotate:") for lb in labels) or scenario == "replace"
        points = list(range(1, len(labels) + 1))
        if not full_slow:  # the points where a crash matters most, one each
            wanted = {"resume": ("rotate:renamed", "mark_jit:wrote"), "replace": ("replace:moved-aside",)}[scenario]
            first = {
                w: [i for i, lb in enumerate(labels, 1) if lb.startswith(w)][:1]
                for w in (*wanted, "save:wrote:sidecar")
            }
            assert all(first.values()), f"{scenario} passes no {[w for w, i in first.items() if not i]} point"
            points = sorted(i for found in first.values() for i in found)
        for i in points:
            outcomes.append((scenario, labels[i - 1], "exit", _trial(tmp_path, scenario, i, "exit", straight, fp)))
        rng = random.Random(len(labels))
        for i in rng.sample(range(1, len(labels) + 1), 3 if full_slow else 1):
            outcomes.append((scenario, labels[i - 1], "kill", _trial(tmp_path, scenario, i, "kill", straight, fp)))
    print(f"\n{len(outcomes)} trials, all resumed bitwise with no leftover:")
    for scenario, label, mode, resumed_from in outcomes:
        print(f"  {scenario:8} {mode:4} at {label:32} -> resumed from {resumed_from}")
