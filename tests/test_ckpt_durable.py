"""Visible first, durable after: a checkpoint is renamed into place, then fsynced in a thread; rotation waits for it."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.ckpt import (
    SIDECAR_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_path,
    faults,
    is_complete,
    list_checkpoints,
    load,
    read_metadata,
    save,
)
from trainfold.ckpt.atomic import NotDurableError, Syncs, is_durable
from trainfold.ckpt.policy import rotate
from trainfold.ckpt.sharded import Saver
from trainfold.ckpt.sidecar import DURABLE_MARKER, sidecar_bytes
from trainfold.core.state import init_state, scalar
from trainfold.core.tree import flatten
from trainfold.optim import adamw

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _state(step: int = 0, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, attrs.evolve(init_state(model, adamw(1e-3)), step=scalar(step))


def _same(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def _name(fd: int) -> str:
    return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))


@pytest.fixture
def events(monkeypatch):
    """Record every fsync (the path's name) and crash point, in order."""
    seen: list[tuple[str, str]] = []
    real = os.fsync

    def fsync(fd):
        real(fd)
        seen.append(("fsync", _name(fd)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(faults, "fault_hook", lambda label: seen.append(("point", label)))
    return seen


@pytest.fixture
def gate(monkeypatch):
    """An fsync that blocks until ``gate.set()`` (a disk that takes its time)."""
    opened = threading.Event()
    real = os.fsync

    def fsync(fd):
        opened.wait(timeout=30)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield opened
    opened.set()


# --- the order of operations ---


def test_the_directory_is_renamed_into_place_before_any_fsync_then_every_file_dir_and_parent_are_synced(
    tmp_path, events
):
    model, state = _state(3)
    syncs = Syncs()
    path = save(state, tmp_path / "checkpoint-3", model=model, syncs=syncs)
    assert syncs.wait() == [path]
    renamed = events.index(("point", "replace:renamed"))
    assert not [e for e in events[:renamed] if e[0] == "fsync"]  # nothing waited for the disk before the rename
    synced = {name for kind, name in events[renamed:] if kind == "fsync"}
    files = {p.name for p in path.iterdir()}
    assert DURABLE_MARKER in files and DURABLE_MARKER not in synced  # written once the rest is on the disk
    assert (files - {DURABLE_MARKER}) | {"checkpoint-3", tmp_path.name} <= synced
    assert events.index(("point", "durable:synced:checkpoint-3")) > max(
        i for i, e in enumerate(events) if e[0] == "fsync"
    )
    assert is_durable(path)


def test_a_checkpoint_is_marked_durable_only_once_its_fsyncs_end(tmp_path, gate):
    model, state = _state(4)
    syncs = Syncs()
    path = save(state, tmp_path / "checkpoint-4", model=model, syncs=syncs)
    assert is_complete(path) and not is_durable(path)  # visible, its fsyncs held back by the gate
    gate.set()
    syncs.wait()
    assert is_durable(path)
    blocking = save(state, tmp_path / "checkpoint-5", model=model)  # fsynced before the rename: durable when seen
    assert is_durable(blocking)


def test_a_checkpoint_is_complete_and_loads_while_its_fsync_still_runs(tmp_path, gate):
    model, state = _state(5)
    syncs = Syncs()
    path = save(state, tmp_path / "checkpoint-5", model=model, syncs=syncs)
    assert syncs.pending() and is_complete(path)
    assert _same(load(path, like=state), state)
    gate.set()
    assert syncs.wait() == [path] and not syncs.pending()


def test_rotation_deletes_an_older_checkpoint_only_once_the_newer_one_is_durable(tmp_path, gate):
    saver = Saver(fsync="background")
    model, first = _state(1)
    on_commit = functools.partial(lambda _path: rotate(tmp_path, 1))
    gate.set()
    saver.save(first, checkpoint_path(tmp_path, 1), model=model, on_commit=on_commit)
    saver.wait()
    gate.clear()
    saver.save(_state(2, seed=1)[1], checkpoint_path(tmp_path, 2), model=model, on_commit=on_commit)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]  # 2 not durable yet
    time.sleep(0.05)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]
    gate.set()
    saver.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]


def test_the_best_checkpoint_goes_only_once_the_new_best_is_durable(tmp_path, gate):
    saver = Saver(fsync="background")
    model, state = _state(1)
    best = [checkpoint_path(tmp_path, 1)]  # what hf.run.save keeps: the latest and the best
    on_commit = functools.partial(lambda path: rotate(tmp_path, 1, keep=[path, *best]))
    gate.set()
    saver.save(state, checkpoint_path(tmp_path, 1), model=model, on_commit=on_commit)
    saver.save(_state(2)[1], checkpoint_path(tmp_path, 2), model=model, on_commit=on_commit)
    saver.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]  # 1 is the best
    gate.clear()
    best[:] = [checkpoint_path(tmp_path, 3)]  # step 3 is the new best
    saver.save(_state(3)[1], checkpoint_path(tmp_path, 3), model=model, on_commit=on_commit)
    time.sleep(0.05)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    gate.set()
    saver.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]


def test_the_next_save_waits_for_the_previous_checkpoints_fsyncs(tmp_path, events, monkeypatch):
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (time.sleep(0.01), real(fd), events.append(("fsync", _name(fd)))))
    saver = Saver(fsync="background")
    model, state = _state(1)
    saver.save(state, checkpoint_path(tmp_path, 1), model=model)
    saver.save(_state(2)[1], checkpoint_path(tmp_path, 2), model=model)
    saver.wait()
    starts = [i for i, e in enumerate(events) if e == ("point", "save:started")]
    assert events.index(("point", "durable:synced:checkpoint-1")) < starts[1]


def test_saving_over_a_checkpoint_keeps_the_replaced_one_until_the_new_one_is_durable(tmp_path, gate):
    model, old = _state(3, seed=0)
    gate.set()
    save(old, tmp_path / "checkpoint-3", model=model)
    gate.clear()
    new = _state(3, seed=1)[1]
    syncs = Syncs()
    path = save(new, tmp_path / "checkpoint-3", model=model, syncs=syncs)
    (hidden,) = [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-3.")]
    assert _same(load(hidden, like=old), old) and _same(load(path, like=new), new)
    gate.set()
    syncs.wait()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-3"]


def test_a_blocking_save_is_durable_before_it_is_renamed(tmp_path, events):
    model, state = _state(2)
    on_durable = []
    path = save(state, tmp_path / "checkpoint-2", model=model, on_durable=on_durable.append)
    complete = events.index(("point", "save:complete"))
    files = {p.name for p in path.iterdir()} - {DURABLE_MARKER}  # the marker says the rest is synced
    assert files <= {name for kind, name in events[:complete] if kind == "fsync"} and is_durable(path)
    assert on_durable == [path] and not [e for e in events if e[1].startswith("durable:")]


# --- nothing already saved is lost ---

_KILLED = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, {tests!r})
    from test_ckpt_durable import _state
    from trainfold.ckpt import save
    from trainfold.ckpt.atomic import Syncs
    os.fsync = lambda fd: time.sleep(3600)  # the disk never answers before the kill
    model, state = _state(4)
    save(state, sys.argv[1], model=model, syncs=Syncs())
    print("saved", flush=True)
    os._exit(0)  # killed before any fsync ran
    """
)


def test_a_process_killed_before_the_fsync_loses_nothing_it_saved(tmp_path):
    path = tmp_path / "checkpoint-4"
    code = _KILLED.format(tests=str(Path(__file__).resolve().parent))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "saved", out.stderr
    _, state = _state(4)
    assert is_complete(path) and _same(load(path, like=state), state)


# --- a failing background fsync ---


def _failing_fsync(monkeypatch, bad: str):
    real = os.fsync

    def fsync(fd):
        if bad in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_failed_background_fsync_raises_at_the_wait_naming_the_checkpoint_and_keeps_the_older_ones(
    tmp_path, monkeypatch
):
    saver = Saver(fsync="background")
    model, first = _state(1)
    saver.save(first, checkpoint_path(tmp_path, 1), model=model, on_commit=lambda _p: rotate(tmp_path, 1))
    saver.wait()
    _failing_fsync(monkeypatch, "checkpoint-2/model.safetensors")
    second = _state(2, seed=1)[1]
    saver.save(second, checkpoint_path(tmp_path, 2), model=model, on_commit=lambda _p: rotate(tmp_path, 1))
    with pytest.raises(NotDurableError, match=r"checkpoint-2 is written but not durable: the fsync of model"):
        saver.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]  # not rotated
    assert is_durable(checkpoint_path(tmp_path, 1)) and not is_durable(checkpoint_path(tmp_path, 2))
    assert _same(load(checkpoint_path(tmp_path, 1), like=first), first)
    assert _same(load(checkpoint_path(tmp_path, 2), like=second), second)  # still readable here


def test_a_failed_background_fsync_raises_at_the_next_save(tmp_path, monkeypatch):
    saver = Saver(fsync="background")
    model, state = _state(1)
    _failing_fsync(monkeypatch, "checkpoint-1")
    saver.save(state, checkpoint_path(tmp_path, 1), model=model)
    with pytest.raises(NotDurableError, match="checkpoint-1"):
        saver.save(_state(2)[1], checkpoint_path(tmp_path, 2), model=model)
    assert not checkpoint_path(tmp_path, 2).exists()


def test_syncs_refuse_a_sharded_save(tmp_path):
    _, state = _state()
    with pytest.raises(ValueError, match="sharded one"):
        save(state, tmp_path / "c", syncs=Syncs(), tensors=lambda tmp: {})


# --- property: background and blocking saves leave the same checkpoints ---


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3))
def test_background_and_blocking_savers_keep_the_same_checkpoints_with_the_same_bytes(n_saves, limit):
    import tempfile

    kept = {}
    for mode in ("background", "blocking"):
        out = Path(tempfile.mkdtemp())
        saver = Saver(fsync=mode)
        for step in range(1, n_saves + 1):
            model, state = _state(step, seed=step)
            saver.save(state, checkpoint_path(out, step), model=model, on_commit=lambda _p, o=out: rotate(o, limit))
        saver.wait()
        kept[mode] = {
            (p.name, f.name): f.read_bytes() for p in list_checkpoints(out) for f in p.iterdir() if f.name != "x"
        }
    assert kept["background"].keys() == kept["blocking"].keys()
    sidecars = {k for k in kept["background"] if k[1] == "trainfold.json"}
    assert all(kept["background"][k] == kept["blocking"][k] for k in kept["background"] if k not in sidecars)


def test_saver_refuses_an_unknown_fsync_mode():
    with pytest.raises(ValueError, match="fsync"):
        Saver(fsync="later")


# --- train: waits at the end of the run and in the JIT save; the setting ---


def test_train_returns_once_the_last_checkpoint_is_durable_and_rotated(tmp_path, events, monkeypatch):
    from resume_runs import run

    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (time.sleep(0.02), real(fd), events.append(("fsync", _name(fd)))))
    result = run("tinylm", str(tmp_path), None, save_total_limit=1, enable_jit_checkpoint=False)
    assert ("point", "durable:synced:checkpoint-8") in events
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-8"] == [result.last_checkpoint.name]


def test_train_raises_a_failed_background_fsync_naming_the_checkpoint(tmp_path, monkeypatch):
    from resume_runs import run

    _failing_fsync(monkeypatch, "checkpoint-6/state.safetensors")
    with pytest.raises(NotDurableError, match="checkpoint-6 is written but not durable"):
        run("tinylm", str(tmp_path), None, save_total_limit=1, enable_jit_checkpoint=False)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-6"]  # 3 kept


def test_the_jit_save_waits_for_the_previous_checkpoints_fsync_and_is_itself_durable(tmp_path, events, monkeypatch):
    from resume_runs import run

    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (time.sleep(0.02), real(fd), events.append(("fsync", _name(fd)))))

    def sigterm_at_four(state, logs):
        if int(state.step) == 4 and not any(e == ("point", "sent") for e in events):
            events.append(("point", "sent"))
            signal.raise_signal(signal.SIGTERM)

    result = run("tinylm", str(tmp_path), None, [sigterm_at_four], save_steps=3)
    assert (result.status, result.global_step) == ("preempted", 4)
    starts = [i for i, e in enumerate(events) if e == ("point", "save:started")]
    assert events.index(("point", "durable:synced:checkpoint-3")) < starts[-1]  # before the JIT save began
    complete = max(i for i, e in enumerate(events) if e == ("point", "save:complete"))
    jit = checkpoint_path(tmp_path, 4)
    assert read_metadata(jit)["jit"] and {p.name for p in jit.iterdir()} - {DURABLE_MARKER} <= {
        name for kind, name in events[starts[-1] : complete] if kind == "fsync"
    }


def test_save_fsync_blocking_is_the_old_synchronous_save(tmp_path, events):
    from resume_runs import run

    run("tinylm", str(tmp_path), None, save_fsync="blocking", enable_jit_checkpoint=False)
    assert not [e for e in events if e[1].startswith("durable:")]
    completes = [i for i, e in enumerate(events) if e == ("point", "save:complete")]
    assert len(completes) == 3 and all(
        ("fsync", STATE_FILE) in events[start:end] for start, end in zip([0, *completes[:-1]], completes, strict=True)
    )


def test_save_fsync_must_be_one_of_its_modes(tmp_path):
    from resume_runs import run

    with pytest.raises(ValueError, match=r"save_fsync='later' is not one of \['background', 'blocking'\]"):
        run("tinylm", str(tmp_path), None, save_fsync="later")


# --- a checkpoint found damaged by its load: set aside, the previous one resumed (D3) ---


def _damage(path: Path, how: str, *, other: Path | None = None) -> None:
    """Damage ``path``'s state file the way ``how`` says (bit rot, a torn write, a bad copy)."""
    target = path / STATE_FILE
    data = bytearray(target.read_bytes())
    if how == "flipped":
        data[len(data) // 2] ^= 0x40  # the size is right, one byte is not (unsynced blocks after a crash)
    elif how == "header":
        data[0:8] = (len(data) * 3).to_bytes(8, "little")  # the header length rotted
    elif how == "zeroed":
        data = bytearray(len(data))  # same size, all zeros
    elif how == "other-step":
        data = bytearray((other / STATE_FILE).read_bytes())  # a file copied from another checkpoint
    else:
        data = data[: len(data) // 3]
    target.write_bytes(bytes(data))
    meta = read_metadata(path)
    if how in ("truncated", "other-step"):  # the sidecar rewritten for the sizes: only the hash can tell
        meta["files"][STATE_FILE]["bytes"] = len(data)
        (path / SIDECAR_FILE).write_bytes(sidecar_bytes(meta))


def _resume_latest(out: Path):
    """``resume_from_checkpoint=True`` in ``out``: the result, the step of each log, the warnings."""
    from resume_runs import run

    stepped: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(
            "tinylm",
            str(out),
            True,
            [lambda state, logs: stepped.append(int(state.step))],
            save_total_limit=None,
            enable_jit_checkpoint=False,
        )
    return result, stepped, caught


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run's output_dir (checkpoints 3, 6, 8) and its final state."""
    from resume_runs import run

    out = tmp_path_factory.mktemp("straight")
    result = run("tinylm", str(out), None, save_total_limit=None, enable_jit_checkpoint=False)
    return out, flatten(result.state)


@pytest.mark.parametrize("how", ["flipped", "header", "zeroed", "other-step", "truncated"])
def test_resume_latest_sets_a_damaged_checkpoint_aside_by_name_and_resumes_the_previous_one_bitwise(
    tmp_path, straight, how
):
    out = tmp_path / "out"
    shutil.copytree(straight[0], out)
    bad = checkpoint_path(out, 8)
    _damage(bad, how, other=checkpoint_path(out, 6))
    result, stepped, caught = _resume_latest(out)
    said = [str(w.message) for w in caught if f"set {bad} aside" in str(w.message)]
    assert said and "checkpoint-8.damaged" in said[0] and str(bad / STATE_FILE) in said[0], said
    assert stepped[0] == 7 and result.global_step == 8  # resumed from checkpoint-6
    a = flatten(result.state)
    assert all(torch.equal(a[k], v) for k, v in straight[1].items() if k != "metrics.num_items")
    assert (out / "checkpoint-8.damaged" / STATE_FILE).is_file()  # kept, not deleted
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3", "checkpoint-6", "checkpoint-8"]
    load(checkpoint_path(out, 8), like=result.state)  # step 8 saved again, intact


def test_two_damaged_checkpoints_are_both_set_aside_and_the_oldest_intact_one_resumed(tmp_path, straight):
    out = tmp_path / "out"
    shutil.copytree(straight[0], out)
    _damage(checkpoint_path(out, 8), "zeroed")
    _damage(checkpoint_path(out, 6), "flipped")
    result, stepped, caught = _resume_latest(out)
    assert stepped[0] == 4 and result.global_step == 8
    assert sorted(p.name for p in out.glob("*.damaged")) == ["checkpoint-6.damaged", "checkpoint-8.damaged"]


def test_resume_from_a_named_damaged_checkpoint_refuses_it_by_name_and_keeps_it(tmp_path, straight):
    from resume_runs import run

    out = tmp_path / "out"
    shutil.copytree(straight[0], out)
    bad = checkpoint_path(out, 8)
    _damage(bad, "flipped")
    with pytest.raises(CheckpointError, match=rf"{bad / STATE_FILE} is corrupted"):
        run("tinylm", str(out), str(bad), save_total_limit=None, enable_jit_checkpoint=False)
    assert bad.is_dir() and not list(out.glob("*.damaged"))


def test_a_resume_hashes_each_file_of_the_checkpoint_once(tmp_path, straight, monkeypatch):
    from resume_runs import run

    from trainfold.ckpt import tensor_file

    out = tmp_path / "out"
    shutil.copytree(straight[0], out)
    hashed: list[str] = []
    real = tensor_file.digest_of

    def counting(path, *args):
        hashed.append(str(path))
        return real(path, *args)

    monkeypatch.setattr(tensor_file, "digest_of", counting)
    run("tinylm", str(out), True, save_total_limit=None, enable_jit_checkpoint=False)
    newest = checkpoint_path(out, 8)
    files = sorted(str(newest / f) for f in read_metadata(newest)["files"] if f.endswith(".safetensors"))
    assert sorted(hashed) == files  # once each, in the load, before the first step
