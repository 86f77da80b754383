"""init_state: copies, never aliases, starts from given params when asked."""

from __future__ import annotations

import pytest
import torch

from trainfold import adamw, init_state, sgd


def test_state_owns_copies_of_the_model_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model[0].bias.requires_grad_(False)  # a frozen parameter travels with the buffers
    state = init_state(model, adamw(1e-3), seed=4)
    assert sorted(state.params) == ["0.weight", "1.bias", "1.weight"]
    assert "0.bias" in state.buffers and "1.running_mean" in state.buffers
    for name, p in model.named_parameters():
        held = state.params.get(name, state.buffers.get(name))
        assert torch.equal(held, p) and held.data_ptr() != p.data_ptr()
    assert state.seed.item() == 4 and state.step.item() == 0 and state.cursor.as_tuple() == (0, 0)


def test_init_state_from_other_params():
    model = torch.nn.Linear(2, 1)
    start = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
    state = init_state(model, sgd(0.1), params=start)
    assert torch.equal(state.params["weight"], start["weight"])
    assert state.params["weight"].data_ptr() != start["weight"].data_ptr()
    with pytest.raises(KeyError, match=r"missing \['bias', 'weight'\], unexpected \['w'\]"):
        init_state(model, sgd(0.1), params={"w": torch.ones(1, 2)})


def test_a_model_without_trainable_params_is_refused():
    model = torch.nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        init_state(model, sgd(0.1))
