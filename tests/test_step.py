"""The pure step: split invariance, purity, determinism, bad input."""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import EPS, assert_trees_within, gamma, grad_atol, reordered, row_abs_grads
from torch import nn

from trainfold import adamw, chain, clip_by_global_norm, fit, init_state, make_step, sgd
from trainfold.core.forward import make_forward
from trainfold.core.losses import causal_lm, cross_entropy
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import Cursor, scalar
from trainfold.core.tree import flatten
from trainfold.data import StepBatch
from trainfold.step import Execution

SMALL = TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=16)


def lm(seed: int = 0, dropout: float = 0.0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(attrs.evolve(SMALL, dropout=dropout))


def lm_samples(seed: int, n: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL.vocab_size, (n, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(n, seq, generator=g) < 0.3] = -100  # random padding / prompt masking
    return ids, labels


def split(ids: torch.Tensor, labels: torch.Tensor, sizes: list[int]) -> list[dict]:
    out, start = [], 0
    for size in sizes:
        out.append({"input_ids": ids[start : start + size], "labels": labels[start : start + size]})
        start += size
    return out


def sizes_strategy(n: int) -> st.SearchStrategy[list[int]]:
    """Random compositions of n into positive parts (a cut or not between neighbours)."""
    return st.lists(st.booleans(), min_size=n - 1, max_size=n - 1).map(lambda cuts: _compose(n, cuts))


def _compose(n: int, cuts: list[bool]) -> list[int]:
    sizes, cur = [], 1
    for c in cuts:
        if c:
            sizes.append(cur)
            cur = 1
        else:
            cur += 1
    sizes.append(cur)
    assert sum(sizes) == n
    return sizes


# -- examples --------------------------------------------------------------------------------------


@pytest.mark.parametrize("donate", [False, True])
def test_a_step_takes_the_gradients_norm_once_for_its_log_and_its_clipping(monkeypatch, donate):
    model = lm()
    ids, labels = lm_samples(1, 4, 12)
    opt = chain(clip_by_global_norm(1e-3), sgd(0.1))  # the clip acts
    state, batch = init_state(model, opt), [{"input_ids": ids, "labels": labels}]
    expected = make_step(lm(), causal_lm, opt)(init_state(lm(), opt), batch)  # the same model, computed apart
    real, calls = torch._foreach_norm, []
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    new = make_step(model, causal_lm, opt)(state, batch, donate=donate)
    assert len(calls) == 1  # the log's norm is the one the clip uses: one pass over the gradients
    assert float(new.metrics["grad_norm"]) > 1e-3 and all(
        torch.equal(new.params[k], expected.params[k]) for k in expected.params
    )


def test_step_matches_eager_backward_and_sgd_bitwise():
    model = lm()
    ids, labels = lm_samples(1, 4, 12)
    opt = sgd(0.1)
    state = init_state(model, opt)
    new = make_step(model, causal_lm, opt)(state, [{"input_ids": ids, "labels": labels}])

    n = (labels[:, 1:] != -100).sum()
    loss = causal_lm(model(ids), labels, n)
    loss.backward()
    with torch.no_grad():
        for name, p in model.named_parameters():
            assert torch.equal(new.params[name], p - 0.1 * p.grad), name
    assert torch.equal(new.metrics["loss"], loss.detach())  # the same forward, the same ops
    assert new.metrics["num_items"].item() == n.item()
    assert new.step.item() == 1


def test_loss_falls_on_repeated_batch():
    model = lm()
    ids, labels = lm_samples(2, 8, 12)
    opt = adamw(1e-2)
    step = make_step(model, causal_lm, opt)
    batch = [{"input_ids": ids, "labels": labels}]
    state = init_state(model, opt)
    first = step(state, batch).metrics["loss"].item()
    last = fit(step, state, [batch] * 20).metrics["loss"].item()
    assert last < first - 0.5


def test_dropout_is_seeded_by_seed_step_and_micro_index():
    model = lm(dropout=0.3)
    ids, labels = lm_samples(3, 4, 12)
    opt = sgd(0.1)
    step = make_step(model, causal_lm, opt)
    batch = [{"input_ids": ids, "labels": labels}]
    s0 = init_state(model, opt, seed=5)
    a, b = step(s0, batch), step(s0, batch)
    assert torch.equal(a.metrics["loss"], b.metrics["loss"])
    other_seed = step(init_state(model, opt, seed=6), batch)
    assert not torch.equal(a.metrics["loss"], other_seed.metrics["loss"])
    later = step(attrs.evolve(s0, step=s0.step + 1), batch)
    assert not torch.equal(a.metrics["loss"], later.metrics["loss"])
    rng_before = torch.get_rng_state()
    step(s0, batch)
    assert torch.equal(rng_before, torch.get_rng_state()), "the step must not advance the global RNG"


def test_step_restores_model_mode_and_leaves_model_params_alone():
    model = lm(dropout=0.2).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, labels = lm_samples(4, 2, 8)
    opt = adamw(1e-1)
    make_step(model, causal_lm, opt)(init_state(model, opt), [{"input_ids": ids, "labels": labels}])
    assert not model.training and not any(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_buffers_are_updated_out_of_place():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = sgd(0.1)
    state = init_state(model, opt)
    batch = [{"input": torch.randn(6, 3), "labels": torch.tensor([0, 1, 0, 1, 1, 0])}]
    new = make_step(model, cross_entropy, opt, label_key="labels")(state, batch)
    assert not torch.equal(new.buffers["1.running_mean"], state.buffers["1.running_mean"])
    assert torch.equal(state.buffers["1.running_mean"], torch.zeros(4))
    assert new.buffers["1.num_batches_tracked"].item() == 1


class _Counting(nn.Module):
    """Reassigns its buffer instead of updating it in place (as some research code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, input):
        self.calls = self.calls + 1
        return self.lin(input)


def test_a_reassigned_buffer_reaches_the_new_state_and_not_the_module():
    model = _Counting()
    opt = sgd(0.1)
    step = make_step(model, cross_entropy, opt)
    batch = [{"input": torch.randn(4, 3), "labels": torch.tensor([0, 1, 1, 0])}] * 2
    state = step(step(init_state(model, opt), batch), batch)
    assert state.buffers["calls"].item() == 4 and model.calls.item() == 0


def test_shared_and_replaced_submodules_use_the_state_tensors():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(3, 2))
    opt = sgd(0.1)
    state = init_state(model, opt)
    assert sorted(state.params) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    batch = [{"input": torch.randn(5, 3), "labels": torch.tensor([0, 1, 1, 0, 1])}]
    step = make_step(model, cross_entropy, opt)
    first = step(state, batch)

    reference = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(3, 2))
    reference.load_state_dict(model.state_dict())
    loss = nn.functional.cross_entropy(reference(batch[0]["input"]), batch[0]["labels"])
    grads = torch.autograd.grad(loss, [shared.weight, reference[3].weight])
    assert torch.equal(first.params["0.weight"], state.params["0.weight"] - 0.1 * grads[0])
    assert torch.equal(first.params["3.weight"], state.params["3.weight"] - 0.1 * grads[1])

    model[3] = nn.Linear(3, 2)  # the tree changed: the step must find the slots again
    again = step(state, batch)
    for k in state.params:
        assert torch.equal(again.params[k], first.params[k]), k
    assert not torch.equal(model[3].weight, state.params["3.weight"])


def test_objective_replaces_forward_and_loss():
    model = nn.Linear(2, 1)
    opt = sgd(1.0)
    calls = []

    def objective(forward, params, micro, num_items, key):
        calls.append(num_items.item())
        pred = forward(params, {"input": micro["x"]}).squeeze(-1)
        loss = ((pred - micro["y"]) ** 2).sum() / num_items
        return loss, {"abs_err": (pred - micro["y"]).abs().sum().detach() / num_items}

    objective.count_items = lambda micro: torch.tensor(micro["x"].shape[0])
    step = make_step(model, optimizer=opt, objective=objective)
    batch = [{"x": torch.ones(3, 2), "y": torch.zeros(3)}, {"x": torch.ones(1, 2), "y": torch.zeros(1)}]
    new = step(init_state(model, opt), batch)
    assert calls == [4, 4]
    assert "abs_err" in new.metrics and new.metrics["abs_err"] > 0


# -- properties ------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 8), data=st.data())
def test_causal_lm_update_is_independent_of_micro_batch_split(seed, n, data):
    sizes = data.draw(sizes_strategy(n), label="sizes")
    model = lm(seed % 7)
    ids, labels = lm_samples(seed, n, 10)
    opt = chain(clip_by_global_norm(1e9), sgd(0.5, momentum=0.9))
    step = make_step(model, causal_lm, opt)
    state = init_state(model, opt)
    whole = step(state, split(ids, labels, [n]))
    parts = step(state, split(ids, labels, sizes))
    if whole.metrics["num_items"] == 0:
        return
    # The same token terms summed in another order (tests/tolerance.py): each gradient tensor within
    # grad_atol; SGD's first step (m = g; the 1e9 clip's coefficient is exactly 1.0) moves params by 0.5 g,
    # rounded once (eps |p|). The loss sums T positive token losses: 2 gamma(T - 1) relative. The norm adds
    # the gradients' difference and its own N-term sum of squares: sqrt(sum atol^2 numel) / norm + gamma(N).
    tokens = int(whole.metrics["num_items"])
    forward = make_forward(model, {})
    row = lambda p, r: causal_lm(forward(p, {"input_ids": ids[r : r + 1]}), labels[r : r + 1], tokens)
    atol = grad_atol(row_abs_grads(row, state.params, range(n)), tokens)
    assert_trees_within(whole.params, parts.params, {k: 0.5 * v for k, v in atol.items()}, rtol=EPS)
    torch.testing.assert_close(whole.metrics["loss"], parts.metrics["loss"], rtol=reordered(tokens, 1.0), atol=0)
    norm, size = whole.metrics["grad_norm"], sum(v.numel() for v in state.params.values())
    moved = sum(atol[k] ** 2 * v.numel() for k, v in state.params.items()) ** 0.5 / norm.item() + gamma(size)
    torch.testing.assert_close(norm, parts.metrics["grad_norm"], rtol=moved, atol=0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 10), data=st.data())
def test_cross_entropy_update_is_independent_of_micro_batch_split(seed, n, data):
    sizes = data.draw(sizes_strategy(n), label="sizes")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(n, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.2] = -100
    opt = sgd(0.5, momentum=0.9)  # linear in the gradients: a summation order cannot be amplified (tolerance.py)
    step = make_step(model, cross_entropy, opt)
    state = init_state(model, opt)

    def batch(sz):
        out, s = [], 0
        for k in sz:
            out.append({"input": x[s : s + k], "labels": y[s : s + k]})
            s += k
        return out

    if (y != -100).sum() == 0:
        return
    whole, parts = step(state, batch([n])), step(state, batch(sizes))
    # The n rows' terms summed in another order: each gradient within grad_atol (tests/tolerance.py); the
    # first momentum is the gradient itself, and the params move by 0.5 of it, rounded once (eps |p|).
    count = int((y != -100).sum())
    forward = make_forward(model, {})
    row = lambda p, r: cross_entropy(forward(p, {"input": x[r : r + 1]}), y[r : r + 1], count)
    # each row's own products (forward 5 + 8 inputs, the 3-class softmax; backward through the 3 logits) may
    # run in another kernel when the batch has another shape: inner = 5 + 8 + 3 + 3 (tolerance.grad_atol)
    atol = grad_atol(row_abs_grads(row, state.params, range(n)), n, inner=19)
    assert_trees_within(whole.opt_state.momentum, parts.opt_state.momentum, atol, rtol=0)
    assert_trees_within(whole.params, parts.params, {k: 0.5 * v for k, v in atol.items()}, rtol=EPS)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), dropout=st.sampled_from([0.0, 0.2]), micro=st.integers(1, 3))
def test_step_never_mutates_its_inputs(seed, dropout, micro):
    model = lm(seed % 5, dropout)
    ids, labels = lm_samples(seed, 2 * micro, 8)
    opt = chain(clip_by_global_norm(0.5), adamw(1e-2, weight_decay=0.1))
    step = make_step(model, causal_lm, opt)
    state = step(init_state(model, opt, seed=seed), split(ids, labels, [2] * micro))  # non-trivial opt state
    batch = split(ids, labels, [2] * micro)
    watched = {**flatten(state, "state"), **{f"batch.{i}.{k}": v for i, mb in enumerate(batch) for k, v in mb.items()}}
    versions = {k: v._version for k, v in watched.items()}
    copies = {k: v.clone() for k, v in watched.items()}
    step(state, batch)
    for k, v in watched.items():
        assert v._version == versions[k], f"{k} was written in place"
        assert torch.equal(v, copies[k]), f"{k} changed"


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), cut=st.integers(0, 5))
def test_fit_is_a_fold_bitwise(seed, cut):
    model = lm(seed % 3, dropout=0.1)
    batches = []
    for i in range(5):
        ids, labels = lm_samples(seed + i, 4, 8)
        batches.append(split(ids, labels, [2, 2]))
    opt = chain(clip_by_global_norm(1.0), adamw(1e-2, weight_decay=0.01))
    step = make_step(model, causal_lm, opt)
    s0 = init_state(model, opt, seed=seed)
    straight = fit(step, s0, batches)
    resumed = fit(step, fit(step, s0, batches[:cut]), batches[cut:])
    a, b = flatten(straight), flatten(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- bad input -------------------------------------------------------------------------------------


def test_a_step_without_items_counts_but_learns_nothing():
    model = lm()
    ids, labels = lm_samples(0, 2, 8)
    opt = adamw(1e-2)
    step = make_step(model, causal_lm, opt)
    first = step(init_state(model, opt), [{"input_ids": ids, "labels": labels}])
    batch = StepBatch([{"input_ids": ids, "labels": torch.full_like(ids, -100)}], Cursor(scalar(0), scalar(2)))
    with pytest.warns(RuntimeWarning, match="no labels other than -100.*the step counts"):
        new = step(first, batch)
    assert new.step.item() == 2 and new.cursor.as_tuple() == (0, 2)
    assert new.nonfinite_losses.item() == 1 and new.loss_total.item() == first.loss_total.item()
    assert torch.isnan(new.metrics["loss"]) and new.metrics["num_items"].item() == 0
    assert new.metrics["grad_norm"].item() == 0.0
    a, b = flatten({"p": first.params, "o": first.opt_state}), flatten({"p": new.params, "o": new.opt_state})
    assert all(torch.equal(a[k], b[k]) for k in a)  # params and optimizer moments (and their count) unchanged
    again = step(new, [{"input_ids": ids, "labels": labels}])
    assert again.step.item() == 3 and torch.isfinite(again.metrics["loss"])


# -- parameters the step cannot see -----------------------------------------------------------------


class _Hidden(nn.Module):
    """Keeps a copy of its weight outside the parameter slots (as a sharding wrapper would)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.copy = self.weight.detach().clone().requires_grad_()

    def forward(self, input):
        return input @ self.copy.T


def test_a_step_in_which_no_parameter_gets_a_gradient_is_an_error():
    model = _Hidden()
    opt = sgd(0.1)
    batch = [{"input": torch.randn(2, 4), "labels": torch.tensor([0, 2])}]
    with pytest.raises(
        RuntimeError,
        match=r"no trainable parameter of _Hidden received a gradient in step 0.*"
        r"FSDP/fully_shard or DTensor",
    ):
        make_step(model, cross_entropy, opt)(init_state(model, opt), batch)
    detached = make_step(nn.Linear(4, 3), lambda out, y, n: cross_entropy(out.detach(), y, n), opt)
    with pytest.raises(RuntimeError, match="no trainable parameter of Linear received a gradient"):
        detached(init_state(nn.Linear(4, 3), opt), batch)


def test_frozen_and_unused_parameters_still_train_the_rest():
    torch.manual_seed(0)
    model = nn.ModuleDict({"frozen": nn.Linear(4, 4), "head": nn.Linear(4, 3), "unused": nn.Linear(2, 2)})
    model["frozen"].requires_grad_(False)
    model.forward = lambda input: model["head"](model["frozen"](input))
    opt = sgd(0.1)
    state = init_state(model, opt)
    new = make_step(model, cross_entropy, opt)(state, [{"input": torch.randn(2, 4), "labels": torch.tensor([0, 2])}])
    assert not torch.equal(new.params["head.weight"], state.params["head.weight"])
    assert torch.equal(new.params["unused.weight"], state.params["unused.weight"])  # a zero gradient, as before
    assert torch.equal(new.buffers["frozen.weight"], state.buffers["frozen.weight"])


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_fully_shard_modules_step_lent_states_and_dtensor_modules_are_refused_by_name(one_process_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    fully_shard(sharded, mesh=one_process_group)
    step = make_step(sharded, cross_entropy, sgd(0.1))  # FSDP2: the step runs it as it is, on a lent state
    batch = [{"input": torch.ones(4, 2), "labels": torch.tensor([0, 1, 2, 0])}]
    with pytest.raises(TypeError, match=r"FSDPSequential is wrapped with fully_shard \(FSDP2\)"):
        step(init_state(sharded, sgd(0.1)), batch)
    assert int(step(init_state(sharded, sgd(0.1), copy=False), batch, donate=True).step) == 1
    lin = nn.Linear(2, 3)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), one_process_group, [Shard(0)]))
    with pytest.raises(TypeError, match=r"parameter 'weight' is a DTensor .* wrap the module with .*fully_shard"):
        make_step(lin, cross_entropy, sgd(0.1))


def test_labels_out_of_vocabulary_are_named():
    model = lm()
    ids, labels = lm_samples(0, 2, 8)
    labels[0, 3] = SMALL.vocab_size + 5
    opt = sgd(0.1)
    with pytest.raises(ValueError, match=r"labels \[37\] are outside the 32 classes"):
        make_step(model, causal_lm, opt)(init_state(model, opt), [{"input_ids": ids, "labels": labels}])


def test_mismatched_label_shape_is_named():
    model = lm()
    ids, labels = lm_samples(0, 2, 8)
    opt = sgd(0.1)
    with pytest.raises(ValueError, match=r"do not fit labels of shape \(2, 7\)"):
        make_step(model, causal_lm, opt)(init_state(model, opt), [{"input_ids": ids, "labels": labels[:, :7]}])


def test_missing_labels_key_is_named():
    model = lm()
    ids, _ = lm_samples(0, 2, 8)
    opt = sgd(0.1)
    with pytest.raises(KeyError, match="no 'labels' key"):
        make_step(model, causal_lm, opt)(init_state(model, opt), [{"input_ids": ids}])


def test_optimizer_state_with_unknown_keys_is_named():
    model = lm()
    ids, labels = lm_samples(0, 2, 8)
    opt = adamw(1e-3)
    state = init_state(model, opt)
    bad_mu = {("extra.weight" if k == "tok.weight" else k): v for k, v in state.opt_state.mu.items()}
    bad = attrs.evolve(state, opt_state=attrs.evolve(state.opt_state, mu=bad_mu))
    with pytest.raises(
        KeyError,
        match=r"Adam state and params have different keys: missing \['tok.weight'\], unexpected \['extra.weight'\]",
    ):
        make_step(model, causal_lm, opt)(bad, [{"input_ids": ids, "labels": labels}])


def test_make_step_without_optimizer_says_what_to_pass():
    with pytest.raises(TypeError, match="needs an optimizer"):
        make_step(lm(), causal_lm)


def test_how_a_step_runs_is_an_execution_record_or_its_fields_as_keywords():
    model = lm()
    ids, labels = lm_samples(2, 4, 12)
    opt = sgd(0.1)
    batch = [{"input_ids": ids, "labels": labels}]
    state = init_state(model, opt)
    record = make_step(model, causal_lm, opt, execution=Execution(gradient_checkpointing=True))(state, batch)
    keyword = make_step(model, causal_lm, opt, gradient_checkpointing=True)(state, batch)
    assert record.metrics["loss"].item() == keyword.metrics["loss"].item()
    assert all(torch.equal(record.params[k], keyword.params[k]) for k in record.params)
    # a keyword overrides the record's field; a wrong one is refused naming the fields
    over = make_step(model, causal_lm, opt, execution=Execution(differentiable=True), differentiable=False)
    assert getattr(over, "engine", "none") is None  # the eager step (a differentiable one has no engine)
    with pytest.raises(TypeError, match=r"unexpected keywords \['compile_mod'\].*'compile_mode'"):
        make_step(model, causal_lm, opt, compile_mod="default")


def test_no_warning_on_a_normal_step():
    model = lm()
    ids, labels = lm_samples(0, 2, 8)
    opt = sgd(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_step(model, causal_lm, opt)(init_state(model, opt), [{"input_ids": ids, "labels": labels}])
