"""The compiled step: same results as the eager step, no recompiles, no mutation, clear fallbacks."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from tolerance import (
    EPS,
    adam_step_bounds,
    assert_trees_within,
    assert_within,
    causal_lm_step_abs_grads,
    gamma,
    grad_atol,
    reordered,
    sgd_atol,
)
from torch._dynamo.backends.debugging import aot_eager

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step, sgd
from trainfold.core.losses import causal_lm, cross_entropy
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.optim import TorchOptState, from_torch
from trainfold.optim.schedules import linear
from trainfold.step.compiled import CompileFallbackWarning

CFG = TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=16)
FULL = os.environ.get("TRAINFOLD_SLOW") == "full"


def tiny(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(CFG)


def batches(n_steps: int, micro: int, seed: int = 1, vocab: int = 32, seq: int = 16) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        step = []
        for _ in range(micro):
            ids = torch.randint(0, vocab, (3, seq), generator=g)
            labels = ids.clone()
            labels[torch.rand(3, seq, generator=g) < 0.3] = -100
            step.append({"input_ids": ids, "labels": labels})
        out.append(step)
    return out


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own compiles: graphs cached by an earlier test (other shapes) must not leak in."""
    torch._dynamo.reset()
    yield


def counting_backend() -> tuple[list[int], object]:
    compiles = [0]

    def backend(gm, example_inputs):
        compiles[0] += 1
        return aot_eager(gm, example_inputs)

    return compiles, backend


def snapshot(state) -> list[tuple[int, torch.Tensor]]:
    tensors = [
        *state.params.values(),
        *state.opt_state[-1].mu.values(),
        *state.opt_state[-1].nu.values(),
        state.step,
        state.opt_state[-1].count,
    ]
    return [(t._version, t.clone()) for t in tensors]


def unchanged(state, snap) -> bool:
    tensors = [
        *state.params.values(),
        *state.opt_state[-1].mu.values(),
        *state.opt_state[-1].nu.values(),
        state.step,
        state.opt_state[-1].count,
    ]
    return all(t._version == v and torch.equal(t, c) for t, (v, c) in zip(tensors, snap))


def close(a, b, atol: float = 2e-5) -> float:
    worst = max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)
    assert worst < atol, worst
    return worst


# -- concrete examples ------------------------------------------------------------------------------


def test_compiled_step_matches_eager_never_mutates_and_compiles_once():
    model = tiny()
    opt = chain(clip_by_global_norm(0.5), adamw(linear(1e-2, warmup_steps=1, total_steps=6), weight_decay=0.1))
    eager = make_step(model, causal_lm, opt)
    compiles, backend = counting_backend()
    compiled = make_step(model, causal_lm, opt, compile=backend)
    a = init_state(model, opt, seed=3)
    for batch in batches(4, micro=2):  # each step from the same state: AdamW's difference stays one step's
        prev, before = a, snapshot(a)
        a, b = eager(prev, batch), compiled(prev, batch)
        assert unchanged(prev, before)
        # aot_eager decomposes ops, so sums may run in other orders (tests/tolerance.py): gradients within
        # grad_atol of the rows' sizes, the clip coefficient within rho relative, then one AdamW step
        sizes, terms = causal_lm_step_abs_grads(model, batch, prev.params)
        for k, bound in adam_step_bounds(prev, a, sizes, terms, max_norm=0.5).items():
            assert_within(b.params[k], a.params[k], bound, EPS, k)
        atol, norm = grad_atol(sizes, terms), a.metrics["grad_norm"].item()
        diff = sum(atol[k] ** 2 * v.numel() for k, v in sizes.items()) ** 0.5
        size = sum(v.numel() for v in sizes.values())
        assert (
            b.metrics["num_items"] == a.metrics["num_items"]
            and b.metrics["learning_rate"] == a.metrics["learning_rate"]
        )
        loss = a.metrics["loss"].item()
        assert b.metrics["loss"].item() == pytest.approx(loss, abs=reordered(terms, loss), rel=0)
        assert b.metrics["grad_norm"].item() == pytest.approx(norm, abs=diff + gamma(size) * norm, rel=0)
        for key in ("loss", "grad_norm", "learning_rate", "num_items"):
            assert a.metrics[key].dtype == b.metrics[key].dtype
    assert compiles[0] == 1  # one micro-batch graph (the update runs torch's AdamW), no recompiles over 4 steps
    assert b.step.item() == 4 and b.opt_state[-1].count.item() == 4
    assert list(b.opt_state[-1].mu) == list(b.params)
    assert sorted(b.params) == sorted(a.params)


@pytest.mark.parametrize(
    "make, lr",
    [
        (lambda: chain(clip_by_global_norm(10.0), sgd(0.1, momentum=0.9)), 0.1),
        # s starts at 1: the first step lr g / sqrt(1 + g^2) moves by at most lr per unit of gradient difference
        (lambda: from_torch(torch.optim.Adagrad, lr=0.1, initial_accumulator_value=1.0), 0.1),
    ],
    ids=["clip+sgd-momentum", "from_torch-adagrad"],
)
def test_any_optimizer_runs_after_the_compiled_gradients(make, lr):
    model, opt = tiny(), make()
    eager = make_step(model, causal_lm, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        compiled = make_step(model, causal_lm, opt, compile="aot_eager")
        state = init_state(model, opt)
        for batch in batches(2, micro=2):  # each step from the same state: one step's difference
            a, b = eager(state, batch), compiled(state, batch)
            # aot_eager sums in other orders: gradients grad_atol apart (tests/tolerance.py), params lr times that
            sizes, terms = causal_lm_step_abs_grads(model, batch, state.params)
            atol = {k: sgd_atol(lr, 1, v) for k, v in grad_atol(sizes, terms).items()}
            assert_trees_within(b.params, a.params, atol, rtol=EPS)
            state = a
    assert b.metrics["learning_rate"].item() == pytest.approx(lr)
    if isinstance(b.opt_state, TorchOptState):
        assert b.opt_state.count.item() == 2 and sorted(b.opt_state.slots) == sorted(b.params)


def test_objective_that_cannot_trace_falls_back_once_with_the_reason():
    model = tiny()
    opt = adamw(1e-2)

    def objective(forward, params, micro, num_items, key):
        logits = forward(params, {"input_ids": micro["input_ids"]})
        if logits.mean().item() > 1e9:  # data-dependent Python control flow: no single graph
            raise AssertionError
        return causal_lm(logits, micro["labels"], num_items), {}

    eager = make_step(model, causal_lm, opt, objective=objective)
    compiled = make_step(model, causal_lm, opt, objective=objective, compile="aot_eager")
    state = init_state(model, opt)
    batch = batches(1, micro=1)[0]
    with pytest.warns(CompileFallbackWarning, match="compiling the step failed"):
        out = compiled(state, batch)
    assert close(out, eager(state, batch), atol=1e-12) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        compiled(out, batch)  # stays eager, warns only once


def test_step_without_items_counts_but_learns_nothing_like_the_eager_step():
    model = tiny()
    opt = adamw(1e-2)
    compiled = make_step(model, causal_lm, opt, compile="aot_eager")
    state = init_state(model, opt)
    batch = [{"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.full((2, 8), -100)}]
    with pytest.warns(RuntimeWarning, match="num_items_in_batch == 0"):
        out = compiled(state, batch)
    assert out.step.item() == 1 and out.params["tok.weight"] is state.params["tok.weight"]
    assert out.nonfinite_losses.item() == 1


def test_a_step_in_which_no_parameter_gets_a_gradient_is_an_error_compiled_too():
    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 4))
            self.copy = self.weight.detach().clone().requires_grad_()

        def forward(self, input):
            return input @ self.copy.T

    opt = adamw(1e-2)
    model = Hidden()
    compiled = make_step(model, cross_entropy, opt, compile="aot_eager")
    batch = [{"input": torch.randn(2, 4), "labels": torch.tensor([0, 2])}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)
        with pytest.raises(RuntimeError, match="no trainable parameter of Hidden received a gradient in step 0"):
            compiled(init_state(model, opt), batch)


# -- errors -------------------------------------------------------------------------------------------


def test_input_errors_are_raised_not_swallowed_by_the_fallback():
    model = tiny()
    opt = adamw(1e-2)
    compiled = make_step(model, causal_lm, opt, compile="aot_eager")
    with pytest.raises(KeyError, match="no 'labels' key"):
        compiled(init_state(model, opt), [{"input_ids": torch.zeros(2, 8, dtype=torch.long)}])


# -- the real compiler (slow) --------------------------------------------------------------------------


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=172,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg), 256, 64


@pytest.mark.slow
def test_make_step_compile_true_with_inductor_matches_eager():
    model, vocab, seq = _llama() if FULL else (tiny(), 32, 16)
    opt = chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.01))
    eager = make_step(model, causal_lm, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        compiled = make_step(model, causal_lm, opt, compile=True)
        a = init_state(model, opt)
        for batch in batches(3 if FULL else 2, micro=2, vocab=vocab, seq=seq):
            prev = a  # each step from the same state: AdamW's difference stays one step's
            a, b = eager(prev, batch), compiled(prev, batch)
            # inductor fuses and reorders reductions (tests/tolerance.py): gradients within grad_atol of the rows'
            # sizes (every position a term: 2 gamma(n) relative, far above the ulp or two its vectorised exp/log
            # may differ by), the clip coefficient within rho relative, then one AdamW step (adam_step_bounds)
            sizes, terms = causal_lm_step_abs_grads(model, batch, prev.params)
            for k, bound in adam_step_bounds(prev, a, sizes, terms, max_norm=1.0).items():
                assert_within(b.params[k], a.params[k], bound, EPS, k)
            loss = a.metrics["loss"].item()  # the tokens' (positive) losses summed in another order
            assert b.metrics["loss"].item() == pytest.approx(loss, abs=reordered(terms, loss), rel=0)


def test_a_label_smoothed_loss_compiles_without_falling_back():
    from trainfold.core.losses import label_smoothed

    model, opt = tiny(), chain(clip_by_global_norm(1.0), adamw(1e-2))
    loss = label_smoothed(causal_lm, 0.1)
    compiles, backend = counting_backend()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        compiled = make_step(model, loss, opt, compile=backend)
        state = init_state(model, opt)
        eager = make_step(model, loss, opt)
        a, b = state, state
        for batch in batches(3, 2):
            a, b = compiled(a, batch), eager(b, batch)
        first = compiled(state, batches(3, 2)[0])
    assert compiles[0] >= 1
    close(a, b)
    plain = make_step(model, causal_lm, opt)(state, batches(3, 2)[0]).metrics["loss"].item()
    smoothed = eager(state, batches(3, 2)[0]).metrics["loss"].item()
    assert abs(first.metrics["loss"].item() - smoothed) < 1e-5  # the smoothing is in the graph:
    assert abs(smoothed - plain) > 1e-4  # without it the loss differs by more


def test_an_out_of_range_label_in_a_compiled_step_raises_naming_it():
    """The built-in losses are traced as they are: inside the graph the kernel's bounds check fails, and the
    eager step (the fallback) raises the loss's own error naming the label; the state is untouched."""
    model = torch.nn.Linear(3, 4)
    step = make_step(model, cross_entropy, sgd(0.1), compile="aot_eager")
    state = init_state(model, sgd(0.1))
    before = {k: v.clone() for k, v in state.params.items()}
    good = [{"input": torch.ones(2, 3), "labels": torch.tensor([0, 3])}]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        state = step(state, good)  # compiles, no fallback
    bad = [{"input": torch.ones(2, 3), "labels": torch.tensor([0, 9])}]
    with pytest.raises(ValueError, match="9"):
        step(state, bad)
    assert not all(torch.equal(state.params[k], before[k]) for k in before)  # the good step did learn
