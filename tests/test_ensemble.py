"""Ensembles: each member steps as its own make_step would; states split and stack back exactly."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import (
    EPS,
    adam_step_bounds,
    assert_trees_within,
    assert_within,
    causal_lm_step_abs_grads,
    gamma,
    grad_atol,
    reordered,
    row_abs_grads,
    sgd_atol,
)
from torch import nn

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step, sgd
from trainfold.core.forward import make_forward
from trainfold.core.losses import causal_lm, cross_entropy
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.tree import flatten
from trainfold.optim import from_torch
from trainfold.step.compiled import CompileFallbackWarning
from trainfold.step.ensemble import (
    ensemble_size,
    init_ensemble_state,
    make_ensemble_step,
    split_ensemble,
    stack_batches,
    stack_ensemble,
)

CFG = TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=16)
FULL = os.environ.get("TRAINFOLD_SLOW") == "full"
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def tiny_models(k: int) -> list[TinyLM]:
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        models.append(TinyLM(CFG))
    return models


def lm_batch(g: torch.Generator, micro: int = 2, rows: int = 3) -> list[dict]:
    out = []
    for _ in range(micro):
        ids = torch.randint(0, CFG.vocab_size, (rows, CFG.max_len), generator=g)
        labels = ids.clone()
        labels[torch.rand(rows, CFG.max_len, generator=g) < 0.3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def same_record(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(fa[k].dtype == fb[k].dtype and torch.equal(fa[k], fb[k]) for k in fa)


# -- concrete examples ------------------------------------------------------------------------------


@pytest.mark.parametrize("batching", ["vmap", "unroll"])
def test_each_member_steps_like_its_own_make_step_with_its_own_batch_and_hyperparameters(batching):
    k = 3
    models = tiny_models(k)
    opts = [
        chain(clip_by_global_norm(0.5), adamw(lr, weight_decay=wd))
        for lr, wd in ((1e-2, 0.1), (3e-3, 0.0), (1e-3, 0.3))
    ]
    ens = init_ensemble_state(models, opts, seeds=[5, 6, 7])
    members = [init_state(m, o, seed=s) for m, o, s in zip(models, opts, (5, 6, 7))]
    assert all(same_record(x, y) for x, y in zip(split_ensemble(ens), members))
    step = make_ensemble_step(models[0], causal_lm, opts, batching=batching)
    singles = [make_step(models[0], causal_lm, o) for o in opts]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = [lm_batch(g) for _ in range(k)]
        before = flatten(ens)
        versions = {key: t._version for key, t in before.items()}
        copies = {key: t.clone() for key, t in before.items()}
        new = step(ens, stack_batches(batches))
        assert all(t._version == versions[key] and torch.equal(t, copies[key]) for key, t in before.items())
        # each member from the ensemble's own state: vmapped and single kernels add the same terms in other
        # orders, so one AdamW step apart within adam_step_bounds (tests/tolerance.py)
        members = split_ensemble(ens)
        for got, prev, one, b in zip(split_ensemble(new), members, singles, batches):
            want = one(prev, b)
            sizes, terms = causal_lm_step_abs_grads(models[0], b, prev.params)
            for key, bound in adam_step_bounds(prev, want, sizes, terms, max_norm=0.5).items():
                assert_within(got.params[key], want.params[key], bound, EPS, key)
            loss = want.metrics["loss"].item()
            assert got.metrics["loss"].item() == pytest.approx(loss, abs=reordered(terms, loss), rel=0)
            for key in ("learning_rate", "num_items"):
                assert torch.equal(got.metrics[key], want.metrics[key]), key
        ens = new
    for got in split_ensemble(ens):
        assert got.step.item() == 3 and got.opt_state[-1].count.item() == 3


def test_shared_batch_gives_every_member_the_same_data():
    models = tiny_models(2)
    opt = adamw(1e-2)
    step = make_ensemble_step(models[0], causal_lm, opt, shared_batch=True)
    batch = lm_batch(torch.Generator().manual_seed(2), micro=1)
    out = split_ensemble(step(init_ensemble_state(models, opt), batch))
    single = make_step(models[0], causal_lm, opt)
    for got, model in zip(out, models):  # one AdamW step apart within adam_step_bounds (tests/tolerance.py)
        prev = init_state(model, opt)
        want = single(prev, batch)
        for key, bound in adam_step_bounds(prev, want, *causal_lm_step_abs_grads(model, batch, prev.params)).items():
            assert_within(got.params[key], want.params[key], bound, EPS, key)


def test_split_members_continue_as_ordinary_states():
    models = tiny_models(2)
    opt = chain(clip_by_global_norm(1.0), adamw(1e-2))
    g = torch.Generator().manual_seed(3)
    ens = make_ensemble_step(models[0], causal_lm, opt)(
        init_ensemble_state(models, opt), stack_batches([lm_batch(g), lm_batch(g)])
    )
    member = split_ensemble(ens)[1]
    ordinary = init_state(models[1], opt)
    assert flatten(member).keys() == flatten(ordinary).keys()  # an ordinary checkpoint's layout
    assert all(member.params[k].shape == ordinary.params[k].shape for k in ordinary.params)
    nxt = make_step(models[1], causal_lm, opt)(member, lm_batch(g))
    assert nxt.step.item() == 2


def test_a_member_without_items_counts_its_step_but_keeps_its_state():
    models = tiny_models(2)
    opt = adamw(1e-2)
    ens = init_ensemble_state(models, opt)
    ids = torch.zeros(2, 3, 8, dtype=torch.long)
    labels = torch.full((2, 3, 8), -100)
    labels[0, :, 2:] = 1
    out = make_ensemble_step(models[0], causal_lm, opt)(ens, [{"input_ids": ids, "labels": labels}])
    assert out.step.tolist() == [1, 1] and out.opt_state.count.tolist() == [1, 0]  # every drawn step counts
    assert torch.equal(out.params["tok.weight"][1], ens.params["tok.weight"][1])
    assert torch.equal(out.opt_state.mu["tok.weight"][1], ens.opt_state.mu["tok.weight"][1])
    assert not torch.equal(out.params["tok.weight"][0], ens.params["tok.weight"][0])
    assert torch.isnan(out.metrics["loss"][1]) and out.loss_total[1].item() == 0.0
    assert out.nonfinite_losses.tolist() == [0, 1] and out.metrics["num_items"][1].item() == 0


def test_an_ensemble_step_without_any_items_counts_for_every_member():
    models = tiny_models(2)
    opt = adamw(1e-2)
    ens = init_ensemble_state(models, opt)
    batch = [{"input_ids": torch.zeros(2, 3, 8, dtype=torch.long), "labels": torch.full((2, 3, 8), -100)}]
    with pytest.warns(RuntimeWarning, match="no labels other than -100"):
        out = make_ensemble_step(models[0], causal_lm, opt)(ens, batch)
    assert out.step.tolist() == [1, 1] and out.nonfinite_losses.tolist() == [1, 1]
    assert out.opt_state.count.tolist() == [0, 0] and out.params["tok.weight"] is ens.params["tok.weight"]


def test_compiled_ensemble_step_matches_the_eager_ensemble_step():
    models = tiny_models(2)
    opt = chain(clip_by_global_norm(0.5), adamw(1e-2, weight_decay=0.1))
    eager = make_ensemble_step(models[0], causal_lm, opt)
    compiled = make_ensemble_step(models[0], causal_lm, opt, compile="aot_eager")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    state = init_ensemble_state(models, opt)
    g = torch.Generator().manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        for _ in range(2):
            batches = [lm_batch(g), lm_batch(g)]
            a, b = eager(state, stack_batches(batches)), compiled(state, stack_batches(batches))
            # each step from the same state: aot_eager decomposes ops, so sums may run in other orders; each member
            # one clipped AdamW step apart within adam_step_bounds (tests/tolerance.py)
            for got, want, prev, model, batch in zip(*map(split_ensemble, (b, a, state)), models, batches):
                sizes, terms = causal_lm_step_abs_grads(model, batch, prev.params)
                for key, bound in adam_step_bounds(prev, want, sizes, terms, max_norm=0.5).items():
                    assert_within(got.params[key], want.params[key], bound, EPS, key)
            state = a
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1  # compiled, and only once
    assert b.step.tolist() == [2, 2]


@pytest.mark.parametrize("batching", ["unroll", "vmap"])
@pytest.mark.parametrize(
    "opt",
    [
        chain(clip_by_global_norm(10.0), sgd(0.1, momentum=0.9)),
        from_torch(torch.optim.Adagrad, lr=0.1, initial_accumulator_value=1.0),  # moves <= lr per unit of gradient
    ],
    ids=["clip+sgd-momentum", "from_torch-adagrad"],
)
def test_any_optimizer_runs_on_each_members_slice_as_the_members_own_step(opt, batching):
    models = [nn.Linear(3, 4) for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    data = [
        [{"input": torch.randn(5, 3, generator=g), "labels": torch.randint(0, 4, (5,), generator=g)}] for _ in range(4)
    ]
    step, ens = make_ensemble_step(models[0], cross_entropy, opt, batching=batching), init_ensemble_state(models, opt)
    members, grad_diff = [init_state(m, opt) for m in models], 0.0
    for t in range(2):
        batches = data[2 * t : 2 * t + 2]
        for model, member, (micro,) in zip(models, members, batches):  # how far a reordered gradient can be
            (x, y), forward = micro.values(), make_forward(model, {})
            row = lambda p, r, x=x, y=y, f=forward: cross_entropy(f(p, {"input": x[r : r + 1]}), y[r : r + 1], 5)
            grad_diff = max(grad_diff, *grad_atol(row_abs_grads(row, member.params, range(5)), 5).values())
        ens = step(ens, stack_batches(batches))
        members = [make_step(m, cross_entropy, opt)(s, b) for m, s, b in zip(models, members, batches)]
    for got, want in zip(split_ensemble(ens), members):
        if batching == "unroll":  # the members' own forward and backward on views: the member's step, bitwise
            assert same_record(got.params, want.params) and same_record(got.opt_state, want.opt_state)
        else:  # vmapped matmuls may sum in another order (tests/tolerance.py); both optimizers are <= lr-Lipschitz
            atol = dict.fromkeys(want.params, sgd_atol(0.1, 2, grad_diff, momentum=0.9))
            assert_trees_within(got.params, want.params, atol, rtol=2 * EPS)


# -- properties ---------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    lrs=st.lists(st.floats(1e-3, 1e-1), min_size=4, max_size=4),
    clip=st.booleans(),
    batching=st.sampled_from(["vmap", "unroll"]),
)
def test_ensemble_of_linear_models_equals_member_steps(k, seed, lrs, clip, batching):
    torch.manual_seed(seed)
    models = [nn.Linear(3, 4) for _ in range(k)]
    opts = [chain(clip_by_global_norm(0.1), adamw(lr)) if clip else adamw(lr) for lr in lrs[:k]]
    g = torch.Generator().manual_seed(seed)
    batches = [
        [{"input": torch.randn(5, 3, generator=g), "labels": torch.randint(0, 4, (5,), generator=g)}] for _ in range(k)
    ]
    step = make_ensemble_step(models[0], cross_entropy, opts, batching=batching)
    ens = step(init_ensemble_state(models, opts), stack_batches(batches))
    for got, model, opt, batch in zip(split_ensemble(ens), models, opts, batches):
        prev = init_state(model, opt)
        want = make_step(model, cross_entropy, opt)(prev, batch)
        # one AdamW step on the same 5 rows through vmapped and single kernels (tests/tolerance.py)
        (x, y), forward, count = batch[0].values(), make_forward(model, {}), int(want.metrics["num_items"])
        row = lambda p, r, x=x, y=y, f=forward, n=count: cross_entropy(f(p, {"input": x[r : r + 1]}), y[r : r + 1], n)
        sizes = row_abs_grads(row, prev.params, range(5))
        for key, bound in adam_step_bounds(prev, want, sizes, 5, max_norm=0.1 if clip else float("inf")).items():
            assert_within(got.params[key], want.params[key], bound, EPS, key)
        norm = want.metrics["grad_norm"].item()
        diff = sum(grad_atol(sizes, 5)[k] ** 2 * v.numel() for k, v in sizes.items()) ** 0.5
        assert got.metrics["grad_norm"].item() == pytest.approx(norm, abs=diff + gamma(16) * norm, rel=0)


@settings(max_examples=20, deadline=None)
@given(k=st.integers(1, 5), seeds=st.lists(st.integers(0, 2**31), min_size=5, max_size=5))
def test_split_then_stack_round_trips(k, seeds):
    models = [nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)) for _ in range(k)]
    state = init_ensemble_state(models, chain(clip_by_global_norm(1.0), adamw(0.1)), seeds=seeds[:k])
    parts = split_ensemble(state)
    assert ensemble_size(state) == len(parts) == k
    assert [p.seed.item() for p in parts] == seeds[:k]
    assert same_record(stack_ensemble(parts), state)
    parts[0].params["0.weight"].add_(1.0)  # members own their tensors
    assert same_record(stack_ensemble(split_ensemble(state)), state)


# -- errors -------------------------------------------------------------------------------------------


class Nonzero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, input):
        return self.lin(input[input.sum(-1).nonzero()[:, 0]])


def test_an_op_without_a_batching_rule_is_named():
    model = Nonzero()
    opt = adamw(0.1)
    step = make_ensemble_step(model, cross_entropy, opt)
    batch = [{"input": torch.ones(2, 4, 3), "labels": torch.zeros(2, 4, dtype=torch.long)}]
    with pytest.raises(TypeError, match="Nonzero cannot run as a vmapped ensemble: aten::nonzero"):
        step(init_ensemble_state(model, opt, size=2), batch)


def test_bad_ensemble_inputs_are_named():
    model = nn.Linear(3, 2)
    opt = adamw(0.1)
    state = init_ensemble_state(model, opt, size=2)
    step = make_ensemble_step(model, cross_entropy, opt)
    with pytest.raises(ValueError, match="leading member axis of size 2"):
        step(state, [{"input": torch.ones(4, 3), "labels": torch.zeros(4, dtype=torch.long)}])
    with pytest.raises(TypeError, match=r"must be a transformation .*got \['adamw'\]"):
        make_ensemble_step(model, cross_entropy, ["adamw"])
    with pytest.raises(ValueError, match="3 optimizers for 2 members"):
        init_ensemble_state([model, model], [opt, opt, opt])
    with pytest.raises(ValueError, match="differ in shape"):
        init_ensemble_state([nn.Linear(3, 2), nn.Linear(4, 2)], opt)
    with pytest.raises(ValueError, match="not an ensemble state"):
        split_ensemble(init_state(model, opt))
    with pytest.raises(ValueError, match="give size=K"):
        init_ensemble_state(model, opt)
    with pytest.raises(ValueError, match="batching must be 'vmap' or 'unroll'"):
        make_ensemble_step(model, cross_entropy, opt, batching="loop")
