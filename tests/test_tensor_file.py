"""tensor_file: safetensors files with a hash computed while writing and checked in one streaming pass."""

from __future__ import annotations

import errno
import itertools
import os

import attrs
import pytest
import safetensors.torch
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError

from trainfold.ckpt import load, save, tensor_file
from trainfold.core.state import init_state, scalar
from trainfold.core.tree import flatten
from trainfold.optim import adamw


def _tensors(numel=(1 << 21) + 17):
    torch.manual_seed(0)
    return {"t0": torch.randn(numel), "t1": torch.randn(numel), "small": torch.arange(3), "empty": torch.zeros(0)}


def test_the_entry_is_the_files_size_and_xxh3_and_the_read_returns_the_tensors(tmp_path):
    path, tensors = tmp_path / "t.safetensors", _tensors()
    entry = tensor_file.write(path, tensors)
    data, chunk = path.read_bytes(), 16 << 20
    assert len(data) > chunk  # two chunks, the second partial
    digests = b"".join(
        xxhash.xxh3_64_intdigest(data[i : i + chunk]).to_bytes(8, "little") for i in range(0, len(data), chunk)
    )
    assert entry == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_intdigest(digests)}
    assert tensor_file.digest_of(path, None) == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_intdigest(data)}
    out = tensor_file.read(path, entry)
    assert sorted(out) == sorted(tensors) and all(torch.equal(out[k], v) for k, v in tensors.items())
    theirs = safetensors.torch.load_file(path)  # a plain safetensors file
    assert all(torch.equal(theirs[k], v) for k, v in tensors.items())


def test_a_file_of_one_chunk_hashes_as_itself_in_both_formats(tmp_path):
    path = tmp_path / "t.safetensors"
    entry = tensor_file.write(path, {"w": torch.arange(1 << 20, dtype=torch.float32)})  # 4 MiB
    assert entry["xxh3_64"] == xxhash.xxh3_64_intdigest(path.read_bytes())
    assert tensor_file.digest_of(path, None) == entry == tensor_file.digest_of(path, 8 << 20)


@pytest.mark.parametrize("offset", [0, (16 << 20) - 1, 16 << 20, -1])
def test_a_flipped_bit_in_any_chunk_is_refused_by_name(tmp_path, offset):
    path = tmp_path / "t.safetensors"
    entry = tensor_file.write(path, _tensors())
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    cause = "safetensors cannot read it" if offset == 0 else "its xxh3_64 is"  # the header's length, or the data
    with pytest.raises(tensor_file.TensorFileError, match=f"{path} is corrupted: {cause}"):
        tensor_file.read(path, entry)


def test_two_names_sharing_storage_are_each_written_in_full(tmp_path):
    base = torch.arange(6.0)
    entry = tensor_file.write(tmp_path / "t.safetensors", {"a": base, "b": base[2:], "c": base.view(2, 3).t()})
    out = tensor_file.read(tmp_path / "t.safetensors", entry)
    assert out["b"].tolist() == [2.0, 3.0, 4.0, 5.0] and out["c"].tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


@settings(max_examples=20, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_one_flipped_bit_anywhere_is_refused_by_name(tmp_path_factory, where, bit):
    path = tmp_path_factory.mktemp("flip") / "t.safetensors"
    entry = tensor_file.write(path, {"w": torch.arange(40.0), "n": torch.tensor(3)})
    data = bytearray(path.read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    path.write_bytes(bytes(data))
    with pytest.raises(tensor_file.TensorFileError, match=f"{path} is corrupted: (its xxh3_64 is|safetensors cannot)"):
        tensor_file.read(path, entry)


def test_a_truncated_file_is_refused_by_its_size_before_it_is_hashed(tmp_path, monkeypatch):
    path = tmp_path / "t.safetensors"
    entry = tensor_file.write(path, {"w": torch.arange(40.0)})
    path.write_bytes(path.read_bytes()[:-4])
    monkeypatch.setattr(tensor_file, "_hash", lambda *a: pytest.fail("hashed a file of the wrong size"))
    with pytest.raises(tensor_file.TensorFileError, match=f"{path} is truncated or altered: it has"):
        tensor_file.read(path, entry)


def test_a_load_hashes_each_file_once_in_one_pass(tmp_path, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    state = attrs.evolve(init_state(model, adamw(1e-3)), step=scalar(3))
    path = save(state, tmp_path / "checkpoint-3", model=model)
    hashed: list[int] = []
    real = tensor_file._hash
    monkeypatch.setattr(
        tensor_file, "_hash", lambda pieces, *a: hashed.append(sum(map(len, pieces))) or real(pieces, *a)
    )
    monkeypatch.setattr(tensor_file, "digest_of", lambda *a: pytest.fail("read the file again to hash it"))
    loaded = load(path, like=init_state(model, adamw(1e-3)))
    assert sorted(hashed) == sorted(os.path.getsize(path / n) for n in ("model.safetensors", "state.safetensors"))
    a, b = flatten(loaded), flatten(state)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_load_never_touches_the_template(tmp_path):
    model = torch.nn.Linear(3, 2)
    saved = attrs.evolve(init_state(model, adamw(1e-3)), params={"weight": torch.ones(2, 3), "bias": torch.ones(2)})
    path = save(saved, tmp_path / "c", model=model)
    like = init_state(torch.nn.Linear(3, 2), adamw(1e-3))
    before = {k: (v.clone(), v._version) for k, v in flatten(like).items()}
    loaded = load(path, like=like)
    assert all(torch.equal(v, before[k][0]) and v._version == before[k][1] for k, v in flatten(like).items())
    assert torch.equal(loaded.params["weight"], torch.ones(2, 3))


# --- save: every file is fsynced before the checkpoint is complete ---


def _small_state():
    from trainfold.core.state import init_state
    from trainfold.optim import adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, init_state(model, adamw(1e-3))


def test_save_fsyncs_every_file_before_the_marker_goes_and_the_directory_is_renamed(tmp_path, monkeypatch):
    from trainfold.ckpt import faults, is_complete, save

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
    files = {p.name for p in path.iterdir()}
    assert files <= synced  # every file of the checkpoint, before it is complete
    assert any(name.startswith(".checkpoint-0.tmp-") for name in synced)  # and its directory


def test_a_failed_fsync_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
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


@pytest.mark.parametrize("size", [0, 5, (16 << 20) + 3])
def test_the_entry_of_bytes_is_that_of_a_file_holding_them(tmp_path, size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)  # a config.json's, or any other file's
    chunk = 16 << 20
    digests = b"".join(
        xxhash.xxh3_64_intdigest(data[i : i + chunk]).to_bytes(8, "little") for i in range(0, size, chunk)
    )
    whole = xxhash.xxh3_64_intdigest(digests if size > chunk else data)
    assert tensor_file.entry_of(data) == {"bytes": size, "xxh3_64": whole}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EACCES])
def test_an_io_error_inside_safetensors_is_an_oserror_with_its_errno(tmp_path, monkeypatch, code):
    from trainfold.ckpt.writer import is_disk_full

    message = f'Error while serializing: IoError(Os {{ code: {code}, kind: Other, message: "failed" }})'
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(SafetensorError(message)))
    with pytest.raises(OSError) as caught:
        tensor_file.write(tmp_path / "t.safetensors", {"w": torch.ones(2)})
    assert caught.value.errno == code and caught.value.filename == str(tmp_path / "t.safetensors")
    assert is_disk_full(caught.value) == (code != errno.EACCES)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=6),
    chunk=st.sampled_from([None, 1, 7, 64, 4096]),
)
def test_the_hash_of_pieces_is_that_of_their_bytes_end_to_end_however_they_are_cut(data, cuts, chunk):
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    pieces = [memoryview(data)[a:b] for a, b in itertools.pairwise(bounds)]
    assert tensor_file._hash(pieces, chunk) == tensor_file._hash([memoryview(data)], chunk)
    if chunk is None or len(data) <= chunk:
        assert tensor_file._hash(pieces, chunk) == xxhash.xxh3_64_intdigest(data)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.float64]


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 40), max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=6, max_size=6),
    chunk=st.sampled_from([64, 1000, 4096, None]),
)
def test_a_read_hashes_the_returned_tensors_as_the_file_is_hashed(tmp_path_factory, shapes, dtypes, chunk):
    torch.manual_seed(0)
    tensors = {f"t{i}": (torch.rand(s) * 100).to(d) for i, (s, d) in enumerate(zip(shapes, dtypes))}
    path = tmp_path_factory.mktemp("read") / "t.safetensors"
    tensor_file.write(path, tensors)
    out = tensor_file.read(path, tensor_file.digest_of(path, chunk), chunk)  # refused if the two hashes differ
    assert sorted(out) == sorted(tensors) and all(torch.equal(out[k], v) for k, v in tensors.items())
