"""Losses: forms of outputs, agreement with HF's own loss, normalisation by the global count."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.core import losses
from trainfold.core.losses import (
    causal_lm,
    count_labels,
    count_shifted_labels,
    counter_for,
    cross_entropy,
    label_smoothed,
    logits_of,
)


def test_outputs_may_be_tensor_mapping_or_object():
    logits = torch.randn(2, 3)
    assert logits_of(logits) is logits
    assert logits_of({"logits": logits}) is logits
    assert logits_of(types.SimpleNamespace(logits=logits)) is logits
    with pytest.raises(TypeError, match="cannot find logits in model outputs of type int"):
        logits_of(3)


def test_logits_are_upcast_to_float32():
    logits = torch.randn(2, 5, 7).to(torch.bfloat16)
    labels = torch.randint(0, 7, (2, 5))
    out = causal_lm(logits, labels, count_shifted_labels(labels))
    assert out.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 7), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out, ref)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 5), t=st.integers(2, 9))
def test_causal_lm_matches_transformers_for_causal_lm_loss(seed, n, t):
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, t, 11, generator=g)
    labels = torch.randint(0, 11, (n, t), generator=g)
    labels[torch.rand(n, t, generator=g) < 0.3] = -100
    num = count_shifted_labels(labels)
    if num == 0:
        assert causal_lm(logits, labels, num).item() == 0.0
        return
    ours = causal_lm(logits, labels, num)
    theirs = loss_utils.ForCausalLMLoss(logits, labels, vocab_size=11, num_items_in_batch=num)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 12), cut=st.integers(1, 11))
def test_summed_micro_losses_are_the_mean_over_the_step(seed, n, cut):
    cut = min(cut, n - 1)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 4, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.25] = -100
    total = count_labels(labels)
    parts = cross_entropy(logits[:cut], labels[:cut], total) + cross_entropy(logits[cut:], labels[cut:], total)
    if total == 0:
        assert parts.item() == 0.0
        return
    whole = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


def test_counters():
    labels = torch.tensor([[1, -100, 2], [-100, 3, -100]])
    assert count_labels(labels).item() == 3
    assert count_shifted_labels(labels).item() == 2
    assert counter_for(causal_lm) is count_shifted_labels
    assert counter_for(cross_entropy) is count_labels
    assert counter_for(lambda o, l, n: 0) is count_labels


def test_token_classification_shapes():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[0, 4, -100], [1, -100, -100]])
    out = cross_entropy(logits, labels, count_labels(labels))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out, ref)


def test_negative_labels_other_than_ignore_index_are_rejected():
    with pytest.raises(ValueError, match=r"labels \[-3\] are outside the 4 classes"):
        cross_entropy(torch.randn(2, 4), torch.tensor([0, -3]), 2)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 5),
    t=st.integers(2, 9),
    eps=st.sampled_from([0.05, 0.1, 0.3]),
    causal=st.booleans(),
)
def test_label_smoothing_matches_hf_label_smoother_on_one_micro_batch(seed, n, t, eps, causal):
    trainer_pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, t, 11, generator=g)
    labels = torch.randint(0, 11, (n, t), generator=g)
    labels[torch.rand(n, t, generator=g) < 0.3] = -100
    loss = causal_lm if causal else cross_entropy
    num = loss.count_items(labels)
    ours = label_smoothed(loss, eps)(logits, labels, num)
    if num == 0:
        assert ours.item() == 0.0
        return
    theirs = trainer_pt_utils.LabelSmoother(epsilon=eps)({"logits": logits}, labels, shift_labels=causal)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert label_smoothed(loss, eps).count_items is loss.count_items


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 8), cut=st.integers(1, 7))
def test_label_smoothed_micro_losses_sum_to_the_whole_batch(seed, n, cut):
    cut = min(cut, n - 1)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 6, 9, generator=g)
    labels = torch.randint(0, 9, (n, 6), generator=g)
    labels[:cut, :4] = -100  # the first micro-batch holds fewer items: HF's per-micro mean would differ
    smooth = label_smoothed(causal_lm, 0.1)
    total = count_shifted_labels(labels)
    parts = smooth(logits[:cut], labels[:cut], total) + smooth(logits[cut:], labels[cut:], total)
    torch.testing.assert_close(parts, smooth(logits, labels, total), rtol=1e-5, atol=1e-6)


def test_label_smoothing_refuses_what_it_cannot_smooth():
    with pytest.raises(ValueError, match="a custom loss smooths its own labels"):
        label_smoothed(lambda o, y, n: o.sum(), 0.1)
    with pytest.raises(ValueError, match=r"in \[0, 1\), got 1.5"):
        label_smoothed(causal_lm, 1.5)


def test_the_item_counters_have_one_owner():
    from trainfold.core import chunked_loss, counting, losses

    for name in ("IGNORE_INDEX", "count_labels", "count_shifted_labels", "counter_for", "refuse_unlabelled"):
        assert getattr(losses, name) is getattr(counting, name)
    assert losses.chunked_causal_lm is chunked_loss.chunked_causal_lm
    assert counting.counter_for(losses.cross_entropy) is counting.count_labels
    assert counting.counter_for(losses.mse) is counting.count_elements


@pytest.mark.parametrize("kind", ["cross_entropy", "causal_lm", "mse", "bce_with_logits"])
def test_a_float64_model_keeps_float64_in_the_built_in_losses(kind):
    # the losses upcast low-precision logits to float32; they used to cast float64 logits *down* to float32 too,
    # so a float64 model's gradients had float32 precision (1e-9 off torch's float64 reference after one SGD step)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    if kind in ("cross_entropy", "causal_lm"):
        labels = torch.randint(0, 5, (3, 4), generator=g)
        target = labels[:, 1:] if kind == "causal_lm" else labels
        used = logits[:, :-1] if kind == "causal_lm" else logits
        expected = F.cross_entropy(used.reshape(-1, 5), target.reshape(-1), reduction="mean")
    else:
        labels = torch.rand(3, 4, 5, dtype=torch.float64, generator=g)
        reference = F.mse_loss if kind == "mse" else F.binary_cross_entropy_with_logits
        expected = reference(logits, labels, reduction="mean")
    loss = getattr(losses, kind)
    got = loss(logits, labels, loss.count_items(labels))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=0)
    (ours,) = torch.autograd.grad(got, logits)
    (theirs,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-17)
