"""Durable when saved: every file, then the directory, fsynced before the rename; the parent after; rotation after."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import attrs
import pytest
import torch

from trainfold.ckpt import (
    SIDECAR_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_path,
    faults,
    list_checkpoints,
    load,
    read_metadata,
    save,
)
from trainfold.ckpt.policy import rotate
from trainfold.ckpt.sharded import Saver
from trainfold.ckpt.sidecar import sidecar_bytes
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


def _synced(events, start: int, end: int) -> set[str]:
    return {name for kind, name in events[start:end] if kind == "fsync"}


# --- the order of operations ---


def test_every_file_and_directory_is_fsynced_before_the_rename_and_the_parent_after(tmp_path, events):
    model, state = _state(3)

    def tokenizer_files(tmp):  # files the sidecar does not list (a tokenizer's save_pretrained)
        (tmp / "tokenizer.json").write_text("{}")

    path = save(state, tmp_path / "checkpoint-3", model=model, extra_files=tokenizer_files)
    renamed = events.index(("point", "replace:renamed"))
    files = {p.name for p in path.iterdir()}
    assert "tokenizer.json" in files and files <= _synced(events, 0, renamed)
    assert any(name.startswith(".checkpoint-3.tmp-") for name in _synced(events, 0, renamed))  # its directory
    assert ("fsync", tmp_path.name) in events[renamed:]  # the rename itself, once it is done
    assert events[-1] == ("fsync", tmp_path.name)  # the last act: save returns with the checkpoint on the disk


def test_saving_over_a_checkpoint_swaps_it_after_the_new_one_is_on_the_disk(tmp_path, events):
    model, old = _state(3, seed=0)
    save(old, tmp_path / "checkpoint-3", model=model)
    del events[:]
    new = _state(3, seed=1)[1]
    path = save(new, tmp_path / "checkpoint-3", model=model)
    labels = [label for kind, label in events if kind == "point"]
    assert labels[-4:] == ["save:complete", "replace:moved-aside", "replace:renamed", "replace:removed"]
    assert {p.name for p in path.iterdir()} <= _synced(events, 0, events.index(("point", "save:complete")))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-3"] and _same(load(path, like=new), new)


@pytest.mark.parametrize("async_save", [False, True])
def test_the_saver_rotates_only_once_the_newer_checkpoint_is_on_the_disk(tmp_path, events, async_save):
    saver = Saver(async_save=async_save)
    model, state = _state(1)
    for step in (1, 2):
        path = checkpoint_path(tmp_path, step)
        saver.save(attrs.evolve(state, step=scalar(step)), path, model=model, on_commit=lambda _p: rotate(tmp_path, 1))
    saver.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    rotated = events.index(("point", "rotate:before:checkpoint-1"))
    parent = max(i for i, e in enumerate(events[:rotated]) if e == ("fsync", tmp_path.name))
    assert parent > events.index(("point", "replace:renamed"), events.index(("point", "save:started"), 1))
    assert {p.name for p in path.iterdir()} <= _synced(events, 0, rotated)


# --- a failing fsync, a kill while the fsyncs run ---


def _failing_fsync(monkeypatch, bad: str):
    real = os.fsync

    def fsync(fd):
        if bad in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_fsync_fails_the_save_by_path_and_keeps_the_older_checkpoints(tmp_path, monkeypatch, async_save):
    saver = Saver(async_save=async_save)
    model, first = _state(1)
    saver.save(first, checkpoint_path(tmp_path, 1), model=model, on_commit=lambda _p: rotate(tmp_path, 1))
    saver.wait()
    _failing_fsync(monkeypatch, "model.safetensors")
    second = _state(2, seed=1)[1]
    with pytest.raises(OSError, match=r"fsync failed \(Input/output error\); check the disk.*checkpoint-2\.tmp-"):
        saver.save(second, checkpoint_path(tmp_path, 2), model=model, on_commit=lambda _p: rotate(tmp_path, 1))
        saver.wait()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]  # not rotated, no temporary left
    assert _same(load(checkpoint_path(tmp_path, 1), like=first), first)


_KILLED = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from test_ckpt_durable import _state
    from trainfold.ckpt import save
    model, state = _state(3)
    save(state, sys.argv[1] + "/checkpoint-3", model=model)
    def fsync(fd):
        print("syncing", flush=True)
        time.sleep(3600)  # the disk never answers before the kill
    os.fsync = fsync
    save(_state(4, seed=1)[1], sys.argv[1] + "/checkpoint-4", model=model)
    """
)


def test_a_process_killed_while_the_fsyncs_run_leaves_the_previous_checkpoint(tmp_path):
    code = _KILLED.format(tests=str(Path(__file__).resolve().parent))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "syncing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    _, state = _state(3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]  # 4 was never put into place
    assert _same(load(checkpoint_path(tmp_path, 3), like=state), state)


# --- train: every checkpoint fsynced before its rename; the setting that chose otherwise is gone ---


def test_train_fsyncs_each_checkpoint_before_its_rename_and_rotates_after(tmp_path, events):
    from resume_runs import run

    result = run("tinylm", str(tmp_path), None, save_total_limit=1, enable_jit_checkpoint=False)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-8"] == [result.last_checkpoint.name]
    completes = [i for i, e in enumerate(events) if e == ("point", "save:complete")]
    assert len(completes) == 3 and all(
        ("fsync", STATE_FILE) in events[start:end] for start, end in zip([0, *completes[:-1]], completes, strict=True)
    )
    assert events.index(("point", "rotate:before:checkpoint-3")) > completes[1]


def test_train_raises_a_failed_fsync_naming_the_checkpoint(tmp_path, monkeypatch):
    from resume_runs import run

    _failing_fsync(monkeypatch, "checkpoint-6.tmp-")
    with pytest.raises(OSError, match=r"fsync failed.*checkpoint-6\.tmp-"):
        run("tinylm", str(tmp_path), None, save_total_limit=1, enable_jit_checkpoint=False)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]  # kept: 6 never took its place


def test_the_jit_save_is_fsynced_before_its_rename(tmp_path, events):
    from resume_runs import run

    def sigterm_at_four(state, logs):
        if int(state.step) == 4 and not any(e == ("point", "sent") for e in events):
            events.append(("point", "sent"))
            signal.raise_signal(signal.SIGTERM)

    result = run("tinylm", str(tmp_path), None, [sigterm_at_four], save_steps=3)
    assert (result.status, result.global_step) == ("preempted", 4)
    starts = [i for i, e in enumerate(events) if e == ("point", "save:started")]
    complete = max(i for i, e in enumerate(events) if e == ("point", "save:complete"))
    jit = checkpoint_path(tmp_path, 4)
    assert read_metadata(jit)["jit"] and {p.name for p in jit.iterdir()} <= _synced(events, starts[-1], complete)


def test_save_fsync_is_refused_by_name_saying_checkpoints_are_always_fsynced(tmp_path):
    from resume_runs import run

    for mode in ("background", "blocking"):
        with pytest.raises(
            TypeError,
            match=rf"save_fsync='{mode}' was removed from trainfold: checkpoints are now "
            "always fsynced before they are renamed into place; drop the argument",
        ):
            run("tinylm", str(tmp_path), None, save_fsync=mode)


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

    def counting(real):
        def hashing(path, *args):
            hashed.append(str(path))
            return real(path, *args)

        return hashing

    for name in ("digest_of", "read"):  # each hashes the file it is given (read: over the tensors it returns)
        monkeypatch.setattr(tensor_file, name, counting(getattr(tensor_file, name)))
    run("tinylm", str(out), True, save_total_limit=None, enable_jit_checkpoint=False)
    newest = checkpoint_path(out, 8)
    files = sorted(str(newest / f) for f in read_metadata(newest)["files"] if f.endswith(".safetensors"))
    assert sorted(hashed) == files  # once each, in the load, before the first step


# --- every file the sidecar lists is checked on load; a damaged checkpoint is kept until the user removes it ---


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # same size: only the hash can tell
    path.write_bytes(bytes(data))


def test_a_damaged_config_json_fails_the_load_by_name(tmp_path):
    from trainfold.ckpt import CONFIG_FILE
    from trainfold.ckpt.tensor_file import TensorFileError
    from trainfold.core.models import TinyLM, TinyLMConfig

    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    state = init_state(model, adamw(1e-3))
    path = save(state, tmp_path / "checkpoint-0", model=model)
    assert CONFIG_FILE in read_metadata(path)["files"]  # hashed when written
    _flip(path / CONFIG_FILE)  # was loaded without a look: from_pretrained(checkpoint) then read the damaged config
    with pytest.raises(TensorFileError, match=rf"{path / CONFIG_FILE} is corrupted: its xxh3_64 is"):
        load(path, like=state)
    (path / CONFIG_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{path / CONFIG_FILE} is missing .*, though {SIDECAR_FILE} lists it"):
        load(path, like=state)


def test_a_damaged_consolidated_model_of_a_sharded_checkpoint_fails_the_load_by_name(tmp_path):
    from trainfold.ckpt import MODEL_FILE
    from trainfold.ckpt.sharded import save_sharded
    from trainfold.ckpt.tensor_file import TensorFileError
    from trainfold.core.models import TinyLM, TinyLMConfig

    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    state = init_state(model, adamw(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's, without a process group
        path = save_sharded(state, tmp_path / "checkpoint-0", model=model, consolidate=True)
        load(path, like=state)  # intact: loads
        _flip(path / MODEL_FILE)  # the shards are intact: the load read them only
        with pytest.raises(TensorFileError, match=rf"{path / MODEL_FILE} is corrupted: its xxh3_64 is"):
            load(path, like=state)


def test_a_truncated_checkpoint_is_set_aside_and_kept_not_saved_over(tmp_path, straight):
    out = tmp_path / "out"
    shutil.copytree(straight[0], out)
    bad = checkpoint_path(out, 8)
    data = (bad / STATE_FILE).read_bytes()
    (bad / STATE_FILE).write_bytes(data[: len(data) // 3])  # the sidecar's size disagrees: listing skips it
    result, stepped, caught = _resume_latest(out)
    assert stepped[0] == 7 and result.global_step == 8  # resumed from checkpoint-6
    assert [str(w.message) for w in caught if f"set {bad} aside as checkpoint-8.damaged" in str(w.message)]
    kept = out / "checkpoint-8.damaged" / STATE_FILE
    assert kept.read_bytes() == data[: len(data) // 3]  # was deleted when the resumed run saved step 8 over it
    load(checkpoint_path(out, 8), like=result.state)  # step 8 saved again, intact
