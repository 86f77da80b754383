"""Donation: a donated state is updated in place (one copy of the weights), bitwise as the pure step, then refused."""

from __future__ import annotations

import math
import tempfile
import warnings

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step, sgd
from trainfold.core.fold import fit, trajectory
from trainfold.core.losses import causal_lm, cross_entropy
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import DonatedStateError, is_donated
from trainfold.core.tree import flatten
from trainfold.step.ensemble import init_ensemble_state, make_ensemble_step, stack_batches

CFG = TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=8)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def tiny(dropout: float = 0.0, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(attrs.evolve(CFG, dropout=dropout))


def lm_batch(seed: int, micro: int = 1, rows: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro):
        ids = torch.randint(0, CFG.vocab_size, (rows, CFG.max_len), generator=g)
        labels = ids.clone()
        labels[torch.rand(rows, CFG.max_len, generator=g) < 0.3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def tensors(state) -> dict[str, torch.Tensor]:
    return flatten(
        {
            "params": state.params,
            "buffers": state.buffers,
            "opt": state.opt_state,
            "metrics": state.metrics,
            "step": state.step,
            "loss_total": state.loss_total,
        }
    )


def bitwise(a, b) -> bool:
    fa, fb = tensors(a), tensors(b)
    return fa.keys() == fb.keys() and all(fa[k].dtype == fb[k].dtype and same(fa[k], fb[k]) for k in fa)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN (a skipped float16 step logs a NaN norm)."""
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def copy_of(state):
    """The same state on fresh tensors (a donated run and a pure run need their own)."""

    def clone(node):
        if isinstance(node, torch.Tensor):
            return node.clone()
        if attrs.has(type(node)):
            fields = [f.name for f in attrs.fields(type(node)) if f.init]
            return attrs.evolve(node, **{name: clone(getattr(node, name)) for name in fields})
        if isinstance(node, dict):
            return {k: clone(v) for k, v in node.items()}
        if isinstance(node, tuple):
            return tuple(clone(v) for v in node)
        return node

    return clone(state)


def storage(state) -> dict[str, int]:
    return {
        k: v.data_ptr()
        for k, v in flatten({"params": state.params, "opt": state.opt_state}).items()
        if v.is_floating_point()
    }


CLIPPED = chain(clip_by_global_norm(0.05), adamw(1e-2, weight_decay=0.1))


# -- examples -------------------------------------------------------------------------------------------


def test_a_donated_step_updates_in_place_bitwise_as_the_pure_step():
    model = tiny()
    step = make_step(model, causal_lm, CLIPPED)
    pure_state = init_state(model, CLIPPED)
    donated = copy_of(pure_state)
    where = storage(donated)
    for i in range(3):
        batch = lm_batch(i, micro=2)
        pure_state = step(pure_state, batch)
        donated = step(donated, batch, donate=True)
        assert bitwise(pure_state, donated)
        assert storage(donated) == where  # params and both moments stay in the same memory
    assert pure_state.metrics["grad_norm"].item() > 0.05  # the clip did act


def test_a_donated_state_refuses_every_later_use_by_name():
    model = tiny()
    step = make_step(model, causal_lm, CLIPPED)
    state = init_state(model, CLIPPED)
    new = step.donating(state, lm_batch(0))
    assert is_donated(state) and not is_donated(new)
    with pytest.raises(DonatedStateError, match="donated to step 1: its params were updated in place"):
        step(state, lm_batch(1))
    with pytest.raises(DonatedStateError, match="use the state the step returned"):
        state.params["embed.weight"]
    with pytest.raises(DonatedStateError, match="its opt_state"):
        _ = state.opt_state[1].mu
    with pytest.raises(DonatedStateError, match="donated to step 1"):
        step(state, lm_batch(1), donate=True)
    assert state.step.item() == 0 and new.step.item() == 1  # counters stay readable


def test_the_pure_step_never_touches_its_input_versions():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.3), nn.Linear(4, 2))
    opt = chain(clip_by_global_norm(0.01), adamw(1e-2))
    step = make_step(model, cross_entropy, opt)
    state = init_state(model, opt)
    state = step(state, [{"input": torch.randn(5, 3), "labels": torch.tensor([0, 1, 1, 0, 1])}])
    versions = {k: v._version for k, v in tensors(state).items()}
    values = {k: v.clone() for k, v in tensors(state).items()}
    step(state, [{"input": torch.randn(5, 3), "labels": torch.tensor([0, 1, 1, 0, 1])}] * 2)
    assert {k: v._version for k, v in tensors(state).items()} == versions
    assert all(torch.equal(v, values[k]) for k, v in tensors(state).items())


def test_broadcast_gradients_are_clipped_without_writing_through_a_view():
    w = nn.Parameter(torch.ones(3))

    class Sum(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, input):
            return self.w.sum() + 0 * input.sum()

    model = Sum()
    opt = chain(clip_by_global_norm(0.5), sgd(0.1))
    step = make_step(model, lambda out, labels, n: out, opt, count_items=lambda mb: torch.tensor(1))
    state = init_state(model, opt)
    pure = step(state, [{"input": torch.ones(1), "labels": torch.ones(1)}])
    donated = step(copy_of(state), [{"input": torch.ones(1), "labels": torch.ones(1)}], donate=True)
    assert bitwise(pure, donated)
    assert torch.allclose(pure.params["w"], torch.ones(3) - 0.1 * 0.5 / math.sqrt(3), atol=1e-6)


def test_float16_steps_that_loss_scaling_skips_keep_a_donated_state_bitwise_too():
    from trainfold.step.amp import SCALER, LossScaling, initial_scaler

    scaling = LossScaling(init_scale=2.0**15, growth_interval=1)  # overflows (skips) at first, then backs off
    model = tiny()
    step = make_step(model, causal_lm, CLIPPED, autocast=torch.float16, loss_scaling=scaling)
    pure = init_state(model, CLIPPED, extras={SCALER: initial_scaler(scaling)})
    donated = copy_of(pure)
    where, skipped = storage(donated), 0
    for i in range(8):
        batch = lm_batch(i)
        new = step(pure, batch)
        skipped += int(new.opt_state[1].count) == int(pure.opt_state[1].count)
        pure, donated = new, step(donated, batch, donate=True)
        assert bitwise(pure, donated) and storage(donated) == where
        assert torch.equal(pure.extras[SCALER].scale, donated.extras[SCALER].scale)
    assert 1 <= skipped < 8


# -- property: donated == pure, bitwise ------------------------------------------------------------------


OPTIMIZERS = {
    "adamw fused + clip": lambda: chain(clip_by_global_norm(0.05), adamw(1e-2, weight_decay=0.1, fused=True)),
    "adamw foreach + clip": lambda: chain(clip_by_global_norm(0.05), adamw(1e-2, weight_decay=0.1, foreach=True)),
    "adamw": lambda: adamw(1e-2),
    "sgd momentum + clip (copied back)": lambda: chain(
        clip_by_global_norm(0.1), sgd(0.1, momentum=0.9, weight_decay=0.01)
    ),
}


@settings(max_examples=6)
@given(
    opt=st.sampled_from(sorted(OPTIMIZERS)),
    micro=st.integers(1, 3),
    dropout=st.sampled_from([0.0, 0.3]),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_donated_and_pure_steps_are_bitwise_equal(opt, micro, dropout, steps, seed):
    model = tiny(dropout, seed)
    optimizer = OPTIMIZERS[opt]()
    step = make_step(model, causal_lm, optimizer)
    pure = init_state(model, optimizer, seed=seed)
    donated = copy_of(pure)
    for i in range(steps):
        batch = lm_batch(seed + i, micro=micro)
        pure, donated = step(pure, batch), step(donated, batch, donate=True)
    assert bitwise(pure, donated)


_COMPILED: dict = {}


def compiled_step(micro: int):
    if micro not in _COMPILED:  # one compiled step per shape of batch: compiling is the slow part
        model = tiny(0.3)
        _COMPILED[micro] = model, make_step(model, causal_lm, CLIPPED, compile="aot_eager")
    return _COMPILED[micro]


@settings(max_examples=2)
@given(micro=st.just(2), seed=st.integers(0, 2**16))  # accumulation; one compile (the slow part)
def test_compiled_donated_and_pure_steps_are_bitwise_equal(micro, seed):
    model, step = compiled_step(micro)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the eager step would not test the compiled one
        pure = init_state(model, CLIPPED, seed=seed)
        donated = copy_of(pure)
        where = storage(donated)
        for i in range(2):
            batch = lm_batch(seed + i, micro=micro)
            pure, donated = step(pure, batch), step(donated, batch, donate=True)
    assert bitwise(pure, donated) and storage(donated) == where


@settings(max_examples=2)
@given(micro=st.integers(1, 2), batching=st.sampled_from(["vmap", "unroll"]), seed=st.integers(0, 2**16))
def test_ensemble_donated_and_pure_steps_are_bitwise_equal(micro, batching, seed):
    models = [tiny(0.3, seed + m) for m in range(2)]
    opts = [chain(clip_by_global_norm(0.05), adamw(1e-2)), chain(clip_by_global_norm(0.1), adamw(1e-3))]
    step = make_ensemble_step(models[0], causal_lm, opts, batching=batching)
    pure = init_ensemble_state(models, opts, seeds=[seed, seed + 1])
    donated = copy_of(pure)
    where = storage(donated)
    for i in range(2):
        batch = stack_batches([lm_batch(seed + i, micro), lm_batch(seed + 7 + i, micro)])
        pure, donated = step(pure, batch), step(donated, batch, donate=True)
    assert bitwise(pure, donated) and storage(donated) == where
    step(pure, batch, donate=True)
    with pytest.raises(DonatedStateError, match="donated to step 3"):
        step(pure, batch)


# -- fit, trajectory, init_state(copy=False) ---------------------------------------------------------------


def test_fit_donates_the_states_it_makes_but_not_the_one_it_is_given():
    model = tiny()
    step = make_step(model, causal_lm, CLIPPED)
    s0 = init_state(model, CLIPPED)
    versions = {k: v._version for k, v in tensors(s0).items()}
    batches = [lm_batch(i) for i in range(3)]
    out = fit(step, s0, batches)
    assert not is_donated(s0) and {k: v._version for k, v in tensors(s0).items()} == versions
    by_hand = s0
    for b in batches:
        by_hand = step(by_hand, b)
    assert bitwise(out, by_hand)
    again = fit(step, copy_of(s0), batches, donate=True)
    assert bitwise(again, by_hand)


def test_fit_with_donate_invalidates_the_state_passed_in():
    model = tiny()
    step = make_step(model, causal_lm, CLIPPED)
    s0 = init_state(model, CLIPPED)
    fit(step, s0, [lm_batch(0)], donate=True)
    with pytest.raises(DonatedStateError):
        fit(step, s0, [lm_batch(0)])


def test_trajectory_donates_only_when_asked():
    model = tiny()
    step = make_step(model, causal_lm, CLIPPED)
    kept = list(trajectory(step, init_state(model, CLIPPED), [lm_batch(i) for i in range(3)]))
    assert not any(is_donated(s) for s in kept)
    states = list(trajectory(step, init_state(model, CLIPPED), [lm_batch(i) for i in range(3)], donate=True))
    assert [is_donated(s) for s in states] == [True, True, False]
    assert bitwise(states[-1], kept[-1])


def test_init_state_copy_false_lends_the_module_its_parameters():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lent = init_state(model, CLIPPED, copy=False)
    assert all(lent.params[k] is p for k, p in model.named_parameters())
    step = make_step(model, causal_lm, CLIPPED)
    pure = step(lent, lm_batch(0))  # without donation the module is untouched
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    donated = step(lent, lm_batch(0), donate=True)  # donated: the module holds the trained weights
    assert bitwise(pure, donated)
    assert all(donated.params[k] is p and p.grad is None for k, p in model.named_parameters())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_lent_path_equals_the_pure_path_bitwise_over_steps_with_accumulation(dropout):
    """A lent, donated state runs the module as it is (grads in .grad); a copied state runs functional_call."""
    opt = chain(clip_by_global_norm(1.0), adamw(1e-2, weight_decay=0.1))
    pure_model, lent_model = tiny(dropout), tiny(dropout)
    pure_step, lent_step = make_step(pure_model, causal_lm, opt), make_step(lent_model, causal_lm, opt)
    pure, lent = init_state(pure_model, opt), init_state(lent_model, opt, copy=False)
    for i in range(4):
        pure = pure_step(pure, lm_batch(i, micro=3))
        lent = lent_step(lent, lm_batch(i, micro=3), donate=True)
        assert all(lent.params[k] is p for k, p in lent_model.named_parameters())
    assert bitwise(pure, lent)
    assert all(torch.equal(p, pure.params[k]) for k, p in lent_model.named_parameters())


# -- train: one copy of the weights, and the rule for the module ------------------------------------------


ROWS = [{"input_ids": [i % 7, i % 5, 1, 2], "labels": [i % 7, i % 5, 1, 2]} for i in range(16)]


def args(**kw):
    from trainfold import TrainingArguments

    base = dict(
        output_dir=tempfile.mkdtemp(),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        gradient_accumulation_steps=2,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    return TrainingArguments(**{**base, **kw})


def test_train_trains_the_modules_own_storage_bitwise_as_the_pure_fold():
    from trainfold import train

    model = tiny()
    reference = tiny()
    where = {k: p.data_ptr() for k, p in model.named_parameters()}
    result = train(model, args(), ROWS)
    assert {k: p.data_ptr() for k, p in model.named_parameters()} == where  # no second copy: trained in place
    assert all(result.state.params[k].data_ptr() == where[k] for k in result.state.params)
    again = train(reference, args(), ROWS)  # the same run again: deterministic
    assert all(torch.equal(p, dict(reference.named_parameters())[k]) for k, p in model.named_parameters())
    assert again.metrics["train_loss"] == result.metrics["train_loss"]


def test_a_diverged_train_leaves_the_module_holding_the_states_weights(caplog):
    from trainfold import train

    def nan_at_2(outputs, labels, num_items):
        loss = causal_lm(outputs, labels, num_items)
        return loss * float("nan") if nan_at_2.calls == 2 else loss

    nan_at_2.calls = 0

    def counting(outputs, labels, num_items):
        nan_at_2.calls += 1
        return nan_at_2(outputs, labels, num_items)

    counting.count_items = getattr(causal_lm, "count_items", None)
    model = tiny()
    with caplog.at_level("ERROR", logger="trainfold"):
        result = train(model, args(max_steps=4, gradient_accumulation_steps=1), ROWS, compute_loss_func=counting)
    assert "diverged" in caplog.text  # the trainfold logger's event
    assert result.status == "diverged"
    assert all(p.data_ptr() == result.state.params[k].data_ptr() for k, p in model.named_parameters())
    assert any(not bool(p.isfinite().all()) for p in model.parameters())


def test_a_train_that_raises_leaves_the_module_with_the_last_completed_steps_weights():
    from trainfold import train

    def failing_at(n):
        calls = []

        def loss(outputs, labels, num_items):
            calls.append(1)
            if len(calls) == n:
                raise RuntimeError(f"boom at step {n}")
            return causal_lm(outputs, labels, num_items)

        return loss

    model = tiny()
    with pytest.raises(RuntimeError, match="boom"):
        train(model, args(max_steps=4, gradient_accumulation_steps=1), ROWS, compute_loss_func=failing_at(3))
    stopped = tiny()  # the same run (same loss, same schedule) stopped after its 2 completed steps
    train(
        stopped,
        args(max_steps=4, gradient_accumulation_steps=1),
        ROWS,
        compute_loss_func=failing_at(0),
        stop=lambda s: int(s.step) >= 2,
    )
    assert all(torch.equal(p, dict(stopped.named_parameters())[k]) for k, p in model.named_parameters())
    assert not all(torch.equal(p, dict(tiny().named_parameters())[k]) for k, p in model.named_parameters())


def test_a_dpo_reference_taken_from_the_module_stays_frozen_while_train_trains_the_module():
    from trainfold import train
    from trainfold.dpo.objective import dpo_objective, preference_collate

    model = tiny()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    objective = dpo_objective(0.1, ref_params={k: v.detach() for k, v in model.named_parameters()})  # aliases
    items = [{"prompt_ids": [1, 2 + i % 5], "chosen_ids": [7, 8], "rejected_ids": [9 + i % 3]} for i in range(8)]
    result = train(
        model,
        args(max_steps=2, gradient_accumulation_steps=1),
        items,
        data_collator=preference_collate(eos_token_id=2),
        objective=objective,
    )
    assert result.status == "completed"
    assert not all(torch.equal(p, initial[k]) for k, p in model.named_parameters())  # the module was trained
    assert all(torch.equal(objective.ref_params[k], initial[k]) for k in initial)  # the reference was not
