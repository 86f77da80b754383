"""Preemption: the SIGTERM guard, the stop predicate, and JIT checkpoints that resume bitwise."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import attrs
import pytest
import safetensors.torch
import torch

from trainfold.ckpt import checkpoint_path, list_checkpoints, load, read_metadata, save
from trainfold.ckpt.policy import rotate
from trainfold.core.fold import any_of, fit, trajectory
from trainfold.core.preempt import EXIT_PREEMPTED, Preemption, exit_status, preemption_guard
from trainfold.core.state import init_state, scalar
from trainfold.core.tree import flatten
from trainfold.optim import sgd

# The run the subprocesses train: resume_fixture.fold_run, here and in the subprocesses.
SETUP = textwrap.dedent(
    f"""
    import sys
    import torch
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    from resume_fixture import fold_run

    N_STEPS = 12

    def make_run():
        return fold_run(N_STEPS)
    """
)

# Train under the guard, printing each finished step; on SIGTERM save a JIT checkpoint and exit 143.
TRAIN = SETUP + textwrap.dedent(
    """
    import sys, time
    from trainfold.ckpt import checkpoint_path, save
    from trainfold.core.preempt import EXIT_PREEMPTED, preemption_guard
    from trainfold.core.fold import trajectory
    torch.set_num_threads(1)
    out = sys.argv[1]
    model, step, state, batches = make_run()
    with preemption_guard() as guard:
        print("ready", flush=True)
        sys.stdin.readline()  # wait for "go", so every run starts training when the test says
        for state in trajectory(step, state, batches, stop=guard.stop):
            print(int(state.step), flush=True)
            time.sleep(0.02)  # widen the window; outside the step, so the numbers do not change
        if not guard.requested():
            sys.stdin.readline()  # finished first: wait inside the guard until the test is done signalling
        if guard.requested():
            save(state, checkpoint_path(out, int(state.step)), jit=True, model=model)
            sys.exit(EXIT_PREEMPTED)
    save(state, checkpoint_path(out, int(state.step)), model=model)
    """
)

RESUME = SETUP + textwrap.dedent(
    """
    import sys
    from trainfold.ckpt import latest_checkpoint, load, save
    from trainfold.core.fold import fit
    torch.set_num_threads(1)
    model, step, fresh, batches = make_run()
    for out in sys.argv[1:]:
        state = load(latest_checkpoint(out), like=fresh)
        save(fit(step, state, batches[int(state.step):]), out + "/resumed")
    """
)


def run_setup() -> dict:
    ns: dict = {}
    exec(SETUP, ns)
    return ns


# -- the guard --------------------------------------------------------------------------------------


def test_guard_installs_the_handler_only_while_active():
    before = signal.getsignal(signal.SIGTERM)
    with preemption_guard() as guard:
        assert signal.getsignal(signal.SIGTERM) is not before
        assert not guard.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested()
    assert signal.getsignal(signal.SIGTERM) is before


def test_guard_restores_the_handler_on_an_exception():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"), preemption_guard():
        raise RuntimeError("boom")
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_predicate_stops_at_the_step_boundary_before_drawing_a_batch():
    drawn: list[int] = []

    def batches():
        for i in range(10):
            drawn.append(i)
            yield i

    def step(n, batch):
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 4 runs
        return n + 1

    with preemption_guard() as guard:
        n = fit(step, 0, batches(), stop=any_of(lambda m: m >= 100, guard.stop))
    assert n == 4 and drawn == [0, 1, 2, 3]


def test_collective_makes_every_rank_stop_when_one_is_signalled():
    class MaxOverRanks:  # what an all-reduce would do, with the other rank's flag set
        rank = 0

        def sum_(self, tensors):
            for t in tensors:
                t.add_(1)

    assert Preemption(collective=MaxOverRanks()).requested()
    assert not Preemption().requested()


def test_guard_refuses_a_thread_other_than_main():
    errors: list[BaseException] = []

    def enter():
        try:
            with preemption_guard():
                pass
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_jit_checkpoints_are_marked_and_rotated_once_a_newer_one_exists(tmp_path):
    state = init_state(torch.nn.Linear(2, 1), sgd(0.1))
    save(state, checkpoint_path(tmp_path, 0), jit=True)  # step 0
    assert read_metadata(tmp_path / "checkpoint-0")["jit"] is True
    rotate(tmp_path, 1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-0"]  # the newest: kept
    for s in (1, 2, 3):
        save(attrs.evolve(state, step=scalar(s)), checkpoint_path(tmp_path, s))  # checkpoint-{s} holds step s
    save(attrs.evolve(state, step=scalar(4)), checkpoint_path(tmp_path, 4), jit=True)
    rotate(tmp_path, 1, keep=[checkpoint_path(tmp_path, 2)])  # 2: the best
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]


def test_repeated_preemptions_with_save_total_limit_1_keep_one_checkpoint_and_resume_bitwise(tmp_path):
    """Issue 44, item 13: each preemption leaves a JIT checkpoint; the older ones (JIT or periodic) are rotated."""
    from resume_runs import MAX_STEPS, run

    from trainfold.ckpt.sidecar import STATE_FILE

    straight = run("tinylm", str(tmp_path / "straight"), None, save_total_limit=1)
    out, kept = tmp_path / "stopped", []
    for n, at in enumerate((1, 2, 4, 5, 7)):  # save_steps=3: a periodic checkpoint-3 and -6 between the JIT ones
        result = run("tinylm", str(out), n > 0, [_signal_at(at, signal.SIGTERM)], save_total_limit=1)
        assert (result.status, result.global_step) == ("preempted", at)
        kept.append([p.name for p in list_checkpoints(out)])
    assert kept == [[f"checkpoint-{at}"] for at in (1, 2, 4, 5, 7)]
    assert read_metadata(out / "checkpoint-7")["jit"] is True
    done = run("tinylm", str(out), True, save_total_limit=1)
    assert (done.status, done.global_step) == ("completed", MAX_STEPS)
    assert [p.name for p in list_checkpoints(out)] == [f"checkpoint-{MAX_STEPS}"]
    expected = safetensors.torch.load_file(tmp_path / "straight" / f"checkpoint-{MAX_STEPS}" / STATE_FILE)
    resumed = safetensors.torch.load_file(out / f"checkpoint-{MAX_STEPS}" / STATE_FILE)
    assert sorted(resumed) == sorted(expected) and all(torch.equal(resumed[k], expected[k]) for k in expected)
    losses = lambda result: [(e["step"], e["loss"]) for e in result.log_history if "loss" in e]
    assert losses(done) == losses(straight)


# -- SIGTERM at a random moment in a real training process -------------------------------------------


def test_sigterm_saves_at_a_step_boundary_exits_143_and_resumes_bitwise(tmp_path):
    ns = run_setup()
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, step, state0, batches = ns["make_run"]()
        states = [state0, *trajectory(step, state0, batches)]
    finally:
        torch.set_num_threads(n_threads)
    n = ns["N_STEPS"]
    rng = random.Random(20261129)
    plans = [(rng.randint(0, n - 6), rng.uniform(0.0, 0.03)) for _ in range(5)]
    outs = [tmp_path / f"run{i}" for i in range(len(plans))]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TRAIN, str(out)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for out in outs
    ]
    stopped_at = []
    try:
        for proc, (after, delay) in zip(procs, plans):
            assert proc.stdout.readline().strip() == "ready"
            proc.stdin.write("go\n")
            proc.stdin.flush()
            seen = 0
            while seen < after:
                seen = int(proc.stdout.readline())
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            proc.stdin.close()
            rest = proc.stdout.read().split()
            proc.wait(timeout=60)
            assert proc.returncode == EXIT_PREEMPTED, proc.stderr.read()
            stopped_at.append(int(rest[-1]) if rest else seen)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for out, last, (after, _) in zip(outs, stopped_at, plans):
        (ckpt,) = list_checkpoints(out)
        meta = read_metadata(ckpt)
        assert meta["jit"] is True and meta["step"] == last and after <= last <= n  # the last finished step
        saved = flatten(load(ckpt, like=state0))
        expected = flatten(states[last])
        assert all(torch.equal(saved[k], expected[k]) for k in expected)
    assert any(last < n for last in stopped_at), stopped_at  # some runs were stopped mid-training
    done = subprocess.run([sys.executable, "-c", RESUME, *map(str, outs)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    final = flatten(states[-1])
    for out in outs:
        resumed = flatten(load(out / "resumed", like=state0))
        assert all(torch.equal(resumed[k], final[k]) for k in final)


# -- guards that nest, signals at the edges (issues 23 and 16) ---------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_a_nested_guard_sees_what_the_outer_guard_caught():
    with preemption_guard() as outer:
        signal.raise_signal(signal.SIGTERM)  # e.g. while a script builds its model
        with preemption_guard() as inner:
            assert inner.requested() and inner.signal == signal.SIGTERM
        signal.raise_signal(signal.SIGTERM)
    assert outer.received == [signal.SIGTERM, signal.SIGTERM]


def test_a_nested_guard_leaves_a_signal_the_outer_code_ignores_ignored():
    """What the command line does for a SIGINT inherited as ignored (issue 44, item 10): train's guard keeps it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with preemption_guard((signal.SIGTERM,)), preemption_guard((signal.SIGTERM, signal.SIGINT)) as inner:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert not inner.requested()
        with preemption_guard((signal.SIGTERM, signal.SIGINT)) as alone:  # not nested: it catches both
            signal.raise_signal(signal.SIGINT)
            assert alone.signal == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _signal_at(step: int, signum: int):
    """An observer that sends this process ``signum`` once a step >= ``step`` is logged."""
    sent: list[int] = []

    def observe(state, logs):
        if not sent and int(state.step) >= step:
            sent.append(int(state.step))
            signal.raise_signal(signum)

    return observe


def test_sigint_in_a_jit_run_saves_like_sigterm_and_reports_130(tmp_path):
    from resume_runs import run

    runner = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever the runner set
    try:
        try:
            result = run("tinylm", str(tmp_path), None, [_signal_at(2, signal.SIGINT)], save_strategy="no")
        except KeyboardInterrupt:
            pytest.fail("SIGINT interrupted the run instead of saving a JIT checkpoint")
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, runner)
    assert after is signal.default_int_handler  # the guard is gone after train: the handler it found is back
    assert (result.status, result.global_step, result.signal) == ("preempted", 2, signal.SIGINT)
    assert exit_status(result.status, result.signal) == 130
    (saved,) = list_checkpoints(tmp_path)
    assert saved == result.last_checkpoint and read_metadata(saved)["jit"] is True and read_metadata(saved)["step"] == 2


def test_a_signal_during_the_final_save_leaves_the_run_completed(tmp_path, monkeypatch):
    from resume_runs import MAX_STEPS, run

    import trainfold.ckpt.writer as ckpt  # where the run saves through

    real_save = ckpt.save

    def save_then_signalled(state, directory, **options):
        if int(state.step) == MAX_STEPS and not options.get("jit"):
            os.kill(os.getpid(), signal.SIGTERM)  # the orchestrator's SIGTERM arrives during the final save
        return real_save(state, directory, **options)

    monkeypatch.setattr(ckpt, "save", save_then_signalled)
    result = run("tinylm", str(tmp_path), None, save_strategy="steps", save_steps=MAX_STEPS)
    assert (result.status, result.global_step, result.signal) == ("completed", MAX_STEPS, None)
    assert exit_status(result.status, result.signal) == 0
    (final,) = list_checkpoints(tmp_path)
    assert read_metadata(final)["jit"] is False and final == result.last_checkpoint  # saved once, not again as JIT


def _safetensors_disk_full():
    from safetensors import SafetensorError

    return SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    )


@pytest.mark.parametrize(
    "error",
    [lambda: OSError(28, "No space left on device"), _safetensors_disk_full],
    ids=["OSError", "SafetensorError"],
)
def test_a_full_disk_at_the_jit_save_names_the_path_the_bytes_and_the_intact_checkpoint(tmp_path, monkeypatch, error):
    from resume_runs import run

    full: list[bool] = []
    real_save_file = safetensors.torch.save_file

    def save_file(*args, **kwargs):  # as safetensors fails on a full disk, or as the OS does
        if full:
            raise error()
        return real_save_file(*args, **kwargs)

    def fill_the_disk_then_signal(state, logs):
        if int(state.step) == 4 and not full:
            full.append(True)
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(
        OSError,
        match=r"checkpoint-4: the disk is full \(it needs about [\d,]+ bytes, [\d,]+ free\); "
        r"the previous checkpoint .*checkpoint-3 \(step 3\) is intact",
    ) as caught:
        run("tinylm", str(tmp_path), None, [fill_the_disk_then_signal], save_strategy="steps", save_steps=3)
    assert caught.value.errno == 28 and caught.value.filename == str(tmp_path / "checkpoint-4")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the partial write is gone


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_at_a_periodic_save_names_the_path_the_bytes_and_the_intact_checkpoint(
    tmp_path, monkeypatch, async_save
):
    from resume_runs import run

    from trainfold.ckpt import tensor_file

    real_write = tensor_file.write

    def write(path, *args, **kwargs):
        if ".checkpoint-6." in str(path):
            raise OSError(28, "No space left on device")
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(tensor_file, "write", write)
    with pytest.raises(
        OSError,
        match=r"the checkpoint of step 6 could not be written to .*checkpoint-6: the disk is full \(it needs about "
        r"[\d,]+ bytes, [\d,]+ free\); the previous checkpoint .*checkpoint-3 \(step 3\) is intact",
    ) as caught:
        run("tinylm", str(tmp_path), None, save_steps=3, async_save=async_save, enable_jit_checkpoint=False)
    assert caught.value.errno == 28 and caught.value.filename == str(tmp_path / "checkpoint-6")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]


def test_a_full_disk_at_a_log_append_or_the_run_file_names_the_file_and_the_intact_checkpoint(tmp_path, monkeypatch):
    from resume_runs import run

    from trainfold.observe.history import HISTORY_FILE, HistoryFile

    run("tinylm", str(tmp_path), None, save_steps=3, max_steps=3, enable_jit_checkpoint=False)

    with HistoryFile(tmp_path / HISTORY_FILE, _at={"offset": 0, "entries": 0, "crc32": 0}) as history:
        _point_at_dev_full(tmp_path / HISTORY_FILE)  # writes fail with ENOSPC, as on a full disk
        with pytest.raises(
            OSError,
            match=r"log entry of step 4 could not be appended to .*log_history.jsonl: the "
            r"disk is full \(it needs about \d+ bytes, [\d,]+ free\); the previous checkpoint "
            r".*checkpoint-3 \(step 3\) is intact",
        ) as caught:
            history.append({"loss": 1.0, "step": 4})
    assert caught.value.errno == 28

    real_write_text = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name.startswith(".trainfold-run.json.tmp"):
            raise OSError(28, "No space left on device")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(
        OSError,
        match=r"the run file .*trainfold-run.json could not be written: the disk is full.*"
        r"checkpoint-3 \(step 3\) is intact",
    ) as caught:
        run("tinylm", str(tmp_path), True, save_steps=3, enable_jit_checkpoint=False)
    assert caught.value.errno == 28


def _fill_the_disk_under(path: Path, step: int):
    """An observer that, once step ``step`` is logged, points this process's open file ``path`` at /dev/full
    (every later write to it fails with ENOSPC, as on a full disk; the file itself stays as it was)."""
    done: list[bool] = []

    def observe(state, logs):
        if int(state.step) >= step and not done:
            done.append(True)
            _point_at_dev_full(path)

    return observe


def _point_at_dev_full(path: Path) -> None:
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    (fd,) = [fd for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(path)]
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, fd)
    os.close(full)


def test_a_full_disk_at_a_log_append_in_a_run_raises_the_named_error_alone_and_the_run_resumes(tmp_path):
    """Issue 44, item 12: closing the log history after the failed append raised a second, bare ENOSPC."""
    from resume_runs import MAX_STEPS, run

    full = _fill_the_disk_under(tmp_path / "log_history.jsonl", 4)
    with pytest.raises(OSError) as caught:
        run("tinylm", str(tmp_path), None, [full], enable_jit_checkpoint=False)
    assert caught.value.errno == 28 and caught.value.filename == str(tmp_path / "log_history.jsonl")
    assert re.search(
        r"the log entry of step 5 could not be appended to .*log_history.jsonl: the disk is full \(it needs about "
        r"\d+ bytes, [\d,]+ free\); the previous checkpoint .*checkpoint-3 \(step 3\) is intact",
        str(caught.value),
    ), str(caught.value)
    done = run("tinylm", str(tmp_path), True, enable_jit_checkpoint=False)  # space freed: resume from checkpoint-3
    assert done.global_step == MAX_STEPS
    assert [e["step"] for e in done.log_history if "loss" in e] == list(range(1, MAX_STEPS + 1))


def test_a_full_disk_at_the_lock_record_names_the_file_and_the_intact_checkpoint(tmp_path, monkeypatch):
    from resume_runs import run

    run("tinylm", str(tmp_path), None, save_steps=3, max_steps=3, enable_jit_checkpoint=False)
    real_write_text = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == "trainfold.lock.json":
            raise OSError(28, "No space left on device")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(
        OSError,
        match=r"the lock record .*trainfold.lock.json could not be written: the disk is full \(it needs about "
        r"\d+ bytes, [\d,]+ free\); the previous checkpoint .*checkpoint-3 \(step 3\) is intact",
    ) as caught:
        run("tinylm", str(tmp_path), True, save_steps=3, enable_jit_checkpoint=False)
    assert caught.value.errno == 28 and caught.value.filename == str(tmp_path / "trainfold.lock.json")
    monkeypatch.undo()
    assert run("tinylm", str(tmp_path), True, save_steps=3, enable_jit_checkpoint=False).status == "completed"


# A SIGTERM while train sets up (here: while the sampler asks the dataset its length).
SETUP_SIGNAL = textwrap.dedent(
    f"""
    import os, signal, sys
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    import resume_runs
    from trainfold.core.preempt import exit_status

    class SignalOnLen(resume_runs.ListDataset):
        sent = False

        def __len__(self):
            if not SignalOnLen.sent:
                SignalOnLen.sent = True
                os.kill(os.getpid(), signal.SIGTERM)
            return super().__len__()

    resume_runs.ListDataset = SignalOnLen
    result = resume_runs.run("tinylm", sys.argv[1], None)
    print(result.status, result.global_step, result.last_checkpoint)
    sys.exit(exit_status(result.status, result.signal))
    """
)


def test_sigterm_while_train_sets_up_ends_preempted_and_writes_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SETUP_SIGNAL, str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-2000:]
    assert done.stdout.split() == ["preempted", "0", "None"]
    left = sorted(p.name for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    # no checkpoint and no leftover of one: only the run's own bookkeeping (its lock, run file and log)
    assert not [n for n in left if n.startswith(("checkpoint-", "."))], left


# The command line, with a SIGTERM while it builds the model (before train is called).
CLI_SETUP_SIGNAL = textwrap.dedent(
    """
    import os, signal, sys
    import trainfold.cli.main as cli

    real = cli.build_model

    def build_model_signalled(spec):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(spec)

    cli.build_model = build_model_signalled
    sys.exit(cli.main(["train", "--config", sys.argv[1]]))
    """
)


def test_cli_sigterm_during_setup_exits_143_and_writes_nothing(tmp_path):
    from resume_fixture import endless_cli_config

    config = endless_cli_config(tmp_path, tmp_path / "out")
    done = subprocess.run(
        [sys.executable, "-c", CLI_SETUP_SIGNAL, str(config)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_cli_ctrl_c_in_a_jit_run_saves_and_exits_130(tmp_path):
    from resume_fixture import endless_cli_config

    from trainfold.ckpt import is_complete, latest_checkpoint

    config = endless_cli_config(tmp_path, tmp_path / "out")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainfold.cli", "train", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # SIGINT at its default, as in a terminal: under `nohup` or `&` pytest inherits it ignored, and the command
        # rightly keeps an inherited ignored SIGINT (so it would never stop)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    log = tmp_path / "out" / "log.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-2000:]
    latest = latest_checkpoint(tmp_path / "out")
    assert latest is not None and is_complete(latest) and read_metadata(latest)["jit"] is True
    assert '"status": "preempted"' in out
