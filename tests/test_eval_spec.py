"""Tests for trainfold.evaluation.spec: the EvalSpec record and the keyword entry points that build it."""

from __future__ import annotations

import inspect

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.core.losses import cross_entropy
from trainfold.evaluation import (
    EvalSpec,
)
from trainfold.evaluation import (
    evaluate_batches as evaluate,
)
from trainfold.evaluation import (
    predict_batches as predict,
)
from trainfold.evaluation.spec import spec_errors

# What the keyword entry points take besides the spec's fields: the model, its tensors, the data, the ranks.


def forward(params, inputs):
    return params["emb"][inputs["input_ids"]]


PARAMS = {"emb": torch.randn(6, 6, generator=torch.Generator().manual_seed(0))}
BATCHES = [
    {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "labels": torch.tensor([[1, 2, 3], [4, 5, -100]])},
    {"input_ids": torch.tensor([[2, 2]]), "labels": torch.tensor([[3, -100]])},
]


def rows(p):
    return {"rows": len(p.predictions), "inputs": 0 if p.inputs is None else int(p.inputs.clip(0).sum())}


# -- examples ---------------------------------------------------------------------------------------


def test_defaults_are_hfs():
    spec = EvalSpec()
    assert (spec.metric_key_prefix, spec.label_key, spec.main_input_name) == ("eval", "labels", "input_ids")
    assert (spec.eval_accumulation_steps, spec.prediction_loss_only, spec.include_for_metrics) == (None, False, ())
    assert spec.as_numpy and spec.speed_metrics and not spec.gathers
    assert EvalSpec(compute_metrics=rows).gathers


def test_a_spec_is_frozen_and_include_for_metrics_a_tuple():
    spec = EvalSpec(include_for_metrics=["inputs"])
    assert spec.include_for_metrics == ("inputs",)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.label_key = "y"  # type: ignore[misc]
    assert attrs.evolve(spec, label_key="y").label_key == "y"


def test_of_takes_the_fields_it_knows_and_leaves_the_rest():
    spec = EvalSpec.of({"model": object(), "metric_key_prefix": "dev", "eval_accumulation_steps": 3})
    assert (spec.metric_key_prefix, spec.eval_accumulation_steps) == ("dev", 3)


@pytest.mark.parametrize("entry", [evaluate, predict])
def test_the_entry_points_take_the_spec_fields_as_keywords_and_refuse_others(entry):
    assert list(inspect.signature(entry).parameters)[3:] == ["spec", "buffers", "collective", "settings"]
    with pytest.raises(TypeError, match="label_kye"):
        entry(forward, PARAMS, BATCHES, label_kye="y")


def test_the_keyword_forms_are_the_spec_forms():
    kw = {"compute_metrics": rows, "include_for_metrics": ["inputs"], "eval_accumulation_steps": 1}
    kw |= {"loss": cross_entropy, "speed_metrics": False}
    assert evaluate(forward, PARAMS, BATCHES, **kw) == evaluate(forward, PARAMS, BATCHES, spec=EvalSpec(**kw))
    one = predict(forward, PARAMS, BATCHES, **kw)
    two = predict(forward, PARAMS, BATCHES, spec=EvalSpec(metric_key_prefix="test", **kw))
    assert one.metrics == two.metrics
    assert sorted(one.metrics) == ["test_inputs", "test_loss", "test_rows", "test_token_loss"]
    assert (one.predictions == two.predictions).all() and (one.label_ids == two.label_ids).all()


def test_keywords_replace_the_fields_of_a_given_spec():
    spec = EvalSpec(metric_key_prefix="dev", speed_metrics=False)
    assert sorted(evaluate(forward, PARAMS, BATCHES, spec=spec, metric_key_prefix="held")) == [
        "held_loss",
        "held_token_loss",
    ]
    assert sorted(predict(forward, PARAMS, BATCHES, spec=spec).metrics) == [
        "dev_loss",
        "dev_token_loss",
    ]  # the spec's own prefix
    assert sorted(predict(forward, PARAMS, BATCHES, speed_metrics=False).metrics) == [
        "test_loss",
        "test_token_loss",
    ]  # HF's default


# -- properties -------------------------------------------------------------------------------------


@given(
    prefix=st.sampled_from(["eval", "test", "dev"]),
    every=st.sampled_from([None, 1, 2]),
    include=st.sampled_from([[], ["inputs"], ["inputs", "loss"]]),
    gather=st.booleans(),
)
@settings(max_examples=15, deadline=None)
def test_evaluate_with_keywords_equals_evaluate_with_the_spec(prefix, every, include, gather):
    kw = {"metric_key_prefix": prefix, "eval_accumulation_steps": every, "include_for_metrics": include}
    kw |= {"compute_metrics": rows if gather else None, "speed_metrics": False}
    spec = EvalSpec(**kw)
    assert evaluate(forward, PARAMS, BATCHES, **kw) == evaluate(forward, PARAMS, BATCHES, spec=spec)
    assert spec_errors(spec) == []


# -- errors -----------------------------------------------------------------------------------------


def test_every_bad_setting_is_named_at_once():
    with pytest.raises(ValueError) as e:
        EvalSpec(
            eval_accumulation_steps=-1,
            prediction_loss_only=True,
            compute_metrics=rows,
            preprocess_logits_for_metrics="argmax",
            include_for_metrics=["logits"],
            objective=3,
        )
    msg = str(e.value)
    for part in (
        "objective must be a function",
        "eval_accumulation_steps must be a positive int or None, got -1",
        "prediction_loss_only=True gathers no predictions",
        "preprocess_logits_for_metrics must be a function, got str",
        "include_for_metrics takes 'inputs' and 'loss', got ['logits']",
    ):
        assert part in msg
    with pytest.raises(ValueError, match="an objective scores whole batches"):
        EvalSpec(objective=lambda *a: None, include_for_metrics=["loss"])
    with pytest.raises(TypeError, match="unexpected keyword argument 'metric_prefix'"):
        EvalSpec(metric_prefix="eval")  # type: ignore[call-arg]
