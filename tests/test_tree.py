"""Tree ops and record flattening."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import adamw, chain, clip_by_global_norm, init_state
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.tree import add, check_keys, flatten, global_norm, scale, tree_map, unflatten, zeros_like


def test_ops_do_not_mutate():
    a = {"x": torch.ones(3), "y": torch.arange(2.0)}
    b = {"x": torch.full((3,), 2.0), "y": torch.ones(2)}
    versions = [v._version for v in (*a.values(), *b.values())]
    assert add(a, b)["x"].tolist() == [3.0, 3.0, 3.0]
    assert scale(a, 3)["y"].tolist() == [0.0, 3.0]
    assert zeros_like(a)["y"].tolist() == [0.0, 0.0]
    assert tree_map(torch.mul, a, b)["y"].tolist() == [0.0, 1.0]
    assert versions == [v._version for v in (*a.values(), *b.values())]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.floats(-100, 100), min_size=1, max_size=5), min_size=1, max_size=4))
def test_global_norm_is_the_norm_of_the_concatenation(values):
    tensors = {str(i): torch.tensor(v, dtype=torch.float64) for i, v in enumerate(values)}
    flat = torch.cat(list(tensors.values()))
    torch.testing.assert_close(global_norm(tensors), flat.norm())


def test_check_keys_names_both_sides():
    with pytest.raises(KeyError, match=r"missing \['b'\], unexpected \['c'\]"):
        check_keys({"a": 1, "c": 2}, {"a": 1, "b": 2}, "grads", "params")


def test_state_round_trips_through_flatten():
    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
    state = init_state(model, opt, seed=3)
    flat = flatten(state)
    assert "opt_state.1.mu.tok.weight" in flat and "cursor.epoch" in flat and "seed" in flat
    back = unflatten({k: v.clone() for k, v in flat.items()}, like=state)
    assert isinstance(back, type(state)) and isinstance(back.opt_state, tuple)
    for k, v in flatten(back).items():
        assert torch.equal(v, flat[k])


def test_unflatten_reports_missing_unexpected_and_mismatched():
    like = {"w": torch.zeros(2), "b": torch.zeros(1)}
    with pytest.raises(KeyError, match=r"missing \['b'\], unexpected \['v'\]"):
        unflatten({"w": torch.zeros(2), "v": torch.zeros(1)}, like)
    with pytest.raises(ValueError, match=r"w: loaded \(3,\) torch.float32, expected \(2,\) torch.float32"):
        unflatten({"w": torch.zeros(3), "b": torch.zeros(1)}, like)


def test_flatten_refuses_configuration_in_the_state():
    @attrs.frozen
    class Bad:
        lr: float

    with pytest.raises(TypeError, match="cannot flatten float at 'lr'"):
        flatten(Bad(0.1))
