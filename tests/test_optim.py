"""Optimizers agree with torch.optim; schedules agree with the HF formulas; decay masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from trainfold.optim import (
    GradientTransformation,
    adamw,
    chain,
    clip_by_global_norm,
    decay_mask,
    decay_mask_by_name,
    from_torch,
    sgd,
    trace,
)
from trainfold.optim.schedules import SCHEDULE_NAMES, constant, cosine, linear, named, warmup_steps_for

STEPS = 20


def random_problem(seed: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (4, 3), "b": (3,), "norm.weight": (3,), "e": (5, 2)}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) * 3 for k, s in shapes.items()} for _ in range(STEPS)]
    return params, grads


def run_ours(opt, params, grads):
    state = opt.init(params)
    for g in grads:
        params, state = opt.apply(g, state, params)
    return params


def run_torch(make_opt, params, grads, clip=None):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = make_opt(leaves)
    for g in grads:
        for k, p in leaves.items():
            p.grad = g[k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(leaves.values()), clip)
        opt.step()
    return {k: v.detach() for k, v in leaves.items()}


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


hyper = st.fixed_dictionaries(
    {
        "lr": st.floats(1e-4, 1e-1),
        "b1": st.floats(0.0, 0.99),
        "b2": st.floats(0.9, 0.9999),
        "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
        "wd": st.floats(0.0, 0.2),
    }
)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    h=hyper,
    impl=st.sampled_from([{"fused": True}, {"foreach": True}, {}]),
    clip=st.sampled_from([None, 0.5, 5.0]),
)
def test_adamw_matches_torch_adamw(seed, h, impl, clip):
    params, grads = random_problem(seed)
    ours = adamw(h["lr"], h["b1"], h["b2"], h["eps"], h["wd"], mask=None, **impl)
    if clip is not None:
        ours = chain(clip_by_global_norm(clip), ours)
    ref = run_torch(
        lambda p: torch.optim.AdamW(
            list(p.values()), lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"], weight_decay=h["wd"], **impl
        ),
        params,
        grads,
        clip,
    )
    ours = run_ours(ours, params, grads)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)  # torch's own kernel: bitwise


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), h=hyper)
def test_adamw_update_path_matches_apply_path(seed, h):
    params, grads = random_problem(seed)
    opt = adamw(h["lr"], h["b1"], h["b2"], h["eps"], h["wd"])
    state_a = state_b = opt.init(params)
    pa = pb = params
    for g in grads:
        pa, state_a = opt.apply(g, state_a, pa)
        upd, state_b = opt.update(g, state_b, pb)
        pb = {k: pb[k] + upd[k] for k in pb}
    assert_close(pa, pb)


def test_fused_adamw_is_bitwise_torch_fused():
    params, grads = random_problem(7)
    ours = run_ours(adamw(1e-2, weight_decay=0.1, mask=None, fused=True), params, grads)
    ref = run_torch(lambda p: torch.optim.AdamW(list(p.values()), lr=1e-2, weight_decay=0.1, fused=True), params, grads)
    for k in ours:
        assert torch.equal(ours[k], ref[k]), k


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}, {}])
def test_adamw_reads_gradients_of_any_layout_as_torch_reads_a_params_own_grad(kernel):
    # autograd.grad and vmap can return a gradient strided unlike its param (pytorch/pytorch#106951), where
    # torch.optim's .grad always matches the param's layout; torch's fused kernel would read it in the param's layout
    params, grads = random_problem(8)
    strided = [{k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in g.items()} for g in grads]
    assert any(not v.is_contiguous() for v in strided[0].values())
    ours = run_ours(adamw(1e-2, weight_decay=0.1, mask=None, **kernel), params, strided)
    ref = run_torch(lambda p: torch.optim.AdamW(list(p.values()), lr=1e-2, weight_decay=0.1, **kernel), params, grads)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_adamw_mask_matches_two_torch_param_groups():
    params, grads = random_problem(3)
    mask = decay_mask_by_name(params)
    assert mask == {"w": True, "b": True, "norm.weight": False, "e": True}
    ref = run_torch(
        lambda p: torch.optim.AdamW(
            [
                {"params": [p[k] for k in p if mask[k]], "weight_decay": 0.1},
                {"params": [p[k] for k in p if not mask[k]], "weight_decay": 0.0},
            ],
            lr=1e-2,
        ),
        params,
        grads,
    )
    assert_close(run_ours(adamw(1e-2, weight_decay=0.1), params, grads), ref)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lr=st.floats(1e-3, 0.5),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    wd=st.sampled_from([0.0, 1e-2]),
    dampening=st.sampled_from([0.0, 0.3]),
    masked=st.booleans(),
)
def test_sgd_matches_torch_sgd(seed, lr, momentum, nesterov, wd, dampening, masked):
    nesterov = nesterov and momentum > 0
    dampening = 0.0 if nesterov else dampening
    params, grads = random_problem(seed)
    mask = decay_mask_by_name(params) if masked else {k: True for k in params}
    ours = run_ours(sgd(lr, momentum, nesterov, wd, dampening, mask=mask if masked else None), params, grads)
    ref = run_torch(
        lambda p: torch.optim.SGD(
            [
                {"params": [p[k] for k in p if mask[k]], "weight_decay": wd},
                {"params": [p[k] for k in p if not mask[k]], "weight_decay": 0.0},
            ],
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            dampening=dampening,
        ),
        params,
        grads,
    )
    assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), max_norm=st.floats(0.01, 20.0))
def test_clip_matches_clip_grad_norm(seed, max_norm):
    _, grads = random_problem(seed)
    g = grads[0]
    clip = clip_by_global_norm(max_norm)
    ours, _ = clip.update(g, clip.init(g), g)
    leaves = [v.clone().requires_grad_() for v in g.values()]
    for leaf, v in zip(leaves, g.values()):
        leaf.grad = v.clone()
    torch.nn.utils.clip_grad_norm_(leaves, max_norm)
    for leaf, k in zip(leaves, g):
        torch.testing.assert_close(ours[k], leaf.grad, rtol=1e-6, atol=1e-7)


def _received(seen: list) -> GradientTransformation:
    """A last chain part that records the gradients it receives (and steps nothing)."""

    def update(grads, state, params):
        seen.append(dict(grads))
        return {k: torch.zeros_like(v) for k, v in grads.items()}, state

    return GradientTransformation(init=lambda params: (), update=update)


def test_a_donated_chain_clips_the_gradients_in_place_bitwise_as_the_pure_apply():
    params, grads = random_problem(7)
    pure_seen, donated_seen = [], []
    pure_opt, donated_opt = (
        chain(clip_by_global_norm(0.5), _received(pure_seen)),
        chain(clip_by_global_norm(0.5), _received(donated_seen)),
    )
    given_grads = {k: v.clone() for k, v in grads[0].items()}
    pure_opt.apply(grads[0], pure_opt.init(params), params)
    donated_opt.apply(given_grads, donated_opt.init(params), {k: v.clone() for k, v in params.items()}, donate=True)
    # no gradient-sized copy: the last part gets the donated tensors themselves, scaled in place
    assert all(donated_seen[0][k] is given_grads[k] for k in grads[0])
    assert all(pure_seen[0][k] is not grads[0][k] for k in grads[0])  # the pure apply leaves its inputs alone
    assert all(torch.equal(donated_seen[0][k], pure_seen[0][k]) for k in grads[0])
    assert not torch.equal(pure_seen[0]["w"], grads[0]["w"])  # the clip did act


def test_a_donated_clip_of_gradients_sharing_memory_scales_each_element_once():
    shared = torch.tensor([3.0, 4.0])
    flat = torch.tensor([3.0, 4.0, 0.0, 0.0])
    for grads in ({"a": shared, "b": shared}, {"a": torch.tensor([5.0]).expand(2)}):  # one tensor twice; a broadcast
        pure, _ = clip_by_global_norm(1.0).update({k: v.clone() for k, v in grads.items()}, (), {})
        donated, _ = clip_by_global_norm(1.0).donated_update(grads, (), {})
        assert all(torch.equal(donated[k], pure[k]) for k in grads)
    views = {"a": flat[:2], "b": flat[2:]}  # disjoint views of one buffer (FSDP's sharded gradients): in place
    clip_by_global_norm(1.0).donated_update(views, (), {})
    assert torch.allclose(flat, torch.tensor([0.6, 0.8, 0.0, 0.0]))


def test_schedule_as_learning_rate_is_read_at_the_update_count():
    params, grads = random_problem(0)
    opt = adamw(linear(1e-2, 2, 8))
    state = opt.init(params)
    seen = []
    for g in grads[:8]:
        seen.append(opt.learning_rate(state))
        params, state = opt.apply(g, state, params)
    assert seen == pytest.approx([0, 5e-3, 1e-2, 1e-2 * 5 / 6, 1e-2 * 4 / 6, 5e-3, 1e-2 * 2 / 6, 1e-2 / 6])


# -- schedules ------------------------------------------------------------------------------------


def test_linear_schedule_reproduces_hf_values():
    s = linear(1e-3, warmup_steps=2, total_steps=8)
    expected = [0, 0.5, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]
    assert [s(k) for k in range(8)] == pytest.approx([1e-3 * e for e in expected])


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
@pytest.mark.parametrize("total,warmup", [(8, 2), (10, 0), (7, 3), (1, 0)])
def test_schedules_agree_with_transformers(kind, total, warmup):
    transformers = pytest.importorskip("transformers")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.3)
    sched = transformers.get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total)
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = {
        "linear": linear(0.3, warmup, total),
        "cosine": cosine(0.3, warmup, total),
        "constant_with_warmup": constant(0.3, warmup),
    }[kind]
    assert [ours(k) for k in range(total)] == pytest.approx(theirs, rel=1e-12, abs=1e-15)


def _schedule_kwargs(name: str, total: int, warmup: int) -> st.SearchStrategy[dict]:
    cycles = st.sampled_from([0.5, 1.0, 1.5])
    return {
        "linear": st.just({}),
        "constant": st.just({}),
        "constant_with_warmup": st.just({}),
        "cosine": st.fixed_dictionaries({}, optional={"num_cycles": cycles}),
        "cosine_with_min_lr": st.one_of(
            st.fixed_dictionaries({"min_lr": st.sampled_from([0.0, 0.03, 0.1])}),
            st.fixed_dictionaries({"min_lr_rate": st.sampled_from([0.0, 0.1, 0.5])}),
        ),
        "cosine_warmup_with_min_lr": st.fixed_dictionaries(
            {"min_lr_rate": st.sampled_from([0.0, 0.1, 0.5])},
            optional={"num_cycles": cycles, "warmup_lr_rate": st.sampled_from([0.0, 0.2])},
        )
        | st.fixed_dictionaries({"min_lr": st.sampled_from([0.0, 0.03])}),
        "cosine_with_restarts": st.fixed_dictionaries({}, optional={"num_cycles": st.integers(1, 4)}),
        "polynomial": st.fixed_dictionaries(
            {}, optional={"lr_end": st.sampled_from([0.0, 1e-4, 0.05]), "power": st.sampled_from([0.5, 1.0, 2.0, 3.0])}
        ),
        "inverse_sqrt": st.fixed_dictionaries({}, optional={"timescale": st.integers(1, 20)}),
        "warmup_stable_decay": st.fixed_dictionaries(
            {"num_decay_steps": st.integers(0, max(0, total - warmup))},
            optional={
                "warmup_type": st.sampled_from(["linear", "cosine", "1-sqrt"]),
                "decay_type": st.sampled_from(["linear", "cosine", "1-sqrt"]),
                "min_lr_ratio": st.sampled_from([0.0, 0.1]),
                "num_cycles": cycles,
            },
        ),
    }[name]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(SCHEDULE_NAMES), total=st.integers(1, 40), data=st.data())
def test_every_named_schedule_agrees_with_transformers(name, total, data):
    transformers = pytest.importorskip("transformers")
    warmup = data.draw(st.integers(0, total), label="warmup")
    kwargs = data.draw(_schedule_kwargs(name, total, warmup), label="kwargs")
    if name == "polynomial" and warmup == total:  # HF divides by zero at the last step; ours ends at lr_end
        assert named(name, 0.3, warmup, total, **kwargs)(total) == kwargs.get("lr_end", 1e-7)
        return
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    sched = transformers.get_scheduler(
        name, opt, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=dict(kwargs)
    )
    theirs = []
    for _ in range(total + 3):  # a few steps past the end too
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = named(name, 0.3, warmup, total, **kwargs)
    assert [ours(k) for k in range(total + 3)] == pytest.approx(theirs, rel=1e-9, abs=1e-12)


def test_schedule_names_and_kwargs_are_checked():
    with pytest.raises(ValueError, match="reduce_lr_on_plateau.*pure functions of the step"):
        named("reduce_lr_on_plateau", 0.1, 0, 10)
    with pytest.raises(ValueError, match=r"\{'num_cycle'\} are not taken by 'cosine' \(it takes \['num_cycles'\]\)"):
        named("cosine", 0.1, 0, 10, num_cycle=2)
    with pytest.raises(ValueError, match=r"needs \['num_decay_steps'\]"):
        named("warmup_stable_decay", 0.1, 0, 10)
    with pytest.raises(ValueError, match="exactly one of min_lr or min_lr_rate"):
        named("cosine_with_min_lr", 0.1, 0, 10)
    with pytest.raises(ValueError, match=r"lr_end \(0.5\) below the learning rate"):
        named("polynomial", 0.1, 0, 10, lr_end=0.5)


def test_warmup_ratio_rounds_up_like_hf():
    assert warmup_steps_for(0.1, 25) == 3
    assert warmup_steps_for(5, 25) == 5
    assert warmup_steps_for(0, 25) == 0


# -- decay masks ----------------------------------------------------------------------------------


class CustomNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.ln_f = CustomNorm(3)  # a norm that only its class name gives away... and its name
        self.gate = CustomNorm(3)  # a norm known by type alone
        self.head = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(3)


def test_decay_mask_uses_module_type_and_name():
    assert decay_mask(Net()) == {
        "emb.weight": True,
        "ln_f.scale": False,
        "gate.scale": False,
        "head.weight": True,
        "head.bias": False,
        "bn.weight": False,
        "bn.bias": False,
    }


def test_decay_mask_on_llama_excludes_rmsnorm():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    mask = decay_mask(transformers.LlamaForCausalLM(cfg))
    off = sorted(k for k, v in mask.items() if not v)
    assert off == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
    ]


# -- bad input ------------------------------------------------------------------------------------


def test_bad_hyperparameters_are_named():
    with pytest.raises(ValueError, match="b1 must be in"):
        adamw(1e-3, b1=1.0)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_by_global_norm(0.0)
    with pytest.raises(ValueError, match="nesterov=True needs momentum"):
        sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="total_steps must be > 0"):
        linear(1.0, 0, 0)


def test_mask_missing_a_param_is_named():
    params, grads = random_problem(0)
    opt = adamw(1e-3, weight_decay=0.1, mask={"w": True})
    with pytest.raises(KeyError, match=r"no entry for params \['b', 'e', 'norm.weight'\]"):
        opt.apply(grads[0], opt.init(params), params)


def test_chain_state_of_wrong_shape_is_named():
    opt = chain(clip_by_global_norm(1.0), sgd(0.1))
    params = {"w": torch.zeros(1)}
    with pytest.raises(ValueError, match="chain of 2 transformations got a state of 1 parts"):
        opt.apply(params, (sgd(0.1).init(params),), params)


# -- composition ----------------------------------------------------------------------------------


def test_aliases_keep_one_state_and_a_chain_keeps_the_tuple_of_its_parts_states():
    from trainfold.optim import AdamState, SgdState

    params = {"w": torch.zeros(2), "w.bias": torch.zeros(2)}
    assert isinstance(adamw(1e-3).init(params), AdamState) and isinstance(sgd(0.1).init(params), SgdState)
    clipped = chain(clip_by_global_norm(1.0), adamw(1e-3)).init(params)
    assert clipped[0] == () and isinstance(clipped[1], AdamState)  # the checkpoint layout: opt_state.1.mu.w


def test_a_chain_built_from_the_parts_agrees_with_the_alias():
    from trainfold.optim import add_decayed_weights, scale_by_adam, scale_by_learning_rate

    params, grads = random_problem(11)
    parts = chain(scale_by_adam(0.8, 0.99), add_decayed_weights(0.1, decay_mask_by_name), scale_by_learning_rate(1e-2))
    alias = adamw(1e-2, 0.8, 0.99, weight_decay=0.1)
    assert_close(run_ours(parts, params, grads), run_ours(alias, params, grads))  # the same math, other rounding
    sgd_parts = chain(add_decayed_weights(0.1), trace(0.9), scale_by_learning_rate(1e-2))
    ours, alias = run_ours(sgd_parts, params, grads), run_ours(sgd(1e-2, 0.9, weight_decay=0.1), params, grads)
    assert all(torch.equal(ours[k], alias[k]) for k in params)  # the same ops in the same order


@pytest.mark.parametrize(
    ("total", "warmup", "kwargs"),
    [
        (10, 0, {"min_lr_rate": 0.1}),
        (10, 3, {"min_lr_rate": 0.1}),
        (12, 4, {"min_lr": 0.03, "num_cycles": 1.0}),
        (9, 3, {"min_lr_rate": 0.0, "warmup_lr_rate": 0.2}),
        (5, 5, {"min_lr_rate": 0.5}),
    ],
)
def test_cosine_warmup_with_min_lr_equals_transformers(total, warmup, kwargs):
    transformers = pytest.importorskip("transformers")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    sched = transformers.get_scheduler(
        "cosine_warmup_with_min_lr",
        opt,
        num_warmup_steps=warmup,
        num_training_steps=total,
        scheduler_specific_kwargs=dict(kwargs),
    )
    theirs = []
    for _ in range(total + 3):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = named("cosine_warmup_with_min_lr", 0.3, warmup, total, **kwargs)
    assert [ours(k) for k in range(total + 3)] == pytest.approx(theirs, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("donate", [False, True])
def test_a_chain_lets_only_its_first_part_reuse_the_steps_known_norm(donate):
    from trainfold.core.tree import known_norm
    from trainfold.optim.transform import GradientTransformation

    def doubled_in_place(grads, state, params):  # returns the very mapping it changed
        for g in grads.values():
            g.mul_(2.0)
        return grads, state

    double = GradientTransformation(init=lambda params: (), update=doubled_in_place)
    params = {"a": torch.zeros(2)}
    first = {"a": torch.tensor([3.0, 4.0])}  # norm 5; the "known" 10 shows whether the clip took it
    with known_norm(first, torch.tensor(10.0)):
        opt = chain(clip_by_global_norm(1.0), sgd(1.0))
        clipped, _ = opt.apply(first, opt.init(params), params, donate=donate)
    assert torch.allclose(clipped["a"], torch.tensor([-0.3, -0.4]))  # the first part used the step's norm
    later = {"a": torch.tensor([3.0, 4.0])}
    with known_norm(later, torch.tensor(5.0)):  # stale once the first part doubles the gradients in place
        opt = chain(double, clip_by_global_norm(1.0), sgd(1.0))
        params = {"a": torch.zeros(2)}  # a donated apply stepped the first params in place
        clipped, _ = opt.apply(later, opt.init(params), params, donate=donate)
    assert torch.allclose(clipped["a"], torch.tensor([-0.6, -0.8]))  # the clip took the norm of [6, 8]: 10


@pytest.mark.parametrize("kernel", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
def test_adamw_maximize_is_torch_adamw_maximize_bitwise(kernel):
    params, grads = random_problem(3)
    ours = run_ours(adamw(1e-2, weight_decay=0.1, mask=None, maximize=True, **kernel), params, grads)
    ref = run_torch(
        lambda p: torch.optim.AdamW(p.values(), lr=1e-2, weight_decay=0.1, maximize=True, **kernel), params, grads
    )
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_maximize_matches_torch_sgd_maximize(nesterov):
    params, grads = random_problem(4)
    options = dict(momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    ours = run_ours(sgd(0.05, maximize=True, **options), params, grads)
    ref = run_torch(lambda p: torch.optim.SGD(p.values(), lr=0.05, maximize=True, **options), params, grads)
    assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    ascended = run_ours(sgd(0.05, **options), params, grads)
    assert not torch.allclose(ours["w"], ascended["w"])  # the direction changed


def test_adamw_amsgrad_is_refused_naming_from_torch_which_runs_it_bitwise():
    with pytest.raises(ValueError, match=r"amsgrad=True.*from_torch\(torch.optim.AdamW, lr=\.\.\., amsgrad=True"):
        adamw(1e-2, amsgrad=True)
    params, grads = random_problem(5)
    ours = run_ours(from_torch(torch.optim.AdamW, lr=1e-2, amsgrad=True, weight_decay=0.1), params, grads)
    ref = run_torch(lambda p: torch.optim.AdamW(p.values(), lr=1e-2, amsgrad=True, weight_decay=0.1), params, grads)
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
