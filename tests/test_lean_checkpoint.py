"""Lean checkpoints (issue 22): each tensor written once, CRCs computed while writing, old formats still resume."""

from __future__ import annotations

import json
import os
import warnings
import zlib
from pathlib import Path

import attrs
import pytest
import safetensors.torch
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import ckpt as checkpoint
from trainfold.ckpt import MODEL_FILE, SIDECAR_FILE, STATE_FILE, CheckpointError, load, read_metadata, save, tensor_file
from trainfold.ckpt.sidecar import sidecar_bytes
from trainfold.core.state import init_state, scalar
from trainfold.core.tree import flatten
from trainfold.optim import adamw

transformers = pytest.importorskip("transformers")


def llama(seed: int = 0, tie: bool = False):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def trained_state(model, seed: int = 1):
    """The model's state with AdamW moments and params moved, as after some steps."""
    state = init_state(model, adamw(1e-3), seed=seed)
    g = torch.Generator().manual_seed(seed)
    noise = lambda tree: {k: torch.randn(v.shape, generator=g) for k, v in tree.items()}
    params = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.params.items()}
    opt = attrs.evolve(state.opt_state, mu=noise(state.opt_state.mu), nu=noise(state.opt_state.nu))
    return attrs.evolve(state, params=params, opt_state=opt, step=scalar(5))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def assert_states_equal(a, b) -> None:
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and torch.equal(fa[k], fb[k]), k


# -- the weights are written once -----------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_the_weights_are_written_once_and_load_back_bitwise(tmp_path, tie):
    model = llama(tie=tie)
    state = trained_state(model)
    path = save(state, tmp_path / "c", model=model)
    in_state = safetensors.torch.load_file(path / STATE_FILE)
    in_model = safetensors.torch.load_file(path / MODEL_FILE)
    assert not any(k.startswith("params.") for k in in_state)  # no param in the state file
    tied_alias = {"lm_head.weight"} if tie else set()
    assert sorted(in_model) == sorted(set(model.state_dict()) - tied_alias)  # HF's names, a tied weight once
    assert nbytes(in_state) + nbytes(in_model) == nbytes(flatten(state))  # every tensor once, none twice
    meta = read_metadata(path)
    assert meta["format_version"] == 5 and meta["frozen"] == {}
    assert sorted(meta["tensors"][MODEL_FILE]) == sorted(f"params.{k}" for k in state.params)
    loaded = load(path, like=init_state(llama(seed=3, tie=tie), adamw(1e-3)))
    assert_states_equal(loaded, state)


def test_non_persistent_buffers_stay_in_the_state_file(tmp_path):
    model = llama()
    model.register_buffer("scratch", torch.arange(3.0), persistent=False)
    state = init_state(model, adamw(1e-3))
    path = save(state, tmp_path / "c", model=model)
    assert "buffers.scratch" in safetensors.torch.load_file(path / STATE_FILE)
    assert "scratch" not in safetensors.torch.load_file(path / MODEL_FILE)
    assert_states_equal(load(path, like=state), state)


def test_checkpoint_bytes_are_the_trainers_for_the_same_model_and_optimizer(tmp_path):
    model = llama()
    data = [{"input_ids": r, "labels": r} for r in torch.randint(0, 256, (4, 8), generator=torch.Generator())]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=1,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=1,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
    hf = sum(p.stat().st_size for p in (tmp_path / "hf" / "checkpoint-1").iterdir())
    ours = save(trained_state(model), tmp_path / "tf" / "checkpoint-1", model=model)
    mine = sum(p.stat().st_size for p in ours.iterdir())
    # the same tensors (params, both moments); the Trainer's extra small files (rng, args, state json) differ
    assert hf - 64_000 < mine <= hf, (mine, hf)
    tensors = nbytes(flatten(trained_state(model)))
    assert mine - tensors < 16_000  # headers, config and sidecar: a few kB


# -- hashes are the files', computed while writing ---------------------------------------------------------


def test_the_recorded_hash_and_size_are_the_files(tmp_path):
    model = llama()
    path = save(trained_state(model), tmp_path / "c", model=model)
    files = read_metadata(path)["files"]
    assert sorted(files) == ["config.json", MODEL_FILE, STATE_FILE]
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_intdigest(data)}, name


def test_a_save_hashes_each_tensor_file_once_before_its_fsync(tmp_path, monkeypatch):
    events: list[str] = []
    real_digest, real_fsync = tensor_file.digest_of, os.fsync
    monkeypatch.setattr(
        tensor_file, "digest_of", lambda p, *a: events.append(f"hash {Path(p).name}") or real_digest(p, *a)
    )
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: events.append(f"fsync {os.path.basename(os.readlink(f'/proc/self/fd/{fd}'))}") or real_fsync(fd),
    )
    model = llama()
    save(trained_state(model), tmp_path / "c", model=model)
    for name in (STATE_FILE, MODEL_FILE):
        assert events.count(f"hash {name}") == 1 and events.index(f"hash {name}") < events.index(f"fsync {name}")


@settings(max_examples=25, deadline=None)
@given(
    tensors=st.dictionaries(
        st.text("abcxyz_.", min_size=1, max_size=5),
        st.tuples(
            st.sampled_from(
                [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.int8, torch.float64]
            ),
            st.lists(st.integers(0, 4), max_size=3),
        ),
        max_size=5,
    )
)
def test_tensor_files_round_trip_and_are_safetensors(tmp_path_factory, tensors):
    built = {
        k: torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(0, 2, shape).to(dtype)
        for k, (dtype, shape) in tensors.items()
    }
    path = tmp_path_factory.mktemp("tf") / "t.safetensors"
    entry = tensor_file.write(path, built, metadata={"format": "pt"})
    data = path.read_bytes()
    assert entry == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_intdigest(data)}
    theirs, ours = safetensors.torch.load_file(path), tensor_file.read(path, entry)
    for k, t in built.items():
        assert theirs[k].dtype == ours[k].dtype == t.dtype and torch.equal(theirs[k], t) and torch.equal(ours[k], t)


# -- corruption in either file is detected, by name ------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from([STATE_FILE, MODEL_FILE]), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_flipped_bit_in_either_file_is_refused_naming_it(tmp_path_factory, name, where, bit):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    state = init_state(model, adamw(1e-3))
    path = save(state, tmp_path_factory.mktemp("flip") / "c", model=model)
    data = bytearray((path / name).read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    (path / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path / name} is corrupted"):
        load(path, like=state)
    if name == MODEL_FILE:
        with pytest.raises(CheckpointError, match=f"{path / name} is corrupted"):
            checkpoint.load_weights(path, like=state)


def test_a_truncated_or_missing_weights_file_is_refused_naming_it(tmp_path):
    model = llama()
    state = trained_state(model)
    path = save(state, tmp_path / "c", model=model)
    data = (path / MODEL_FILE).read_bytes()
    (path / MODEL_FILE).write_bytes(data[:-10])
    assert not checkpoint.is_complete(path)
    with pytest.raises(CheckpointError, match=f"{path / MODEL_FILE} is truncated"):
        load(path, like=state)
    (path / MODEL_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"{path / MODEL_FILE} is missing"):
        load(path, like=state)


def test_a_weights_file_without_a_tensor_the_sidecar_maps_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    state = init_state(model, adamw(1e-3))
    path = save(state, tmp_path / "c", model=model)
    tensors = safetensors.torch.load_file(path / MODEL_FILE)
    del tensors["bias"]
    entry = tensor_file.write(path / MODEL_FILE, tensors)
    meta = read_metadata(path)
    meta["files"][MODEL_FILE] = entry  # a consistent, crafted checkpoint
    (path / SIDECAR_FILE).write_bytes(sidecar_bytes(meta))
    with pytest.raises(CheckpointError, match=rf"{path / MODEL_FILE} lacks \['bias'\]"):
        load(path, like=state)


# -- formats before 4 are refused by name ---------------------------------------------------------------------


def write_format_2(state, model, path: Path, version: int = 2) -> Path:
    """A checkpoint as formats 1 and 2 wrote it: the whole record in state.safetensors, the weights again."""
    path.mkdir(parents=True)
    flat = {k: v.clone().contiguous() for k, v in flatten(state).items()}
    safetensors.torch.save_file(flat, path / STATE_FILE, metadata={"format": "pt"})
    weights = {k: v.clone().contiguous() for k, v in checkpoint.model_weights(state, model).items()}
    safetensors.torch.save_file(weights, path / MODEL_FILE, metadata={"format": "pt"})
    files = {
        n: {"bytes": (path / n).stat().st_size, "crc32": zlib.crc32((path / n).read_bytes())}
        for n in (STATE_FILE, MODEL_FILE)
    }
    meta = {
        "format": "trainfold-checkpoint",
        "format_version": version,
        "library_version": "0.1",
        "step": 5,
        "epoch": 0,
        "cursor": {"epoch": 0, "position": 0},
        "save_only_model": False,
        "jit": False,
        "metadata": {},
        "settings": {},
        "run": None,
        "files": files,
    }
    if version == 1:
        del meta["run"]
        (path / SIDECAR_FILE).write_text(json.dumps(meta))
    else:
        (path / SIDECAR_FILE).write_bytes(sidecar_bytes(meta))
    return path


def write_format_3(state, model, path: Path) -> Path:
    """A checkpoint as format 3 wrote it: as format 4, but a zlib CRC-32 per file."""
    save(state, path, model=model)
    meta = read_metadata(path)
    meta.update(format_version=3, library_version="0.3")
    meta["files"] = {
        n: {"bytes": e["bytes"], "crc32": zlib.crc32((path / n).read_bytes())} for n, e in meta["files"].items()
    }
    (path / SIDECAR_FILE).write_bytes(sidecar_bytes(meta))
    return path


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_checkpoint_of_a_format_before_4_is_refused_naming_the_release_and_the_fix(tmp_path, version):
    model = llama()
    state = trained_state(model)
    path = tmp_path / "checkpoint-5"
    if version == 3:
        write_format_3(attrs.evolve(state, step=scalar(5)), model, path)
    else:
        write_format_2(state, model, path, version)
    release = "0.3" if version == 3 else "0.1"
    refusal = (
        rf"{path / SIDECAR_FILE}: field 'format_version' is {version}: the checkpoint was written by trainfold "
        rf"{release}.*reads formats 4-5; load it with trainfold {release} and save it again, or start a new run "
        rf"from its weights \(its model.safetensors loads with from_pretrained\)"
    )
    like = init_state(llama(seed=4), adamw(1e-3))
    for read in (read_metadata, lambda p: load(p, like=like), lambda p: checkpoint.warm_start(p, like=like)):
        with pytest.raises(CheckpointError, match=refusal):
            read(path)
    with pytest.warns(checkpoint.CheckpointWarning, match="field 'format_version'"):
        assert not checkpoint.is_complete(path) and checkpoint.list_checkpoints(tmp_path) == []


def test_a_fresh_run_never_mixes_into_checkpoints_of_an_earlier_format(tmp_path):
    from trainfold.ckpt import run_dir
    from trainfold.ckpt.run_identity import RunSettings

    model = llama()
    old = write_format_2(trained_state(model), model, tmp_path / "checkpoint-5")
    before = sorted((p.name, p.read_bytes()) for p in old.iterdir())
    settings = RunSettings({"learning_rate": 0.1})
    refusal = r"holds checkpoints of another run: checkpoint-5 \(an earlier checkpoint format.*overwrite_output_dir"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)  # list_checkpoints skips it, naming why
        with pytest.raises(ValueError, match=refusal):
            run_dir.claim(tmp_path, None, settings, "f00d")
        with run_dir.claim(tmp_path, None, settings, "f00d", overwrite_output_dir=True) as held:
            assert held.source is None
    assert sorted((p.name, p.read_bytes()) for p in old.iterdir()) == before  # kept as it was


def test_a_newer_format_is_refused_by_name(tmp_path):
    path = save(init_state(torch.nn.Linear(2, 1), adamw(1e-3)), tmp_path / "c")
    meta = read_metadata(path)
    (path / SIDECAR_FILE).write_bytes(sidecar_bytes({**meta, "format_version": 6}))
    with pytest.raises(CheckpointError, match="has checkpoint format 6.*this trainfold reads format 5: upgrade"):
        load(path, like=init_state(torch.nn.Linear(2, 1), adamw(1e-3)))


def as_format_4(path: Path) -> dict:
    """Rewrite the sidecar of the checkpoint ``path`` as format 4 wrote it: each file hashed whole."""
    meta = read_metadata(path)
    meta.update(format_version=4, files={n: tensor_file.digest_of(path / n, None) for n in meta["files"]})
    (path / SIDECAR_FILE).write_bytes(sidecar_bytes(meta))
    return meta


def test_a_checkpoint_of_format_4_hashed_whole_loads_bitwise_and_its_damage_is_refused(tmp_path):
    model = torch.nn.Linear(2048, 2304)  # 18.9 MB of weights: two chunks, hashed otherwise in format 5
    state = attrs.evolve(init_state(model, adamw(1e-3)), step=scalar(4))
    path = save(state, tmp_path / "checkpoint-4", model=model)
    assert read_metadata(path)["format_version"] == 5
    meta = as_format_4(path)
    assert meta["files"][MODEL_FILE] != read_metadata(save(state, tmp_path / "again", model=model))["files"][MODEL_FILE]
    like = init_state(torch.nn.Linear(2048, 2304), adamw(1e-3))
    assert_states_equal(load(path, like=like), state)
    data = bytearray((path / MODEL_FILE).read_bytes())
    data[-5] ^= 1  # in the second chunk
    (path / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path / MODEL_FILE} is corrupted: its xxh3_64 is"):
        load(path, like=like)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda m: m.pop("tensors"), "tensors"),
        (lambda m: m.update(frozen=[1]), "frozen"),
        (lambda m: m.update(tensors={MODEL_FILE: {"params.w": 3}}), "tensors.model.safetensors"),
        (lambda m: m.update(tensors={**m["tensors"], "x.safetensors": {}}), "files.x.safetensors"),
    ],
)
def test_a_malformed_tensors_or_frozen_field_is_refused_naming_it(tmp_path, change, field):
    path = save(init_state(torch.nn.Linear(2, 1), adamw(1e-3)), tmp_path / "c")
    meta = read_metadata(path)
    change(meta)
    (path / SIDECAR_FILE).write_bytes(sidecar_bytes(meta))
    with pytest.raises(CheckpointError, match=rf"{path / SIDECAR_FILE}: field '{field}'"):
        read_metadata(path)
