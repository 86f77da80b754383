"""The fast load: tensors read straight into the template's storage (donate), fresh memory where they do not fit."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.ckpt import STATE_FILE, CheckpointError, load, save, tensor_file
from trainfold.core.state import DonatedStateError, init_state, is_donated, scalar
from trainfold.core.tree import flatten
from trainfold.optim import adamw


def _run(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    state = init_state(model, adamw(1e-3), copy=False)
    g = torch.Generator().manual_seed(seed + 1)
    opt = attrs.evolve(
        state.opt_state,
        mu={k: torch.randn(v.shape, generator=g) for k, v in state.opt_state.mu.items()},
        nu={k: torch.rand(v.shape, generator=g) for k, v in state.opt_state.nu.items()},
    )
    params = {k: torch.randn(v.shape, generator=g) for k, v in state.params.items()}
    return model, attrs.evolve(state, params=params, opt_state=opt, step=scalar(7))


def _equal(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


# --- donate: one pass into the template's storage ---


def test_a_donating_load_reads_into_the_templates_storage_and_equals_a_plain_load(tmp_path):
    model, saved = _run(0)
    path = save(saved, tmp_path / "checkpoint-7", model=model)
    fresh = _run(1)[0]
    like = init_state(fresh, adamw(1e-3), copy=False)  # lent: the module's own parameters
    ptrs = {k: v.data_ptr() for k, v in flatten(like).items() if k.startswith(("params.", "opt_state."))}
    plain = load(path, like=init_state(_run(1)[0], adamw(1e-3)))
    donated = load(path, like=like, donate=True)
    assert _equal(donated, plain) and _equal(donated, saved)
    after = flatten(donated)
    assert all(after[k].data_ptr() == p for k, p in ptrs.items())  # no fresh memory
    assert torch.equal(fresh[0].weight, saved.params["0.weight"])  # the module holds the checkpoint's weights
    assert is_donated(like)
    with pytest.raises(DonatedStateError):
        like.params["0.weight"]


def test_a_plain_load_never_touches_the_template(tmp_path):
    model, saved = _run(0)
    path = save(saved, tmp_path / "c", model=model)
    like = init_state(_run(1)[0], adamw(1e-3))
    before = {k: (v.clone(), v._version) for k, v in flatten(like).items()}
    loaded = load(path, like=like)
    assert not is_donated(like)
    assert all(torch.equal(v, before[k][0]) and v._version == before[k][1] for k, v in flatten(like).items())
    assert all(loaded.params[k].data_ptr() != like.params[k].data_ptr() for k in like.params)


def test_tensors_that_cannot_take_the_bytes_in_place_get_fresh_memory(tmp_path):
    model, saved = _run(0)
    path = save(saved, tmp_path / "c", model=model)
    like = init_state(_run(1)[0], adamw(1e-3))
    wide = torch.zeros(8, 16).t()  # the right shape, but a transposed view: not contiguous
    shared = torch.zeros(2, 16)  # two halves of one storage: neither is alone in it
    mu = {**like.opt_state.mu, "0.weight": wide, "2.bias": shared[0, :4]}
    like = attrs.evolve(like, opt_state=attrs.evolve(like.opt_state, mu=mu))
    untouched = shared.clone()
    loaded = load(path, like=like, donate=True)
    assert _equal(loaded, saved) and torch.equal(shared, untouched)
    assert loaded.opt_state.mu["2.bias"].data_ptr() != shared.data_ptr() and not wide.any()


def test_a_donating_load_of_a_corrupt_file_raises_by_name_and_donates_the_template(tmp_path):
    model, saved = _run(0)
    path = save(saved, tmp_path / "c", model=model)
    data = bytearray((path / STATE_FILE).read_bytes())
    data[-5] ^= 1
    (path / STATE_FILE).write_bytes(bytes(data))
    like = init_state(_run(1)[0], adamw(1e-3))
    with pytest.raises(CheckpointError, match=rf"{path / STATE_FILE} is corrupted"):
        load(path, like=like, donate=True)
    assert is_donated(like)  # its tensors may hold part of the corrupt file: unusable, and it says so


# --- fresh memory where the template cannot take the bytes ---


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]), st.integers(0, 3000)),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_read_into_equals_a_plain_read_whichever_destinations_fit(tmp_path_factory, specs, data):
    g = torch.Generator().manual_seed(len(specs))
    tensors = {f"t{i}": torch.randint(0, 100, (n,), generator=g).to(dtype) for i, (dtype, n) in enumerate(specs)}
    path = tmp_path_factory.mktemp("f") / "t.safetensors"
    _, crc = tensor_file.write(path, tensors)
    kinds = data.draw(
        st.lists(st.sampled_from(["fits", "dtype", "shape", "none"]), min_size=len(specs), max_size=len(specs))
    )
    into = {}
    for (k, v), kind in zip(tensors.items(), kinds, strict=True):
        if kind == "fits":
            into[k] = torch.zeros_like(v)
        elif kind == "dtype":
            into[k] = torch.zeros(v.shape, dtype=torch.float64)
        elif kind == "shape":
            into[k] = torch.zeros(v.numel() + 1, dtype=v.dtype)
    out = tensor_file.read(path, crc32=crc, into=into)
    assert out.keys() == tensors.keys()
    assert all(torch.equal(out[k], v) and out[k].dtype == v.dtype for k, v in tensors.items())
    for k, kind in zip(tensors, kinds, strict=True):
        if kind == "fits" and tensors[k].numel():
            assert out[k].data_ptr() == into[k].data_ptr()
        elif k in into and tensors[k].numel():
            assert out[k].data_ptr() != into[k].data_ptr() and not into[k].any()  # left alone
