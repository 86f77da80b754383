"""Tests for trainfold.evaluation.evaluation: examples, then Hypothesis properties, then bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.core.losses import cross_entropy
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import init_state
from trainfold.evaluation.evaluation import evaluate_batches as evaluate
from trainfold.evaluation.evaluation import predict_batches as predict
from trainfold.evaluation.metrics import EvalPrediction, check_metrics, prefix_metrics
from trainfold.optim import sgd

VOCAB = 16


def _model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_len=32, dropout=dropout))


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _batch(rows):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        labels[i, : len(r)] = r
    return {"input_ids": ids, "labels": labels}


def _batches(rows, size):
    return [_batch(rows[i : i + size]) for i in range(0, len(rows), size)]


def _one_shot_loss(model, rows):
    b = _batch(rows)
    with torch.no_grad():
        logits = model(b["input_ids"])
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1), ignore_index=-100).item()


# Examples ------------------------------------------------------------------------------------


def test_eval_token_loss_is_the_token_level_mean_over_the_eval_set():
    model = _model()
    rows = _rows([3, 9, 5, 2, 7])
    m = evaluate(model, None, _batches(rows, 2), speed_metrics=False)
    assert list(m) == ["eval_loss", "eval_token_loss"]  # eval_loss: HF's row-weighted batch means (test_eval_loss)
    assert m["eval_token_loss"] == pytest.approx(_one_shot_loss(model, rows), rel=1e-5)


def test_eval_runs_in_eval_mode_without_grad_and_restores_the_flags():
    model = _model(dropout=0.5).train()
    seen = []
    model.register_forward_hook(lambda mod, args, out: seen.append((mod.training, torch.is_inference_mode_enabled())))
    batches = _batches(_rows([4, 6]), 1)
    a = evaluate(model, None, batches, speed_metrics=False)
    b = evaluate(model, None, batches, speed_metrics=False)
    assert seen == [(False, True)] * 4
    assert model.training and all(m.training for m in model.modules())
    assert a == b  # dropout is off


def test_params_from_a_train_state_are_used_and_left_unchanged():
    model = _model()
    state = init_state(model, sgd(0.1))
    versions = {k: v._version for k, v in state.params.items()}
    zeroed = {k: torch.zeros_like(v) for k, v in state.params.items()}
    batches = _batches(_rows([5, 5]), 2)
    before = [{k: v.clone() for k, v in b.items()} for b in batches]
    m = evaluate(model, zeroed, batches, speed_metrics=False)
    assert all(torch.equal(b[k], c[k]) and b.keys() == c.keys() for b, c in zip(batches, before) for k in b)
    assert m["eval_loss"] == pytest.approx(np.log(VOCAB), rel=1e-5)  # zero weights: uniform logits
    assert evaluate(model, state, _batches(_rows([5, 5]), 2), speed_metrics=False)["eval_loss"] == pytest.approx(
        _one_shot_loss(model, _rows([5, 5])), rel=1e-5
    )
    assert {k: v._version for k, v in state.params.items()} == versions


def test_compute_metrics_gets_numpy_predictions_and_keys_are_prefixed():
    model = _model()
    rows = _rows([3, 6, 4])
    got = []

    def metrics(p: EvalPrediction):
        got.append(p)
        preds, labels = p
        return {"accuracy": float((preds[:, :-1] == labels[:, 1:])[labels[:, 1:] != -100].mean()), "eval_n": len(preds)}

    m = evaluate(
        model,
        None,
        _batches(rows, 2),
        compute_metrics=metrics,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        speed_metrics=False,
    )
    assert set(m) == {"eval_accuracy", "eval_n", "eval_loss", "eval_token_loss"}
    assert m["eval_n"] == 3
    (p,) = got
    assert isinstance(p.predictions, np.ndarray) and isinstance(p.label_ids, np.ndarray)
    assert p.predictions.shape == p.label_ids.shape == (3, 6)
    assert (p.label_ids == _batch(rows)["labels"].numpy()).all()
    t = evaluate(
        model, None, _batches(rows, 2), compute_metrics=lambda p: {"n": 1}, metric_key_prefix="val", speed_metrics=False
    )
    assert set(t) == {"val_n", "val_loss", "val_token_loss"}


def test_preprocess_is_called_once_per_batch_with_the_batch_own_shapes():
    model = _model()
    rows = _rows([3, 8, 2, 5, 4])
    calls = []

    def preprocess(logits, labels):
        calls.append((tuple(logits.shape), tuple(labels.shape)))
        return logits.argmax(-1)

    evaluate(model, None, _batches(rows, 2), compute_metrics=lambda p: {}, preprocess_logits_for_metrics=preprocess)
    assert calls == [((2, 8, VOCAB), (2, 8)), ((2, 5, VOCAB), (2, 5)), ((1, 4, VOCAB), (1, 4))]


def test_eval_accumulation_steps_moves_tensors_off_the_device_every_n_batches():
    model = _model()
    rows = _rows([3, 8, 2, 5, 4, 6, 7])
    batches = _batches(rows, 1)
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    moves = []  # (batches run so far, shape) for each tensor moved to the host

    def move(t):
        moves.append((len(forwards), tuple(t.shape)))
        return t.cpu()

    def argmax(logits, labels):
        return logits.argmax(-1)

    out = predict(
        model,
        None,
        batches,
        preprocess_logits_for_metrics=argmax,
        eval_accumulation_steps=3,
        move=move,
        speed_metrics=False,
    )
    # predictions and labels of batches 1-3 move after batch 3, 4-6 after 6, the last at the end
    assert [n for n, _ in moves] == [3] * 6 + [6] * 6 + [7] * 2
    assert [s for _, s in moves[:3]] == [(1, 3), (1, 8), (1, 2)]  # predictions, then labels
    whole = predict(model, None, batches, preprocess_logits_for_metrics=argmax, speed_metrics=False)
    assert (out.predictions == whole.predictions).all() and (out.label_ids == whole.label_ids).all()
    moves.clear()
    forwards.clear()
    predict(model, None, batches, preprocess_logits_for_metrics=argmax, move=move, speed_metrics=False)
    assert [n for n, _ in moves] == [7] * 14  # without it, everything waits until the end


def test_predict_returns_rows_in_dataset_order():
    model = _model()
    rows = _rows([6, 2, 9, 4, 3])
    out = predict(model, None, _batches(rows, 1), speed_metrics=False)
    assert out.predictions.shape == (5, 9, VOCAB)
    for i, r in enumerate(rows):
        with torch.no_grad():
            own = model(r[None])[0].numpy()
        np.testing.assert_allclose(out.predictions[i, : len(r)], own, rtol=1e-4, atol=1e-5)
        assert (out.predictions[i, len(r) :] == -100).all()
        assert out.label_ids[i, : len(r)].tolist() == r.tolist()
    assert set(out.metrics) == {"test_loss", "test_token_loss"}
    raw = predict(model, None, _batches(rows, 1), speed_metrics=False, as_numpy=False)
    assert isinstance(raw.predictions, torch.Tensor) and np.array_equal(raw.predictions.numpy(), out.predictions)


def test_without_labels_there_is_no_loss_and_label_ids_is_none():
    model = _model()
    batches = [{"input_ids": b["input_ids"]} for b in _batches(_rows([3, 4]), 1)]
    out = predict(model, None, batches, speed_metrics=False)
    assert out.label_ids is None and out.predictions.shape == (2, 4, VOCAB) and out.metrics == {}
    assert evaluate(model, None, batches, speed_metrics=False) == {}


def test_without_compute_metrics_no_predictions_are_gathered():
    model = _model()
    calls = []
    evaluate(model, None, _batches(_rows([3, 4]), 1), preprocess_logits_for_metrics=lambda l, y: calls.append(1))
    assert calls == []


def test_a_forward_function_a_classification_loss_and_inputs_for_metrics():
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    forward = lambda params, inputs: inputs["input_ids"].float() @ params["w"]
    batches = [
        {"input_ids": torch.tensor([[1, 0, 0]]), "labels": torch.tensor([0])},
        {"input_ids": torch.tensor([[0, 1, 0], [0, 0, 1]]), "labels": torch.tensor([0, 1])},
    ]
    seen = []
    m = evaluate(
        forward,
        {"w": weight},
        batches,
        loss=cross_entropy,
        include_for_metrics=["inputs"],
        compute_metrics=lambda p: seen.append(p) or {"acc": (p.predictions.argmax(-1) == p.label_ids).mean()},
    )
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert m["eval_loss"] == pytest.approx(F.cross_entropy(logits, torch.tensor([0, 0, 1])).item(), rel=1e-6)
    assert m["eval_acc"] == pytest.approx(1 / 3)
    assert {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"} <= set(m)
    assert seen[0].inputs.tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]] and len(seen[0]) == 3


def test_per_sample_losses_for_metrics_are_each_sample_own_token_mean():
    model = _model()
    rows = _rows([4, 7, 1, 5])
    seen = []
    m = evaluate(
        model,
        None,
        _batches(rows, 3),
        include_for_metrics=["loss"],
        speed_metrics=False,
        compute_metrics=lambda p: seen.append(p) or {"mean_sample_loss": np.nanmean(p.losses)},
    )
    losses = seen[0].losses
    assert losses.shape == (4,) and np.isnan(losses[2])  # one token: nothing to predict
    for i in (0, 1, 3):
        assert losses[i] == pytest.approx(_one_shot_loss(model, [rows[i]]), rel=1e-5)
    assert m["eval_mean_sample_loss"] == pytest.approx(np.nanmean(losses))
    assert len(seen[0]) == 3  # predictions, label_ids, losses


def test_eval_prediction_is_hf_compatible():
    p = EvalPrediction(np.zeros(2), np.ones(2))
    _, labels = p
    assert len(p) == 2 and p[1] is labels and p.inputs is None
    assert len(EvalPrediction(1, 2, inputs=3, losses=4)) == 4


def test_metric_helpers():
    assert prefix_metrics({"a": 1, "test_b": 2}, "test") == {"test_a": 1, "test_b": 2}
    assert check_metrics({"x": np.array(2.5), "ok": True}) == {"x": 2.5, "ok": True}


# Properties -----------------------------------------------------------------------------------

_MODEL = _model(seed=1)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(2, 12), min_size=1, max_size=7), size=st.integers(1, 7), seed=st.integers(0, 1000))
def test_eval_token_loss_does_not_depend_on_the_eval_batch_size(lengths, size, seed):
    rows = _rows(lengths, seed)
    m = evaluate(_MODEL, None, _batches(rows, size), speed_metrics=False)
    assert m["eval_token_loss"] == pytest.approx(_one_shot_loss(_MODEL, rows), rel=1e-5)


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 10), min_size=1, max_size=6),
    size=st.integers(1, 6),
    every=st.none() | st.integers(1, 4),
)
def test_predictions_are_the_same_for_any_batch_size_and_accumulation(lengths, size, every):
    rows = _rows(lengths)
    out = predict(
        _MODEL,
        None,
        _batches(rows, size),
        eval_accumulation_steps=every,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        speed_metrics=False,
    )
    whole = predict(
        _MODEL, None, [_batch(rows)], preprocess_logits_for_metrics=lambda lg, lb: lg.argmax(-1), speed_metrics=False
    )
    assert (out.label_ids == whole.label_ids).all()
    mask = whole.label_ids != -100
    assert (out.predictions[mask] == whole.predictions[mask]).all()


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 6)), min_size=1, max_size=5), vocab=st.integers(1, 3)
)
def test_padded_predictions_match_hf_nested_concat(lengths, vocab):
    pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    g = torch.Generator().manual_seed(len(lengths))
    batches = [
        {"input_ids": torch.zeros(r, c, dtype=torch.long), "labels": torch.randint(0, 9, (r, c), generator=g)}
        for r, c in lengths
    ]
    forward = lambda params, inputs: params["w"].expand(*inputs["input_ids"].shape, vocab) * 1.0
    out = predict(
        forward,
        {"w": torch.arange(vocab, dtype=torch.float32)},
        batches,
        loss=lambda o, y, n: o.sum(),
        speed_metrics=False,
    )
    want_p = want_l = None
    for b in batches:
        logits = forward({"w": torch.arange(vocab, dtype=torch.float32)}, b)
        want_p = logits if want_p is None else pt_utils.nested_concat(want_p, logits, padding_index=-100)
        want_l = b["labels"] if want_l is None else pt_utils.nested_concat(want_l, b["labels"], padding_index=-100)
    assert np.array_equal(out.predictions, want_p.numpy()) and np.array_equal(out.label_ids, want_l.numpy())


def test_eval_prediction_unpacks_like_hf():
    transformers = pytest.importorskip("transformers")
    for kwargs in ({}, {"inputs": 3}, {"losses": 4}, {"inputs": 3, "losses": 4}):
        assert tuple(EvalPrediction(1, 2, **kwargs)) == tuple(transformers.EvalPrediction(1, 2, **kwargs))


# Bad input ------------------------------------------------------------------------------------


def test_compute_metrics_returning_non_scalars_is_an_error():
    model = _model()
    batches = _batches(_rows([3, 4]), 1)
    with pytest.raises(ValueError, match=r"not scalars: \{'per_class': 'ndarray of shape \(3,\)'\}.*one number"):
        evaluate(model, None, batches, compute_metrics=lambda p: {"acc": 1.0, "per_class": np.zeros(3)})
    with pytest.raises(TypeError, match="must return a dict.*list"):
        evaluate(model, None, batches, compute_metrics=lambda p: [1.0])
    with pytest.raises(ValueError, match="'loss' metric"):
        evaluate(model, None, batches, compute_metrics=lambda p: {"loss": 1.0})


def test_prediction_shapes_that_cannot_be_padded_are_an_error():
    model = _model()
    batches = _batches(_rows([3, 4]), 1)
    shrink = iter([2, 3])

    def bad(logits, labels):
        return logits[..., : next(shrink)]

    with pytest.raises(ValueError, match=r"shapes \[\(1, 3, 2\), \(1, 4, 3\)\].*only dim 1"):
        evaluate(model, None, batches, compute_metrics=lambda p: {}, preprocess_logits_for_metrics=bad)


def test_bad_evaluate_arguments():
    model = _model()
    batches = _batches(_rows([3]), 1)
    with pytest.raises(ValueError, match="eval_accumulation_steps must be a positive int.*0.*prediction_loss_only"):
        evaluate(
            model, None, batches, eval_accumulation_steps=0, prediction_loss_only=True, compute_metrics=lambda p: {}
        )
    with pytest.raises(TypeError, match="dicts of tensors"):
        evaluate(model, None, [torch.zeros(1, 3)])
    with pytest.raises(ValueError, match=r"include_for_metrics takes 'inputs' and 'loss', got \['logits'\]"):
        evaluate(model, None, batches, include_for_metrics=["logits"])
    with pytest.raises(TypeError, match="needs params"):
        evaluate(lambda p, x: x, None, batches)
