"""The eager step's backward: without ``inputs=`` where only its leaves need grad, bitwise the same (issue 22)."""

from __future__ import annotations

import torch

from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import init_state
from trainfold.optim import adamw, chain, clip_by_global_norm
from trainfold.step import eager, make_step


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_len=16, dropout=0.1))


def _batches(steps: int = 3) -> list[list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = [torch.randint(0, 32, (2, 8), generator=g) for _ in range(2)]
        out.append([{"input_ids": i, "labels": i} for i in ids])
    return out


def _optimizer():
    return chain(clip_by_global_norm(0.5), adamw(1e-2, weight_decay=0.1))


def _trained():
    net = _model()
    step = make_step(net, causal_lm, _optimizer())
    state = init_state(net, _optimizer(), seed=3)
    for batch in _batches():
        state = step(state, batch)
    return state


def test_the_default_loss_backs_up_without_inputs_and_the_result_is_bitwise_the_inputs_ones(monkeypatch):
    plan = make_step(_model(), causal_lm, _optimizer()).plan
    assert eager.only_leaves_need_grad(plan)
    fast = _trained()
    monkeypatch.setattr(eager, "only_leaves_need_grad", lambda plan: False)  # the step as it was: inputs=leaves
    slow = _trained()
    for k in fast.params:
        assert torch.equal(fast.params[k], slow.params[k]), k
    assert torch.equal(fast.metrics["loss"], slow.metrics["loss"])
    assert torch.equal(fast.metrics["grad_norm"], slow.metrics["grad_norm"])


def test_a_loss_of_the_users_that_uses_another_tensor_requiring_grad_leaves_its_grad_alone():
    temperature = torch.tensor(2.0, requires_grad=True)

    def loss(outputs, labels, n):  # a learned temperature the step does not train
        return causal_lm(outputs / temperature, labels, n)

    net = _model()
    step = make_step(net, loss, _optimizer())
    assert not eager.only_leaves_need_grad(step.plan)
    state = step(init_state(net, _optimizer()), _batches(1)[0])
    assert temperature.grad is None and int(state.step) == 1


def test_an_objective_that_uses_another_tensor_requiring_grad_leaves_its_grad_alone():
    scale = torch.tensor(1.0, requires_grad=True)

    def objective(forward, params, micro, num_items, key):
        inputs = {k: v for k, v in micro.items() if k != "labels"}
        return causal_lm(forward(params, inputs), micro["labels"], num_items) * scale, {}

    net = _model()
    step = make_step(net, causal_lm, _optimizer(), objective=objective)
    assert not eager.only_leaves_need_grad(step.plan)
    step(init_state(net, _optimizer()), _batches(1)[0])
    assert scale.grad is None
