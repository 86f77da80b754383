"""The output_dir around the checkpoints: run identity, lock, leftovers, JIT at a saved step, the log file,
sidecar validation (examples, then a Hypothesis mutation property)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
import zlib
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from resume_fixture import collate, model, rows

from trainfold import TrainingArguments, train
from trainfold import ckpt as checkpoint
from trainfold.ckpt import (
    MODEL_FILE,
    SIDECAR_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointWarning,
    checkpoint_path,
    faults,
    list_checkpoints,
    load,
    read_metadata,
    run_dir,
    save,
)
from trainfold.ckpt.policy import rotate
from trainfold.ckpt.run_identity import TRAJECTORY, RunSettings, settings_fingerprint
from trainfold.ckpt.sidecar import sidecar_bytes
from trainfold.core.state import init_state, scalar
from trainfold.core.tree import flatten
from trainfold.observe.history import HISTORY_FILE, LogHistory
from trainfold.optim import adamw

ROOT = Path(__file__).resolve().parents[1]


def args_for(out: Path, **over) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
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
        report_to="none",
        disable_tqdm=True,
    )
    return TrainingArguments(**{**base, **over})


def run(out: Path, *, stop_at: int | None = None, **over):
    stop = (lambda s: int(s.step) >= stop_at) if stop_at is not None else None
    resume = over.pop("resume", None)
    return train(
        model(), args_for(out, **over), rows(), data_collator=collate, stop=stop, resume_from_checkpoint=resume
    )


def assert_same_state(a, b) -> None:
    fa, fb = flatten(a), flatten(b)
    for key in fa:
        if key == "metrics.num_items":
            continue
        assert torch.equal(fa[key], fb[key]), key


def losses(history) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in history if "loss" in h]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run(tmp_path_factory.mktemp("straight"), save_strategy="no")


# -- 1. run identity ------------------------------------------------------------------------------


def test_a_fresh_run_never_resumes_an_older_runs_checkpoint(tmp_path):
    out = tmp_path / "out"
    run(out, learning_rate=1e-3, save_steps=5, max_steps=5)  # an older run, finished: checkpoint-5
    other = r"checkpoints of another run.*learning_rate: 0\.001 there, 0\.01 here.*overwrite_output_dir"
    with pytest.raises(ValueError, match=other):
        run(out, stop_at=2)  # a different run may not mix into it
    with pytest.raises(ValueError, match=r"no complete checkpoint of this run.*checkpoint-5 \(run .*learning_rate"):
        run(out, resume=True)
    r = run(out, stop_at=3, overwrite_output_dir=True)  # preempted at 3, after its checkpoint-2
    assert r.status == "stopped"
    resumed = run(out, resume=True, overwrite_output_dir=True)
    assert resumed.global_step == 8 and resumed.status == "completed"  # from its own checkpoint-2, not 5
    assert losses(resumed.log_history)[0][0] == 1 and [s for s, _ in losses(resumed.log_history)] == list(range(1, 9))
    older, newer = read_metadata(out / "checkpoint-5")["run"], read_metadata(out / "checkpoint-8")["run"]
    assert older["id"] != newer["id"] and older["fingerprint"] != newer["fingerprint"]


def test_the_same_settings_in_a_new_process_are_the_same_run(tmp_path, straight):
    out = tmp_path / "out"
    run(out, stop_at=4, save_steps=4, logging_steps=3)  # saving and logging settings are not the trajectory
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        torch.set_num_threads({torch.get_num_threads()})
        from resume_fixture import collate, model, rows
        from trainfold import TrainingArguments, train
        args = TrainingArguments(output_dir={str(out)!r}, max_steps=8, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=1.0,
            seed=11, logging_steps=1, save_strategy="steps", save_steps=2, report_to="none", disable_tqdm=True)
        r = train(model(), args, rows(), data_collator=collate, resume_from_checkpoint=True)
        assert r.global_step == 8, r.global_step
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=300)
    assert_same_state(load(out / "checkpoint-8", like=straight.state), straight.state)
    ids = {read_metadata(out / f"checkpoint-{s}")["run"]["id"] for s in (4, 8)}
    assert len(ids) == 1  # one lineage across the two processes


def test_a_renamed_checkpoint_or_a_symlink_out_of_the_output_dir_is_never_taken(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    run(out, stop_at=4)
    run(elsewhere, stop_at=6)
    os.rename(out / "checkpoint-4", out / "checkpoint-99")  # its sidecar says step 4
    os.symlink(elsewhere / "checkpoint-6", out / "checkpoint-50")
    with pytest.warns(CheckpointWarning) as caught:
        found = list_checkpoints(out)
    assert [p.name for p in found] == ["checkpoint-2"]
    text = " ".join(str(w.message) for w in caught)
    assert "field 'step' is 4, but the directory's name says step 99" in text and "symbolic link" in text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        fp = read_metadata(out / "checkpoint-2")["run"]["fingerprint"]
        assert run_dir.candidates(out, fp) == [out / "checkpoint-2"]


def test_a_run_continued_for_more_steps_is_the_same_run_with_a_warning(tmp_path):
    out = tmp_path / "out"
    run(out, max_steps=4)
    with pytest.warns(UserWarning, match=r"max_steps 4 -> 8: the run goes on for a different number of steps"):
        r = run(out, resume=True)
    assert r.global_step == 8 and r.status == "completed"


def test_the_fingerprint_covers_every_trajectory_setting_not_seven():
    def fp(**changes):
        return settings_fingerprint(RunSettings.of(args_for(Path("x")).replace(**changes), world_size=1))

    base = fp()
    for key, value in [
        ("learning_rate", 0.5),
        ("weight_decay", 0.0),
        ("seed", 9),
        ("lr_scheduler_type", "cosine"),
        ("optim", "sgd"),
        ("label_smoothing_factor", 0.1),
        ("bf16", True),
        ("warmup_steps", 3),
    ]:
        assert fp(**{key: value}) != base, key
    for key, value in [
        ("logging_steps", 7),
        ("save_steps", 9),
        ("output_dir", "y"),
        ("report_to", ["jsonl"]),
        ("dataloader_num_workers", 2),
        ("overwrite_output_dir", True),
        ("max_steps", 30),
    ]:
        assert fp(**{key: value}) == base, key
    settings = RunSettings.of(args_for(Path("x")), world_size=1)
    assert settings_fingerprint(settings, {"w": torch.zeros(2)}) != base  # the model is part of it


def test_each_setting_declares_on_its_field_whether_it_changes_the_trajectory():
    fields = {f.name: f.metadata.get(TRAJECTORY, True) for f in attrs.fields(TrainingArguments)}
    assert fields["logging_steps"] is False and fields["save_steps"] is False and fields["fsdp"] is False
    assert fields["max_steps"] == fields["num_train_epochs"] == "length"
    assert fields["learning_rate"] is True and fields["gradient_accumulation_steps"] == "samples"
    assert fields["seed"] == fields["dataloader_drop_last"] == "samples"
    settings = RunSettings.of(args_for(Path("x")), world_size=1)
    assert "logging_steps" not in settings.trajectory() and "max_steps" not in settings.trajectory()
    assert settings.trajectory()["world_size"] == 1 and "world_size" in settings.samples  # an extra setting
    assert settings.differences({**settings.values, "logging_steps": 1, "seed": 3}) == [
        f"seed: 3 there, {settings.values['seed']!r} here"
    ]


# -- 1. the lock ---------------------------------------------------------------------------------------


def test_a_second_run_is_refused_with_the_holders_pid_and_host(tmp_path):
    out = tmp_path / "out"
    with run_dir.lock(out):
        with pytest.raises(RuntimeError, match=rf"pid {os.getpid()} on host {socket.gethostname()}"):
            run(out, stop_at=1)
    assert run(out, stop_at=1).global_step == 1  # released: the next run takes it


def test_a_dead_holders_lock_is_taken_over_and_said_so(tmp_path, capfd):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom trainfold.ckpt.run_lock import lock\nwith lock(sys.argv[1]):\n"
            "    print('held', flush=True)\n    time.sleep(60)\n",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RuntimeError, match=f"pid {holder.pid}"):
        run(out, stop_at=1)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    capfd.readouterr()
    assert run(out, stop_at=1).global_step == 1
    assert f"took over the lock of {out} left by pid {holder.pid}" in capfd.readouterr().err


# -- 2. JIT at a step already saved ---------------------------------------------------------------------------


def test_jit_at_a_saved_step_keeps_that_checkpoint_and_marks_it(tmp_path, monkeypatch):
    out = tmp_path / "out"
    written: list[str] = []
    inode: dict[str, int] = {}
    real_save = checkpoint.save

    def counting_save(state, directory, **kw):
        written.append(Path(directory).name)
        path = real_save(state, directory, **kw)
        inode[path.name] = os.stat(path / STATE_FILE).st_ino
        return path

    monkeypatch.setattr("trainfold.ckpt.writer.save", counting_save)
    sent = []

    def preempt_at_4(s):
        if int(s.step) == 4 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return False

    r = train(
        model(),
        args_for(out, enable_jit_checkpoint=True, save_total_limit=1),
        rows(),
        data_collator=collate,
        stop=preempt_at_4,
    )
    assert r.status == "preempted" and r.global_step == 4
    assert written == ["checkpoint-2", "checkpoint-4"]  # not written a second time
    assert os.stat(out / "checkpoint-4" / STATE_FILE).st_ino == inode["checkpoint-4"]
    assert read_metadata(out / "checkpoint-4")["jit"] is True
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-4"]


def _labels_of_a_replace(tmp_path):
    state = attrs.evolve(init_state(torch.nn.Linear(2, 1), adamw(1e-3)), step=scalar(3))
    save(state, checkpoint_path(tmp_path, 3))
    seen = []
    faults.fault_hook = seen.append
    try:
        save(state, checkpoint_path(tmp_path, 3))
    finally:
        faults.fault_hook = None
    return state, seen


def test_a_replace_cut_short_anywhere_leaves_the_checkpoint_or_the_next_claim_puts_it_back(tmp_path):
    state, labels = _labels_of_a_replace(tmp_path / "probe")
    assert labels.index("replace:moved-aside") < labels.index("replace:renamed")  # the old one moves aside first
    for label in labels:
        out = tmp_path / label.replace(":", "_")
        save(state, checkpoint_path(out, 3))

        def crash(at, label=label):
            if at == label:
                raise KeyboardInterrupt(at)  # stands for the kill: nothing after this point runs

        faults.fault_hook = crash
        try:
            with pytest.raises(KeyboardInterrupt):
                save(state, checkpoint_path(out, 3))
        finally:
            faults.fault_hook = None
        if label == "replace:moved-aside":  # between the renames: only the hidden .old- one is there
            assert list_checkpoints(out) == []
            with run_dir.lock(out):
                run_dir.remove_leftovers(out)
        assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"], label
        assert torch.equal(load(checkpoint_path(out, 3), like=state).params["weight"], state.params["weight"])


# -- 3. leftovers ------------------------------------------------------------------------------------------


def test_leftovers_of_dead_writers_are_removed_by_the_next_run_in_one_line(tmp_path, capfd):
    out = tmp_path / "out"
    run(out, stop_at=2)
    state = attrs.evolve(init_state(torch.nn.Linear(2, 1), adamw(1e-3)), step=scalar(5))
    for name in (
        ".checkpoint-4.tmp-999999999-ab12cd34",
        ".checkpoint-4.old-999999999-00ff00ff",
        ".checkpoint-6.deleting-999999999-0a0b0c0d",
        ".checkpoint-8.old-1a2b3c4d",
    ):
        save(state, out / name)
    (out / "checkpoint-2" / ".trainfold.json.tmp-999999999-0f0f0f0f").write_text("{")
    live = out / f".checkpoint-9.tmp-{os.getppid()}-abcdef01"  # a live writer's: kept
    live.mkdir()
    capfd.readouterr()
    run(out, stop_at=3, resume=True)
    err = [line for line in capfd.readouterr().err.splitlines() if "leftover" in line]
    assert len(err) == 1 and "removed 5 leftover(s)" in err[0], err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".checkpoint")) == [live.name]
    assert not list((out / "checkpoint-2").glob(".trainfold.json.tmp-*"))


# -- 4. the log history ------------------------------------------------------------------------------------


def test_the_sidecar_keeps_a_position_not_the_history_and_the_result_reads_the_file(tmp_path, straight):
    out = tmp_path / "out"
    r = run(out)
    meta = read_metadata(out / "checkpoint-8")
    assert "log_history" not in meta["metadata"]
    assert set(meta["metadata"]["log"]) == {"file", "offset", "entries", "crc32"}
    assert isinstance(r.log_history, list) and len(r.log_history) == 9  # 8 steps + the summary
    lines = [json.loads(x) for x in (out / HISTORY_FILE).read_text().splitlines()]
    assert r.log_history == lines and r.log_history[-1] == lines[-1] and r.log_history[2:4] == lines[2:4]
    assert losses(r.log_history) == losses(straight.log_history)
    small = len((out / "checkpoint-2" / SIDECAR_FILE).read_bytes())
    assert len((out / "checkpoint-8" / SIDECAR_FILE).read_bytes()) <= small + 8  # flat in run length


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_history_file_is_kept_aside_its_readable_lines_kept_and_what_was_lost_named(tmp_path, damage):
    out = tmp_path / "out"
    run(out, stop_at=6)
    data = bytearray((out / HISTORY_FILE).read_bytes())
    lines = data.splitlines(keepends=True)
    at = sum(len(x) for x in lines[:3]) + 2  # in the fourth entry (step 4)
    if damage == "flipped":
        data[at] ^= 0x80
    else:
        data = data[:at]
    (out / HISTORY_FILE).write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run(out, resume=True)
    said = [str(w.message) for w in caught if "log history" in str(w.message)]
    assert len(said) == 1 and "kept as log_history.jsonl.damaged" in said[0], said
    assert (out / (HISTORY_FILE + ".damaged")).read_bytes() == bytes(data)  # kept as it was
    if damage == "flipped":  # the lines after the damaged one are kept (issue 44, item 11)
        assert "kept 5 of its 6 entries; dropped line 4, which could not be read" in said[0], said
        kept = [json.loads(x) for x in lines[:3] + lines[4:6]]
    else:
        assert "kept 3 of its 6 entries; lost the last 3 (the file was cut: the logs of steps 4 to 6)" in said[0]
        kept = [json.loads(x) for x in lines[:3]]
    assert list(r.log_history)[: len(kept)] == kept and [h["step"] for h in r.log_history][len(kept) :] == [7, 8, 8]


def test_a_fresh_start_that_dies_before_its_first_checkpoint_leaves_the_older_runs_history(tmp_path, straight):
    """Issue 44, item 11: the fresh start emptied log_history.jsonl at once; the resume that went back to the
    older run's checkpoint then found its history gone."""
    from trainfold.observe.history import PREVIOUS_FILE

    out = tmp_path / "out"
    run(out, stop_at=6)  # checkpoints 2, 4, 6 and their history

    def dies_after_step_1(state):
        if int(state.step) >= 1:
            raise RuntimeError("killed")
        return False

    for _ in range(2):  # a fresh start, and another one, each dead after logging step 1, before any checkpoint
        with pytest.raises(RuntimeError, match="killed"):
            train(
                model(), args_for(out, overwrite_output_dir=True), rows(), data_collator=collate, stop=dies_after_step_1
            )
        assert [json.loads(x)["step"] for x in (out / HISTORY_FILE).read_text().splitlines()] == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not match the log history" warning: nothing was lost
        resumed = run(out, resume=True)
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-8"
    assert losses(resumed.log_history) == losses(straight.log_history)  # steps 1-6 of the older run, then 7, 8
    assert not (out / PREVIOUS_FILE).exists()  # its first checkpoint made the set-aside history unneeded
    r = run(out, stop_at=3, overwrite_output_dir=True, save_steps=2)  # a fresh start that saves: the old history goes
    assert r.global_step == 3 and not (out / PREVIOUS_FILE).exists()
    assert losses(map(json.loads, (out / HISTORY_FILE).read_text().splitlines())) == losses(r.log_history)[:3]


def test_a_resume_continues_the_history_and_the_metric_window_exactly(tmp_path, straight):
    def objective(forward, params, micro, num_items, key):
        from trainfold.core.losses import causal_lm

        inputs = {k: v for k, v in micro.items() if k != "labels"}
        loss = causal_lm(forward(params, inputs), micro["labels"], num_items)
        return loss, {"double": 2 * loss.detach()}

    def go(out, **kw):
        stop_at = kw.pop("stop_at", None)
        return train(
            model(),
            args_for(out, logging_steps=3, save_steps=4, **kw),
            rows(),
            data_collator=collate,
            objective=objective,
            stop=(lambda s: int(s.step) >= stop_at) if stop_at else None,
        )

    ref = go(tmp_path / "ref")
    out = tmp_path / "out"
    go(out, stop_at=5)  # the checkpoint at 4 is mid-window (4..6); entries of step 5's run follow it
    resumed = train(
        model(),
        args_for(out, logging_steps=3, save_steps=4),
        rows(),
        data_collator=collate,
        objective=objective,
        resume_from_checkpoint=True,
    )
    strip = [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k} for h in ref.log_history]
    got = [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k} for h in resumed.log_history]
    assert got[:-1] == strip[:-1]  # every entry, the window means of "double" included, bitwise


# -- 5. sidecar validation: the cases ---------------------------------------------------------------


def _altered(path: Path, **changes) -> None:
    meta = json.loads((path / SIDECAR_FILE).read_text())
    meta.update(changes)
    (path / SIDECAR_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"files": "abc"}, "files"),
        ({"settings": None}, "settings"),
        ({"format_version": "1"}, "format_version"),
        ({"files": {}}, "files.state.safetensors"),
        ({"step": -5}, "step"),
        ({"step": 2**60}, "step"),
        ({"metadata": 5}, "metadata"),
        ({"cursor": {"epoch": 0}}, "cursor"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_malformed_sidecar_is_refused_naming_the_path_and_field(tmp_path, changes, field):
    path = save(attrs.evolve(init_state(torch.nn.Linear(2, 1), adamw(1e-3)), step=scalar(3)), tmp_path / "checkpoint-3")
    _altered(path, **changes)
    with pytest.raises(CheckpointError, match=rf"{path / SIDECAR_FILE}: field '{field}'"):
        read_metadata(path)


def _rewrite(path: Path, meta: dict) -> None:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    (path / SIDECAR_FILE).write_bytes(sidecar_bytes(body))  # crafted with a consistent checksum


def test_a_crafted_step_beyond_the_run_or_a_bad_log_position_is_refused_by_train(tmp_path):
    out = tmp_path / "out"
    run(out, stop_at=2)
    meta = read_metadata(out / "checkpoint-2")
    _rewrite(out / "checkpoint-2", {**meta, "metadata": {**meta["metadata"], "log": 5}})
    with pytest.raises(ValueError, match=rf"checkpoint-2/{SIDECAR_FILE}: field 'metadata.log'"):
        run(out, resume=True)
    big = out / f"checkpoint-{10**15}"
    os.rename(out / "checkpoint-2", big)
    _rewrite(big, {**meta, "step": 10**15})
    with pytest.raises(CheckpointError, match=rf"{big}/{SIDECAR_FILE}: field 'step' is 10+, beyond this run's 8 steps"):
        run(out, resume=True)


def test_a_malformed_sibling_never_crashes_a_resumed_runs_rotation(tmp_path):
    out = tmp_path / "out"
    run(out, stop_at=4, save_total_limit=2)
    (out / "checkpoint-3").mkdir()
    (out / "checkpoint-3" / SIDECAR_FILE).write_text(json.dumps({"format": "trainfold-checkpoint", "files": "abc"}))
    with pytest.warns(CheckpointWarning, match="checkpoint-3"):
        r = run(out, resume=True, save_total_limit=2)
    assert r.global_step == 8 and (out / "checkpoint-3").is_dir()


def test_listing_never_raises_on_foreign_directories(tmp_path):
    save(attrs.evolve(init_state(torch.nn.Linear(2, 1), adamw(1e-3)), step=scalar(1)), tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-2").write_text("a file")
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / SIDECAR_FILE).write_bytes(b"\xff\xfe")
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / SIDECAR_FILE).write_text("[1, 2]")
    with pytest.warns(CheckpointWarning):
        assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]
        assert rotate(tmp_path, 1) == []


# -- 5. the mutation property --------------------------------------------------------------------------------

_SAVED: dict = {}


def _pristine(root: Path):
    if "dir" not in _SAVED:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        state = attrs.evolve(init_state(net, adamw(1e-3), seed=2), step=scalar(7))
        _SAVED["state"] = state
        _SAVED["dir"] = save(
            state,
            root / "pristine" / "checkpoint-7",
            model=net,
            metadata={"note": "x"},
            run={"id": "r1", "fingerprint": "f1"},
        )
    return _SAVED["state"], _SAVED["dir"]


def _json_values():
    leaves = st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=False) | st.text(max_size=4)
    return st.recursive(
        leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=5
    )


def _paths(meta, prefix=()):
    yield prefix
    if isinstance(meta, dict):
        for k, v in meta.items():
            yield from _paths(v, (*prefix, k))


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(["truncate", "flip", "set", "delete", "add", "sidecar-bytes"]))
    target = draw(st.sampled_from([STATE_FILE, MODEL_FILE, SIDECAR_FILE]))
    return kind, target, draw(st.integers(0, 10**6)), draw(_json_values()), draw(st.text(min_size=1, max_size=6))


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=mutations())
def test_a_mutated_checkpoint_loads_bitwise_or_is_refused_naming_the_path(tmp_path, mutation):
    state, pristine = _pristine(tmp_path)
    kind, target, n, value, key = mutation
    _SAVED["n"] = _SAVED.get("n", 0) + 1
    work = tmp_path / f"m{_SAVED['n']}" / "checkpoint-7"
    shutil.rmtree(work.parent, ignore_errors=True)
    shutil.copytree(pristine, work)
    if kind in ("truncate", "flip", "sidecar-bytes"):
        file = work / (SIDECAR_FILE if kind == "sidecar-bytes" else target)
        data = bytearray(file.read_bytes())
        if kind == "truncate":
            data = data[: n % len(data)]
        else:
            data[n % len(data)] ^= 1 << (n % 8)
        file.write_bytes(bytes(data))
    else:
        meta = json.loads((work / SIDECAR_FILE).read_text())
        paths = [p for p in _paths(meta) if p]
        where = paths[n % len(paths)]
        parent = meta
        for k in where[:-1]:
            parent = parent[k]
        if kind == "set":
            if parent[where[-1]] == value:
                return
            parent[where[-1]] = value
        elif kind == "delete":
            del parent[where[-1]]
        else:
            if not isinstance(parent, dict) or key in parent:
                return
            parent[key] = value
        (work / SIDECAR_FILE).write_text(json.dumps(meta))
    try:
        loaded = load(work, like=_SAVED["state"])
    except (ValueError, KeyError, FileNotFoundError) as e:
        assert str(work) in str(e), str(e)
        return
    assert_same_state(loaded, state)  # whatever changed, the state is exactly the saved one
    assert read_metadata(work) == read_metadata(pristine)  # nothing changed that matters, or it was refused


def test_a_results_log_history_survives_a_later_run_in_the_same_directory(tmp_path):
    out = tmp_path / "out"
    first = run(out, save_strategy="no", max_steps=3)
    kept, written = list(first.log_history), (out / HISTORY_FILE).read_bytes()
    second = run(out, save_strategy="no", max_steps=5)  # the same run again: it rewrites log_history.jsonl
    assert list(first.log_history) == kept and len(second.log_history) == 6
    stale = LogHistory(out / HISTORY_FILE, len(written), written.count(b"\n"), zlib.crc32(written))
    with pytest.raises(ValueError, match=f"{out / HISTORY_FILE} changed since this log history was written"):
        list(stale)  # what another process holding the old result would see


# -- 5. small refusals (D9) ----------------------------------------------------------------------------------


def test_an_empty_output_dir_is_refused_by_name_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = attrs.evolve(args_for(tmp_path), output_dir="")
    with pytest.raises(ValueError, match=r"output_dir='' names no directory.*output_dir='out'"):
        train(model(), args, rows(), data_collator=collate)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_directory_holding_another_step_is_refused_naming_both(tmp_path):
    state = attrs.evolve(init_state(torch.nn.Linear(2, 1), adamw(1e-3)), step=scalar(4))
    save(state, checkpoint_path(tmp_path, 4))
    os.rename(checkpoint_path(tmp_path, 4), checkpoint_path(tmp_path, 6))
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint-6/trainfold.json: field 'step' is 4, but the directory's name"
        r" says step 6",
    ):
        load(checkpoint_path(tmp_path, 6), like=state)


def test_every_file_of_a_checkpoint_has_one_mode(tmp_path):
    model_ = torch.nn.Linear(2, 1)
    state = init_state(model_, adamw(1e-3))

    def shards(tmp):  # a writer of its own files (as DCP's storage, which makes them 0600)
        (tmp / "sharded").mkdir()
        (tmp / "sharded/shard-0.safetensors").write_bytes(b"x")
        os.chmod(tmp / "sharded/shard-0.safetensors", 0o600)
        return {"sharded/shard-0.safetensors": {"bytes": 1, "xxh3_64": 0}}

    path = save(state, tmp_path / "c", model=model_, tensors=shards)
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.rglob("*") if p.is_file()}
    assert "shard-0.safetensors" in modes
    assert len(set(modes.values())) == 1, modes


@pytest.mark.parametrize("text", ["{not json", '["a list"]', '{"run_id": 3, "fingerprint": "f00d"}'])
def test_a_damaged_run_file_is_ignored_by_name_and_rewritten(tmp_path, text):
    settings = RunSettings({"learning_rate": 0.1})
    (tmp_path / "trainfold-run.json").write_text(text)
    with pytest.warns(CheckpointWarning, match=r"ignoring .*trainfold-run\.json: it is not JSON with a run_id"):
        with run_dir.claim(tmp_path, None, settings, "f00d") as held:
            pass
    record = json.loads((tmp_path / "trainfold-run.json").read_text())
    assert (record["run_id"], record["fingerprint"]) == (held.run.id, "f00d")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # the rewritten file is read without a word
        with run_dir.claim(tmp_path, None, settings, "f00d"):
            pass
