"""The Hypothesis strategies of trainfold.testing produce what their docstrings promise."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import EPS, causal_lm_step_abs_grads, grad_atol

from trainfold import init_state, make_step, sgd
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.data.samplers import LENGTH_STRATEGIES, Sampler
from trainfold.testing import (
    label_tensors,
    lengths,
    on_simulated_ranks,
    sampler_configs,
    skewed_lengths,
    tensor_dicts,
    token_items,
    uniform_lengths,
)

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(skewed_lengths(min_size=1, max_size=20, max_length=300))
def test_skewed_lengths_are_positive_and_bounded(xs):
    assert 1 <= len(xs) <= 20
    assert all(isinstance(x, int) and 1 <= x <= 300 for x in xs)


@FAST
@given(uniform_lengths(min_size=2, max_size=5, min_length=3, max_length=9), lengths(max_size=4))
def test_uniform_lengths_stay_in_range(xs, ys):
    assert 2 <= len(xs) <= 5 and all(3 <= x <= 9 for x in xs)
    assert len(ys) <= 4 and all(y >= 1 for y in ys)


@FAST
@given(label_tensors(vocab_size=8, batch_size=st.just(3), seq_len=st.just(5)))
def test_label_tensors_hold_tokens_or_minus_100_right_padding(labels):
    assert labels.shape == (3, 5) and labels.dtype == torch.long
    real = labels != -100
    assert ((labels >= 0) & (labels < 8) | ~real).all()
    for row in real:  # an optional masked prompt, one run of tokens, then padding
        at = row.nonzero().flatten().tolist()
        assert at == list(range(at[0], at[0] + len(at))) if at else True


@FAST
@given(label_tensors(prompt_masking=False))
def test_label_tensors_without_prompts_start_with_tokens(labels):
    for row in labels:
        n = int((row != -100).sum())
        assert (row[:n] != -100).all()


@FAST
@given(tensor_dicts(keys=["weight", "bias"], bound=10.0))
def test_tensor_dicts_are_finite_and_keyed(tree):
    assert sorted(tree) == ["bias", "weight"]
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() and t.abs().max() <= 10 for t in tree.values())


@FAST
@given(token_items(max_size=4, max_length=6, vocab_size=5))
def test_token_items_copy_inputs_to_labels(items):
    assert 1 <= len(items) <= 4
    assert all(it["input_ids"] == it["labels"] and 1 <= len(it["input_ids"]) <= 6 for it in items)


@FAST
@given(sampler_configs(num_samples=st.integers(0, 10)))
def test_sampler_configs_are_valid_samplers(s):
    assert isinstance(s, Sampler) and 0 <= s.rank < s.world_size and s.num_samples <= 10
    assert (s.lengths is not None) == (s.strategy in LENGTH_STRATEGIES)
    s.epoch_batches(0)  # every configuration can produce an epoch


TINY = TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8)


def _tiny(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TINY)


@settings(max_examples=10, deadline=None)
@given(world=st.integers(1, 3), per_rank=st.integers(1, 3), data=st.data())
def test_a_step_on_simulated_ranks_equals_one_process_on_all_their_samples(world, per_rank, data):
    labels = data.draw(label_tensors(vocab_size=16, batch_size=st.just(world * per_rank), seq_len=st.just(6)))
    ids = labels.clamp(min=0)
    opt = sgd(0.5)
    state = init_state(_tiny(), opt)
    alone = make_step(_tiny(), causal_lm, opt)(state, [{"input_ids": ids, "labels": labels}])

    def rank_step(c):  # each rank its own module, its own contiguous slice of the samples
        part = slice(c.rank * per_rank, (c.rank + 1) * per_rank)
        step = make_step(_tiny(), causal_lm, opt, collective=c)
        return step(state, [{"input_ids": ids[part], "labels": labels[part]}])

    # the ranks add the token terms in another order: each gradient within grad_atol of the measured sizes,
    # which SGD moves the params by 0.5 of, rounded once (tests/tolerance.py)
    atol = grad_atol(*causal_lm_step_abs_grads(_tiny(), [{"input_ids": ids, "labels": labels}], state.params))
    for new in on_simulated_ranks(world, rank_step):
        assert new.metrics["num_items"].item() == alone.metrics["num_items"].item()  # counted over all ranks
        for k in state.params:
            torch.testing.assert_close(new.params[k], alone.params[k], rtol=EPS, atol=0.5 * atol[k])


def test_simulated_ranks_raise_what_a_rank_raised():
    def fail_on_one(c):
        if c.rank == 1:
            raise KeyError("rank 1 broke")
        c.sum_([torch.zeros(1)])  # the others wait at the barrier until it breaks

    with pytest.raises(KeyError, match="rank 1 broke"):
        on_simulated_ranks(3, fail_on_one, timeout=10)
    with pytest.raises(ValueError, match="at least 1"):
        on_simulated_ranks(0, lambda c: None)
