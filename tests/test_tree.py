"""Tree ops and record flattening."""

from __future__ import annotations

from collections import namedtuple

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import adamw, chain, clip_by_global_norm, init_state, sgd
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.tree import (
    add,
    check_keys,
    flatten,
    global_norm,
    map_tensors,
    map_tensors_with_path,
    scale,
    tree_map,
    unflatten,
    zeros_like,
)


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


# -- map_tensors: one walker for nested records ------------------------------------------------------

Pair = namedtuple("Pair", ["left", "right"])


@attrs.frozen(eq=False)
class Box:
    inner: object
    label: str = "box"


@attrs.frozen(eq=False)
class Cell:
    value: object


def test_map_tensors_rebuilds_every_kind_of_record():
    record = Box({"a": [torch.tensor(1), (torch.tensor(2), None)], "p": Pair(torch.tensor(3), "keep")}, label="x")
    out = map_tensors(lambda t: t + 10, record)
    assert isinstance(out, Box) and out.label == "x"
    assert out.inner["a"][0].item() == 11 and out.inner["a"][1][0].item() == 12 and out.inner["a"][1][1] is None
    assert isinstance(out.inner["p"], Pair) and out.inner["p"].left.item() == 13 and out.inner["p"].right == "keep"
    assert record.inner["a"][0].item() == 1  # the input is untouched


def test_map_tensors_with_path_sees_the_flatten_keys():
    record = {"w": torch.zeros(2), "opt": (Pair(torch.ones(1), None),), "cell": Cell([torch.ones(3)])}
    seen = {}
    map_tensors_with_path(lambda path, t: seen.setdefault(path, t), record, "state")
    assert seen.keys() == flatten(record, "state").keys()
    assert all(seen[k] is v for k, v in flatten(record, "state").items())


tensors = st.integers(-5, 5).map(lambda n: torch.tensor(float(n)))
others = st.sampled_from([None, 0, 1.5, "s"])


def nest(children):
    return st.one_of(
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda t: Pair(*t)),
        st.tuples(children, st.text("xy", max_size=2)).map(lambda t: Box(*t)),
        children.map(Cell),
    )


def nest_state(children):  # what a state record may hold: no numbers or strings
    return st.one_of(
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda t: Pair(*t)),
        children.map(Cell),
    )


records = st.recursive(st.one_of(tensors, others), nest, max_leaves=12)
state_records = st.recursive(st.one_of(tensors, st.none()), nest_state, max_leaves=12)


def shape_of(node):
    """The record's structure with every tensor replaced by its value (types kept)."""
    if isinstance(node, torch.Tensor):
        return ("T", node.item())
    if isinstance(node, Box):
        return ("Box", shape_of(node.inner), node.label)
    if isinstance(node, Cell):
        return ("Cell", shape_of(node.value))
    if isinstance(node, dict):
        return ("dict", tuple((k, shape_of(v)) for k, v in node.items()))
    if isinstance(node, (list, tuple)):
        return (type(node).__name__, tuple(shape_of(v) for v in node))
    return ("leaf", node)


@settings(max_examples=60, deadline=None)
@given(records)
def test_map_tensors_identity_round_trips(record):
    out = map_tensors(lambda t: t, record)
    assert shape_of(out) == shape_of(record)
    leaves_in, leaves_out = [], []
    map_tensors(leaves_in.append, record)
    map_tensors(leaves_out.append, out)
    assert len(leaves_in) == len(leaves_out) and all(a is b for a, b in zip(leaves_in, leaves_out))


@settings(max_examples=60, deadline=None)
@given(records)
def test_map_tensors_keeps_the_structure_and_maps_every_leaf(record):
    doubled = map_tensors(lambda t: t * 2, record)
    summed = map_tensors(torch.add, record, record)
    assert shape_of(summed) == shape_of(doubled)
    halved = map_tensors(lambda t: t / 2, doubled)
    assert shape_of(halved) == shape_of(record)


@settings(max_examples=60, deadline=None)
@given(state_records)
def test_unflatten_inverts_flatten_on_state_records(record):
    flat = flatten(record)
    back = unflatten({k: v + 1 for k, v in flat.items()}, like=record)
    assert shape_of(back) == shape_of(map_tensors(lambda t: t + 1, record))
    assert flatten(back).keys() == flat.keys()


def test_map_tensors_with_rest_needs_the_same_structure():
    with pytest.raises(KeyError):
        map_tensors(torch.add, {"a": torch.tensor(1)}, {"b": torch.tensor(1)})


def test_flatten_keys_are_the_checkpoint_names():
    """Checkpoints store these strings: the walk (torch's pytree) must not change one of them."""
    extras = {"pair": Pair(torch.zeros(1), None), "n": {"k": (torch.ones(1),)}}
    state = init_state(torch.nn.Linear(2, 1), chain(clip_by_global_norm(1.0), adamw(1e-3)), extras=extras)
    counters = ["step", "seed", "cursor.epoch", "cursor.position", "metrics.loss", "metrics.grad_norm"]
    counters += ["metrics.learning_rate", "metrics.num_items", "loss_total", "nonfinite_losses"]
    assert list(flatten(state)) == [
        "params.weight",
        "params.bias",
        "opt_state.1.count",
        "opt_state.1.mu.weight",
        "opt_state.1.mu.bias",
        "opt_state.1.nu.weight",
        "opt_state.1.nu.bias",
        *counters,
        "extras.pair.0",  # a namedtuple by index, as any tuple; None dropped
        "extras.n.k.0",
    ]
    momentum = init_state(torch.nn.Linear(2, 1), sgd(0.1, momentum=0.9))
    assert list(flatten(momentum, "state"))[:5] == [
        "state.params.weight",
        "state.params.bias",
        "state.opt_state.count",
        "state.opt_state.momentum.weight",
        "state.opt_state.momentum.bias",
    ]
