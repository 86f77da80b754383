"""A loaded checkpoint's CRC-32s checked in a thread (``trainfold.ckpt.verify``): what ``wait`` says, and when."""

from __future__ import annotations

import threading

import pytest
import torch

from trainfold.ckpt import DURABLE_MARKER, STATE_FILE, CheckpointError, save, verify, verify_later
from trainfold.ckpt.atomic import is_durable
from trainfold.core.state import init_state
from trainfold.optim import adamw


def _checkpoint(tmp_path):
    torch.manual_seed(0)
    return save(init_state(torch.nn.Linear(32, 16), adamw(1e-3)), tmp_path / "checkpoint-0")


def test_an_intact_checkpoint_passes_and_keeps_its_durable_mark(tmp_path):
    path = _checkpoint(tmp_path)
    check = verify_later(path)
    assert check.wait(steps=3, forget_durable=True) is None and check.done() and is_durable(path)


def test_a_flipped_byte_is_named_with_the_steps_run_and_the_durable_mark_goes(tmp_path):
    path = _checkpoint(tmp_path)
    data = bytearray((path / STATE_FILE).read_bytes())
    data[len(data) // 2] ^= 1
    (path / STATE_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{path / STATE_FILE} is corrupted.*stopped after 2 step\(s\) from it"):
        verify_later(path).wait(steps=2, forget_durable=True)
    assert not (path / DURABLE_MARKER).exists()


def test_a_mark_is_kept_unless_asked_and_a_vanished_file_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    (path / STATE_FILE).write_bytes(b"")
    with pytest.raises(CheckpointError, match="state.safetensors has 0 bytes"):
        verify_later(path).wait()
    assert is_durable(path)
    (path / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match="missing or not a plain file"):
        verify_later(path).wait()


def test_a_wait_never_depends_on_a_starved_background_thread(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path)
    starved = threading.Event()
    monkeypatch.setattr(verify, "_yield_to_training", lambda: starved.wait(30))  # it takes no task at all
    check = verify_later(path)
    assert not check.done()
    check.wait()  # the caller's thread runs every task
    assert check.done()
    starved.set()


def test_a_piece_the_background_thread_holds_is_redone_by_the_wait(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path)
    real, held, release = verify._piece, threading.Event(), threading.Event()

    def piece(*args):
        if threading.current_thread().name.startswith("trainfold-verify-"):  # the first piece it takes, forever
            held.set()
            release.wait(30)
        return real(*args)

    monkeypatch.setattr(verify, "_piece", piece)
    check = verify_later(path)
    assert held.wait(10)
    check.wait()  # returns without it: the held piece is CRC'd here too
    data = bytearray((path / STATE_FILE).read_bytes())
    data[-1] ^= 1
    (path / STATE_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupted"):
        verify_later(path).wait()  # and a damaged file is still found with one piece held
    release.set()
