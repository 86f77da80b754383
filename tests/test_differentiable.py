"""make_step(..., differentiable=True): the gradient of a loss after K steps with respect to the learning
rate, the momentum or the initial params is exact (central finite differences in float64 as the oracle);
without the flag, an optimizer holding a tensor that requires grad is refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import adamw, init_state, make_step, sgd
from trainfold.core.tree import flatten

K = 3


def cross_entropy(outputs, labels, num_items):
    """The summed cross-entropy over the global count, in float64 (the built-in computes in float32)."""
    return torch.nn.functional.cross_entropy(outputs, labels, reduction="sum") / num_items


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    batches = [
        [
            {
                "input": torch.randn(5, 3, generator=g, dtype=torch.float64),
                "labels": torch.randint(0, 2, (5,), generator=g),
            }
        ]
        for _ in range(K)
    ]
    held_out = {
        "input": torch.randn(7, 3, generator=g, dtype=torch.float64),
        "labels": torch.randint(0, 2, (7,), generator=g),
    }
    return batches, held_out


def _loss_after(model, make_opt, batches, held_out, params=None):
    """The held-out loss after K differentiable steps from ``params`` (default: the model's)."""
    opt = make_opt()
    state = init_state(model, opt)
    if params is not None:
        state = type(state)(params=params, buffers=state.buffers, opt_state=opt.init(params))
    step = make_step(model, cross_entropy, opt, differentiable=True)
    for batch in batches:
        state = step(state, batch)
    logits = torch.func.functional_call(model, state.params, (held_out["input"],))
    return torch.nn.functional.cross_entropy(logits, held_out["labels"])


def _central(f, x: float, eps: float = 1e-6) -> float:
    return (f(x + eps) - f(x - eps)) / (2 * eps)


@pytest.mark.parametrize(
    "make",
    [
        lambda h: sgd(h),
        lambda h: sgd(h, momentum=0.9),
        lambda h: sgd(0.3, momentum=h),
        lambda h: adamw(h, weight_decay=0.01),
    ],
    ids=["sgd-lr", "momentum-lr", "momentum", "adamw-lr"],
)
def test_the_hypergradient_after_k_steps_matches_central_differences(make):
    model, (batches, held_out) = _model(), _data()
    value = 0.3 if make(0.3).name != "adamw" else 0.05
    h = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    exact = torch.autograd.grad(_loss_after(model, lambda: make(h), batches, held_out), h)[0].item()

    def f(x):
        return _loss_after(model, lambda: make(torch.tensor(x, dtype=torch.float64)), batches, held_out).item()

    assert exact == pytest.approx(_central(f, value), rel=1e-3)
    assert exact != 0.0


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 10**6))
def test_the_gradient_with_respect_to_the_initial_params_matches_central_differences(seed):
    model, (batches, held_out) = _model(seed % 97), _data(seed)
    start = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    loss = _loss_after(model, lambda: sgd(0.5, momentum=0.5), batches, held_out, params=start)
    grads = torch.autograd.grad(loss, list(start.values()))
    direction = {
        k: torch.randn(v.shape, generator=torch.Generator().manual_seed(seed), dtype=v.dtype) for k, v in start.items()
    }
    exact = sum((g * direction[k]).sum() for g, k in zip(grads, start)).item()

    def f(t):
        moved = {k: (v + t * direction[k]).detach() for k, v in start.items()}
        return _loss_after(model, lambda: sgd(0.5, momentum=0.5), batches, held_out, params=moved).item()

    assert exact == pytest.approx(_central(f, 0.0), rel=1e-3, abs=1e-9)


@pytest.mark.parametrize(
    "opt, ulps",
    [(sgd(0.3), 0), (sgd(0.3, momentum=0.9, weight_decay=0.01), 0), (adamw(0.05, weight_decay=0.01), 8 * K)],
    ids=["sgd", "momentum", "adamw"],
)
def test_the_differentiable_step_computes_the_eager_steps_values(opt, ulps):
    # SGD: the same ops in the same order, bitwise. AdamW: the eager step's fused kernel (one addcdiv) and the
    # pure update (divide, scale, add) round differently: a few float64 ulps of the O(1) params per step.
    model, (batches, _) = _model(), _data()
    eager, diff = make_step(model, cross_entropy, opt), make_step(model, cross_entropy, opt, differentiable=True)
    a = b = init_state(model, opt)
    for batch in batches:
        a, b = eager(a, batch), diff(b, batch)
    fa, fb = flatten(a), flatten(b)
    for key in fa:
        tol = ulps * torch.finfo(torch.float64).eps * max(1.0, fa[key].abs().max().item())
        assert torch.allclose(fa[key], fb[key].detach(), rtol=0, atol=tol) if ulps else torch.equal(fa[key], fb[key]), (
            key
        )


def test_a_hyperparameter_requiring_grad_is_refused_without_the_flag():
    lr = torch.tensor(0.1, requires_grad=True)
    with pytest.raises(ValueError, match=r"require grad at \['sgd.schedule.<value>'\].*differentiable=True"):
        make_step(_model(), cross_entropy, sgd(lr))
    make_step(_model(), cross_entropy, sgd(lr.detach()))  # a tensor without grad is a plain hyperparameter


def test_options_the_differentiable_step_cannot_honour_are_refused_together():
    with pytest.raises(ValueError, match=r"cannot take gradient_checkpointing=True, compile=True"):
        make_step(_model(), cross_entropy, sgd(0.1), differentiable=True, compile=True, gradient_checkpointing=True)
    step = make_step(_model(), cross_entropy, sgd(0.1), differentiable=True)
    with pytest.raises(ValueError, match="cannot take a donated state"):
        step(init_state(_model(), sgd(0.1)), _data()[0][0], donate=True)


def test_the_hypergradient_is_exact_with_gradient_accumulation():
    model, (batches, held_out) = _model(), _data()
    split = [[{k: v[:3] for k, v in b[0].items()}, {k: v[3:] for k, v in b[0].items()}] for b in batches]
    h = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    whole = _loss_after(model, lambda: sgd(h, momentum=0.9), batches, held_out)
    parts = _loss_after(model, lambda: sgd(h, momentum=0.9), split, held_out)
    exact = torch.autograd.grad(parts, h)[0].item()

    def f(x):
        return _loss_after(
            model, lambda: sgd(torch.tensor(x, dtype=torch.float64), momentum=0.9), split, held_out
        ).item()

    assert exact == pytest.approx(_central(f, 0.3), rel=1e-3)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)  # the same samples, split: the same training
