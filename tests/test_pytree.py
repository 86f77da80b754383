"""TrainState is a pytree: torch.utils._pytree flattens and rebuilds it, tree_map reaches every tensor,
torch.func sees its tensors, and a vmapped step is refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from trainfold import adamw, init_ensemble_state, init_state, make_ensemble_step, make_step, sgd
from trainfold.core.losses import cross_entropy
from trainfold.core.state import Cursor, TrainState, scalar
from trainfold.core.tree import flatten
from trainfold.step.ensemble import ensemble_axes
from trainfold.testing.strategies import tensor_dicts


def _equal_records(a, b):
    fa, fb = flatten(a), flatten(b)
    assert list(fa) == list(fb)
    assert all(torch.equal(fa[k], fb[k]) and fa[k].dtype == fb[k].dtype for k in fa)


def test_flatten_reaches_every_tensor_of_a_state_with_an_optimizer_state():
    state = init_state(torch.nn.Linear(3, 2), adamw(0.1), seed=5)
    leaves, spec = pytree.tree_flatten(state)
    tensors = [leaf for leaf in leaves if leaf is not None]  # None: a field not in use (cursor.streams)
    assert all(isinstance(leaf, torch.Tensor) for leaf in tensors)
    assert len(tensors) == len(flatten(state))  # the moments, counters and metrics: nothing hidden in a leaf
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is TrainState and type(rebuilt.cursor) is Cursor
    _equal_records(rebuilt, state)


def test_tree_map_returns_a_state_and_leaves_the_input_alone():
    state = init_state(torch.nn.Linear(3, 2), sgd(0.1, momentum=0.9))
    before = {k: v.clone() for k, v in flatten(state).items()}
    doubled = pytree.tree_map_only(torch.Tensor, lambda t: t * 2, state)
    assert isinstance(doubled, TrainState)
    assert torch.equal(doubled.params["weight"], state.params["weight"] * 2)
    assert doubled.step.item() == 0 and doubled.seed.item() == 0
    _equal_records(state, TrainState(**{k: getattr(state, k) for k in ("params", "buffers", "opt_state")}))
    assert all(torch.equal(before[k], v) for k, v in flatten(state).items())


def test_key_paths_name_the_fields():
    state = TrainState(params={"w": torch.zeros(2)}, buffers={}, opt_state=None)
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(state)[0]]
    assert ".params['w']" in paths and ".cursor.epoch" in paths


def test_vmap_over_a_stacked_state_runs_a_pure_function_of_it():
    k = 3
    ensemble = init_ensemble_state([torch.nn.Linear(3, 2) for _ in range(k)], sgd(0.1))
    model = torch.nn.Linear(3, 2)
    x = torch.randn(k, 5, 3)
    out = torch.func.vmap(
        lambda s, xb: torch.func.functional_call(model, s.params, (xb,)), in_dims=(ensemble_axes(ensemble), 0)
    )(ensemble, x)
    for m in range(k):
        w, b = ensemble.params["weight"][m], ensemble.params["bias"][m]
        assert torch.allclose(out[m], x[m] @ w.T + b)


def test_vmapping_a_step_is_refused_by_name_with_the_batched_step_to_use():
    k = 2
    models = [torch.nn.Linear(3, 2) for _ in range(k)]
    ensemble = init_ensemble_state(models, sgd(0.1))
    batch = [{"input": torch.ones(k, 4, 3), "labels": torch.zeros(k, 4, dtype=torch.long)}]
    step = make_step(models[0], cross_entropy, sgd(0.1))
    with pytest.raises(TypeError, match=r"cannot run under torch.func.vmap.*make_ensemble_step"):
        torch.func.vmap(step, in_dims=(ensemble_axes(ensemble), 0))(ensemble, batch)
    batched = make_ensemble_step(models[0], cross_entropy, adamw(0.1))  # what the error points to works
    assert batched(init_ensemble_state(models, adamw(0.1)), batch).step.tolist() == [1, 1]


_scalars = st.integers(0, 10**6).map(scalar)


@st.composite
def states(draw):
    params = draw(tensor_dicts(keys=["w", "b"]))
    opt = draw(st.sampled_from([sgd(0.1), sgd(0.1, momentum=0.9), adamw(0.1)]))
    extras = draw(st.dictionaries(st.sampled_from(["a", "b"]), tensor_dicts(keys=["x"]), max_size=2))
    return TrainState(
        params=params,
        buffers=draw(tensor_dicts(keys=["running"])),
        opt_state=opt.init(params),
        step=draw(_scalars),
        seed=draw(_scalars),
        cursor=Cursor(draw(_scalars), draw(_scalars)),
        extras=extras,
    )


@settings(max_examples=30)
@given(states())
def test_flatten_then_unflatten_is_the_identity(state):
    leaves, spec = pytree.tree_flatten(state)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    _equal_records(rebuilt, state)
    assert pytree.tree_flatten(rebuilt)[1] == spec
    assert all(a is b for a, b in zip(pytree.tree_leaves(rebuilt), leaves))  # rebuilt around the same tensors
