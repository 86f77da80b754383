"""The fast checkpoint paths: CRC-32 combination, threaded reads that check the same CRC, overlapped fsyncs."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.ckpt import crc, tensor_file

# --- crc.combine: concrete examples ---


def test_combine_of_two_pieces_is_the_crc_of_their_concatenation():
    a, b = b"hello, ", b"world"
    assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_with_an_empty_piece_keeps_the_crc():
    assert crc.combine(zlib.crc32(b"abc"), 0, 0) == zlib.crc32(b"abc")
    assert crc.combine(0, zlib.crc32(b"abc"), 3) == zlib.crc32(b"abc")


def test_combine_over_a_large_second_piece():
    a, b = os.urandom(100), os.urandom((1 << 22) + 3)
    assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_all_chains_the_pieces_after_a_starting_crc():
    head, parts = b"header", [b"x" * 7, b"", b"y" * 1000]
    got = crc.combine_all(((zlib.crc32(p), len(p)) for p in parts), zlib.crc32(head))
    assert got == zlib.crc32(head + b"".join(parts))


# --- crc.combine: properties ---


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_equals_zlib_of_the_concatenation(a, b):
    assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=8), st.binary(max_size=50))
def test_combine_all_equals_zlib_of_the_pieces(parts, head):
    got = crc.combine_all(((zlib.crc32(p), len(p)) for p in parts), zlib.crc32(head))
    assert got == zlib.crc32(head + b"".join(parts))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(0, 2**32 - 1))
def test_shifting_a_crc_past_m_then_n_bytes_is_shifting_it_past_m_plus_n(m, n, c):
    # the O(log n) shift composes, at lengths far past what zlib could be run on here
    assert crc.combine(crc.combine(c, 0, m), 0, n) == crc.combine(c, 0, m + n)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 2**32 - 1))
def test_combine_with_zero_bytes_equals_zlib_run_on_them(n, c):
    assert crc.combine(c, zlib.crc32(bytes(n)), n) == zlib.crc32(bytes(n), c)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=20000), st.integers(0, 2**32 - 1))
def test_the_crc32_in_use_is_zlibs_whichever_implementation(data, start):
    # ISA-L's when installed, zlib's otherwise: the stored CRCs must not depend on which
    assert crc.CRC32_BY in ("isal", "zlib")
    assert crc.crc32(data, start) == zlib.crc32(data, start)
    assert crc.crc32(memoryview(data)) == zlib.crc32(data)


# --- crc.combine: errors ---


def test_combine_refuses_a_negative_length():
    with pytest.raises(ValueError, match="len_b must be >= 0"):
        crc.combine(1, 2, -5)


# --- tensor_file.read: threaded, same CRC, same refusals ---


def _big(tmp_path, n_tensors=5, numel=(1 << 21) + 17):
    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(numel) for i in range(n_tensors)}
    tensors["small"] = torch.arange(3, dtype=torch.int64)
    tensors["empty"] = torch.zeros(0)
    path = tmp_path / "big.safetensors"
    size, c = tensor_file.write(path, tensors, fsync=False)
    return path, tensors, size, c


def test_threaded_read_returns_the_tensors_and_checks_the_written_crc(tmp_path):
    path, tensors, size, c = _big(tmp_path)
    assert size > 4 * (1 << 22)  # several pieces: the threaded path
    assert c == zlib.crc32(path.read_bytes())
    out = tensor_file.read(path, crc32=c)
    assert sorted(out) == sorted(tensors)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


def test_threaded_read_refuses_one_flipped_byte_anywhere(tmp_path):
    path, _, size, c = _big(tmp_path)
    data = bytearray(path.read_bytes())
    for where in (size // 3, size - 1):  # in a middle piece, in the last piece
        damaged = bytearray(data)
        damaged[where] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(tensor_file.TensorFileError, match="is corrupted: its CRC-32 is"):
            tensor_file.read(path, crc32=c)


def test_threaded_read_of_a_file_that_shrinks_refuses_it(tmp_path, monkeypatch):
    path, _, _, c = _big(tmp_path)
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: 0 if at > (1 << 23) else real(fd, bufs, at))
    with pytest.raises(tensor_file.TensorFileError, match="ended early"):
        tensor_file.read(path, crc32=c)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=5), st.integers(1, 4096))
def test_read_matches_zlib_for_any_piece_size(tmp_path_factory, sizes, chunk):
    # whatever the piece size (so whichever tensors split across pieces), the CRC is zlib's of the file
    path = tmp_path_factory.mktemp("p") / "t.safetensors"
    tensors = {f"t{i}": torch.arange(n, dtype=torch.float32) for i, n in enumerate(sizes)}
    _, c = tensor_file.write(path, tensors, fsync=False)
    old = tensor_file._CHUNK, tensor_file._WORKERS
    tensor_file._CHUNK, tensor_file._WORKERS = chunk, 4
    try:
        out = tensor_file.read(path, crc32=c)
    finally:
        tensor_file._CHUNK, tensor_file._WORKERS = old
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


# --- save: the tensor files are fsynced in the background, all before the checkpoint is complete ---


def _small_state():
    from trainfold.core.state import init_state
    from trainfold.optim import adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, init_state(model, adamw(1e-3))


def test_save_fsyncs_every_file_before_the_marker_goes_and_the_directory_is_renamed(tmp_path, monkeypatch):
    from trainfold.ckpt import DURABLE_MARKER, faults, is_complete, save

    events: list[tuple[str, str]] = []
    real = os.fsync

    def fsync(fd):
        real(fd)
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(faults, "fault_hook", lambda label: events.append(("point", label)))
    model, state = _small_state()
    path = save(state, tmp_path / "checkpoint-0", model=model)
    assert is_complete(path)
    complete = events.index(("point", "save:complete"))
    synced = {name for kind, name in events[:complete] if kind == "fsync"}
    files = {p.name for p in path.iterdir()} - {DURABLE_MARKER}  # the marker: written once the rest is synced
    assert files <= synced  # every file of the checkpoint, before it is complete
    assert any(name.startswith(".checkpoint-0.tmp-") for name in synced)  # and its directory


def test_a_failed_background_fsync_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
    from trainfold.ckpt import save

    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("model.safetensors"):
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    model, state = _small_state()
    with pytest.raises(OSError, match="Input/output error"):
        save(state, tmp_path / "checkpoint-0", model=model)
    assert list(tmp_path.iterdir()) == []
