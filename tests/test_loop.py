"""``trainfold.loop``: hooks fire when their schedules say, in the order of ``loop.EVENTS``; early stopping,
checkpoints kept as ``keep`` says, divergence; a run killed with SIGKILL or stopped by SIGTERM resumes bitwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import ckpt, loop
from trainfold.core.losses import cross_entropy
from trainfold.core.state import init_state
from trainfold.core.tree import flatten
from trainfold.optim import sgd
from trainfold.step import make_step

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loop_runs

RUNNER = str(Path(__file__).resolve().parent / "loop_runs.py")


def _linear(lr: float = 0.1) -> tuple[torch.nn.Module, Any, Any, list[Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    batch = [{"input": torch.ones(4, 3), "labels": torch.tensor([0, 1, 1, 0])}]
    return model, make_step(model, cross_entropy, sgd(lr)), init_state(model, sgd(lr)), batch


def _equal(a: Any, b: Any) -> bool:
    """Every tensor of the two states (params, optimizer state, cursor, extras, metrics) bitwise equal."""
    flat_a, flat_b = flatten(a), flatten(b)
    return flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 7), total=st.integers(0, 20), at_end=st.booleans())
def test_a_hook_fires_every_n_steps_and_at_the_end(n: int, total: int, at_end: bool) -> None:
    model, step, state, batch = _linear()
    fired: list[int] = []
    hook = loop.every(n, lambda state, log: fired.append(log.step), at_end=at_end)
    state, log = loop.run(step, state, [batch] * total, hooks=[hook])
    expected = [s for s in range(1, total + 1) if s % n == 0]
    if at_end and total > 0 and total % n:
        expected.append(total)  # once more after the last step, never twice for one step
    assert fired == expected
    assert log.status == "completed" and int(state.step) == total


def test_hooks_fire_in_the_order_of_the_events_table_step_before_epoch_before_end() -> None:
    model, step, state, data = loop_runs.parts()
    order: list[tuple[int, str]] = []

    def recorder(kind: str) -> loop.Hook:
        def fn(state: Any, log: loop.RunLog) -> None:
            order.append((log.step, kind))
            if kind == "evaluate":
                log.metrics["eval_loss"] = 1.0
                log.evaluations += 1

        return loop.Hook(fn, loop.Every(steps=1, epochs=1, at_end=True), kind=kind, name=f"recorded {kind}")

    def judged(state: Any, log: loop.RunLog) -> None:
        order.append((log.step, "judge"))

    kinds = ["save", "evaluate", "log", "hook"]  # given in the wrong order: the table decides
    by_epoch = loop.every(fn=lambda state, log: order.append((log.step, "by epoch")), epochs=1)
    hooks = [by_epoch, *(recorder(k) for k in kinds), loop.Hook(None, kind="judge", judge=judged)]
    loop.run(step, state, data, hooks=hooks, stop=lambda s: int(s.step) >= 6)
    slots = [slot for phase, slot in loop.EVENTS if phase == "step"]
    assert [k for s, k in order if s == 1] == slots
    assert (
        loop.EVENTS.index(("step", "save")) < loop.EVENTS.index(("epoch", "hook")) < loop.EVENTS.index(("end", "hook"))
    )
    # 40 rows, 8 a step: step 5 closes the first epoch; each hook fires once there, by steps (before epoch ones)
    assert [k for s, k in order if s == 5] == [*slots, "by epoch"]


def test_early_stop_ends_the_run_after_patience_evaluations_without_improvement() -> None:
    model, step, state, batch = _linear(lr=0.0)  # nothing changes: every evaluation ties
    hooks = [
        loop.evaluate(batch, every=2, model=model, loss=cross_entropy),
        loop.early_stop("eval_loss", patience=2),
    ]
    state, log = loop.run(step, state, [batch] * 40, hooks=hooks)
    assert log.status == "stopped" and log.stop_reason == "early_stop"
    assert int(state.step) == 6  # evaluations at 2 (the first counts), 4 and 6 (two without improvement)
    assert int(state.extras["early_stopping"].bad_evals) == 2


def test_a_run_resumed_after_it_stopped_early_stops_before_its_first_step(tmp_path: Path) -> None:
    model, step, state, batch = _linear(lr=0.0)
    hooks = [
        loop.evaluate(batch, every=2, model=model, loss=cross_entropy),
        loop.early_stop("eval_loss", patience=2),
        loop.save(every=2),
    ]
    state, log = loop.run(step, state, lambda s: [batch] * 40, hooks=hooks, output_dir=tmp_path)
    assert (log.status, int(state.step)) == ("stopped", 6)
    again, log = loop.run(
        step, init_state(model, sgd(0.0)), lambda s: [batch] * 40, hooks=hooks, output_dir=tmp_path, resume=True
    )
    assert (log.status, log.stop_reason, int(again.step), log.saved) == ("stopped", "early_stop", 6, [])


def test_save_keeps_the_newest_and_the_best(tmp_path: Path) -> None:
    model, step, state, batch = _linear()
    values = iter([3.0, 1.0, 2.0, 2.5, 2.7, 2.9])

    def scored(state: Any, log: loop.RunLog) -> None:
        log.metrics["eval_score"] = next(values)  # lower is better: step 4 is the best
        log.evaluations += 1

    with pytest.raises(ValueError, match="greater_is_better"):  # a name that does not say which way is better
        loop.save(every=2, best="eval_score")
    hooks = [
        loop.Hook(scored, 2, kind="evaluate"),
        loop.save(every=2, keep=2, best="eval_score", greater_is_better=False),
    ]
    state, log = loop.run(step, state, [batch] * 11, hooks=hooks, output_dir=tmp_path)
    assert [p.name for p in log.saved] == [f"checkpoint-{s}" for s in (2, 4, 6, 8, 10, 11)]
    # keep=2 in all, as HF's save_total_limit: the best one counts, and neither it nor the newest is ever deleted
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-11"]
    assert log.best == tmp_path / "checkpoint-4"
    assert log.status == "completed"
    history = [json.loads(line) for line in (tmp_path / "log_history.jsonl").read_text().splitlines()]
    assert history == log.history


def test_what_cannot_be_done_is_refused_by_name(tmp_path: Path) -> None:
    model, step, state, batch = _linear()
    with pytest.raises(ValueError, match="output_dir"):
        loop.run(step, state, [batch], hooks=[loop.save(every=1)])
    with pytest.raises(TypeError, match="cursor"):
        loop.run(step, state, [batch], output_dir=tmp_path, resume=True)
    with pytest.raises(TypeError, match="not a loop.Hook"):
        loop.run(step, state, [batch], hooks=[print])
    with pytest.raises(ValueError, match="log_mark"):
        loop.run(step, state, [batch], hooks=[loop.log(every=1), loop.log(every=2)])
    with pytest.raises(FileNotFoundError, match="resume=False"):
        loop.run(step, state, lambda s: [batch], output_dir=tmp_path / "empty", resume=True)


def test_a_diverged_run_stops_and_never_saves_the_nonfinite_params(tmp_path: Path) -> None:
    model, step, state, batch = _linear(lr=1e38)
    big = [{"input": torch.full((4, 3), 1e30), "labels": torch.tensor([0, 1, 1, 0])}]
    state, log = loop.run(step, state, [big] * 10, hooks=[loop.save(every=1)], output_dir=tmp_path)
    assert log.status == "diverged" and log.diverged_at is not None and int(state.step) < 10
    for path in ckpt.list_checkpoints(tmp_path):
        loaded = ckpt.load(path, like=state)
        assert all(torch.isfinite(t).all() for t in loaded.params.values())


def test_a_resumed_run_ends_bitwise_equal_to_one_that_never_stopped(tmp_path: Path) -> None:
    whole, whole_log = loop_runs.train(str(tmp_path / "whole"))
    half, half_log = loop_runs.train(str(tmp_path / "half"), steps=10)
    assert half_log.status == "completed" and int(half.step) == 10
    resumed, log = loop_runs.train(str(tmp_path / "half"), resume=True)
    assert log.resumed_from == tmp_path / "half" / "checkpoint-10" and log.history == whole_log.history
    assert _equal(resumed, whole) and int(whole.step) == loop_runs.STEPS


def _held(out: Path, at: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(loop.__file__).parents[2]), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, RUNNER, str(out), "fresh", str(at)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the run is at step `at`, between its hooks: synchronised on its own line
    assert line.strip() == f"held {at}", (line, proc.stderr.read() if proc.stderr else "")
    return proc


def test_a_run_killed_with_sigkill_resumes_bitwise_equal_to_an_uninterrupted_one(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    proc = _held(out, 13)
    proc.kill()  # SIGKILL: no handler runs, the lock and a history past the checkpoint stay behind
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-5", "checkpoint-10"]
    resumed, log = loop_runs.train(str(out), resume=True)
    whole, whole_log = loop_runs.train(str(tmp_path / "whole"))
    assert log.resumed_from == out / "checkpoint-10" and log.status == "completed"
    assert _equal(resumed, whole)
    assert log.history == whole_log.history  # the history past checkpoint-10 was cut back, then written again


def test_sigterm_saves_a_checkpoint_and_ends_the_run_preempted(tmp_path: Path) -> None:
    out = tmp_path / "preempted"
    proc = _held(out, 13)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate("go\n", timeout=120)  # the step's hooks finish, then the run stops
    assert proc.returncode == 143, stderr
    assert "status preempted 13" in stdout
    assert ckpt.read_metadata(out / "checkpoint-13")["jit"] is True
    resumed, log = loop_runs.train(str(out), resume=True)
    whole, _ = loop_runs.train(str(tmp_path / "whole"))
    assert log.resumed_from == out / "checkpoint-13" and _equal(resumed, whole)


def test_a_signal_during_the_last_step_ends_nothing_the_run_completes(tmp_path: Path) -> None:
    out = tmp_path / "last"
    proc = _held(out, loop_runs.STEPS)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, stderr
    assert f"status completed {loop_runs.STEPS}" in stdout
    assert ckpt.read_metadata(out / f"checkpoint-{loop_runs.STEPS}")["jit"] is False  # the run's own last save


def test_what_changes_during_an_hf_run_lives_in_a_mutable_record_not_in_the_frozen_run() -> None:
    import attrs

    from trainfold.trainer.run import Run

    fields = attrs.fields_dict(Run)
    assert not {"saved", "diverged"} & set(fields)  # were lists mutated inside the frozen Run (5 sites)
    record = fields["record"].default.factory()
    assert isinstance(record, loop.RunLog)
    record.saved.append(Path("checkpoint-1"))
    record.diverged_at = 3  # a plain attrs.define: assignment is how it changes
    assert (record.saved, record.diverged_at) == ([Path("checkpoint-1")], 3)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Run.__setattr__(object.__new__(Run), "record", record)


def test_an_epochs_schedule_fires_when_the_stream_closes_every_nth_epoch() -> None:
    model, step, state, data = loop_runs.parts()  # 40 rows, 8 a step: 5 steps an epoch
    fired: list[tuple[int, int]] = []
    hook = loop.every(fn=lambda state, log: fired.append((log.step, int(state.cursor.epoch))), epochs=2)
    state, log = loop.run(step, state, data, hooks=[hook], stop=lambda s: int(s.step) >= 22)
    assert fired == [(10, 2), (20, 4)]


def test_log_entries_go_to_the_history_and_to_each_reporter() -> None:
    model, step, state, batch = _linear()
    got: list[dict[str, Any]] = []

    class Reporter:
        def log(self, entry: dict[str, Any], step: int) -> None:
            got.append({**entry, "reported_at": step})

    state, log = loop.run(step, state, [batch] * 5, hooks=[loop.log(every=2, to=[Reporter()])])
    assert [e["step"] for e in log.history] == [2, 4, 5]  # and the window that the end closes
    assert [e["reported_at"] for e in got] == [2, 4, 5] and all(e["loss"] > 0 for e in got)


def test_a_run_with_other_settings_is_refused_the_directory_naming_them(tmp_path: Path) -> None:
    model, step, state, batch = _linear()
    loop.run(step, state, [batch] * 2, hooks=[loop.save(every=1)], output_dir=tmp_path, settings={"lr": 0.1})
    with pytest.raises(ValueError, match="lr"):
        loop.run(step, state, [batch] * 2, hooks=[loop.save(every=1)], output_dir=tmp_path, settings={"lr": 0.2})


def _recorded(order: list[tuple[int, str]], name: str, **options: Any) -> loop.Hook:
    return loop.Hook(lambda state, log: order.append((log.step, name)), name=name, **options)


def test_a_step_closes_an_epoch_when_the_run_or_a_hook_says_so_and_the_after_slot_follows_the_epoch() -> None:
    model, step, state, batch = _linear()  # a list of batches: its cursor never enters another epoch
    order: list[tuple[int, str]] = []

    def early(state: Any, log: loop.RunLog) -> None:
        if log.step == 2:
            log.close_epoch()  # as HF's early stopping closes the epoch it fires in

    hooks = [
        _recorded(order, "after", every=loop.Every(steps=1), kind="after"),
        _recorded(order, "epoch", every=loop.Every(epochs=1)),
        loop.Hook(early, 1),
    ]
    loop.run(step, state, [batch] * 5, hooks=hooks, epoch_closed=lambda s: int(s.step) == 4)
    assert order == [(1, "after"), (2, "epoch"), (2, "after"), (3, "after"), (4, "epoch"), (4, "after"), (5, "after")]
    events = loop.EVENTS
    assert events.index(("epoch", "save")) < events.index(("after", "after")) < events.index(("end", "hook"))


def test_after_a_diverged_step_only_hooks_declared_after_divergence_fire() -> None:
    import attrs

    model, step, state, batch = _linear()
    nan = float("nan")

    def breaking(state: Any, batch: Any) -> Any:  # the third step's update turns the params NaN
        state = step(state, batch)
        if int(state.step) < 3:
            return state
        return attrs.evolve(
            state, params={k: v * nan for k, v in state.params.items()}, metrics={**state.metrics, "loss": nan}
        )

    order: list[tuple[int, str]] = []
    hooks = [
        _recorded(order, "plain", every=1),
        _recorded(order, "declared", every=1, after_divergence=True),
        _recorded(order, "after", every=1, kind="after"),  # the after slot fires by default, as the log does
        _recorded(order, "no after", every=1, kind="after", after_divergence=False),
    ]
    state, log = loop.run(breaking, state, [batch] * 10, hooks=hooks)
    assert (log.status, log.diverged_at, int(state.step)) == ("diverged", 3, 3)
    assert [name for s, name in order if s == 2] == ["plain", "declared", "after", "no after"]
    assert [name for s, name in order if s == 3] == ["declared", "after"]


def test_a_status_function_tells_how_the_run_ended() -> None:
    model, step, state, batch = _linear()
    seen: list[int] = []
    state, log = loop.run(
        step,
        state,
        [batch] * 5,
        hooks=[_recorded([], "end", every=loop.Every(at_end=True))],
        stop=lambda s: int(s.step) >= 3,
        status=lambda state, log: seen.append(int(state.step)) or "stopped",
    )
    assert (log.status, seen, int(state.step)) == ("stopped", [3], 3)
