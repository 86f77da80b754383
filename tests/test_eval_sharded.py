"""Tests for trainfold.evaluation.sharded and .gather: sharded evaluation is the one-process run, merged.

Ranks are simulated by threads (``trainfold.testing.on_simulated_ranks``); the forward is a pure
function of its params, so the ranks share nothing. The 2-process gloo runs are in ``test_distributed``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.core.losses import IGNORE_INDEX
from trainfold.evaluation import (
    EvalSpec,
    evaluate_batches,
    predict_batches,
)
from trainfold.evaluation import (
    evaluate_batches as evaluate,
)
from trainfold.evaluation.gather import all_ranks
from trainfold.testing import on_simulated_ranks

VOCAB = 11


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(VOCAB, 4, generator=g), "out": torch.randn(4, VOCAB, generator=g)}


def forward(params, inputs):
    return params["emb"][inputs["input_ids"]] @ params["out"]


def make_batches(n_rows: int, size: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Rows of 2 to 6 tokens, some labels masked, right-padded per batch (inputs with 0, labels with -100)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(n_rows)]
    out = []
    for i in range(0, n_rows, size):
        part = rows[i : i + size]
        width = max(len(r) for r in part)
        ids = torch.zeros(len(part), width, dtype=torch.int64)
        labels = torch.full((len(part), width), IGNORE_INDEX, dtype=torch.int64)
        for j, r in enumerate(part):
            ids[j, : len(r)] = r
            labels[j, : len(r)] = torch.where(torch.rand(len(r), generator=g) < 0.2, IGNORE_INDEX, r)
        out.append({"input_ids": ids, "labels": labels})
    return out


def per_sample(p) -> dict[str, float]:
    """Metrics from the inputs and per-sample losses, weighted by row index: they see the dataset order."""
    inputs = np.where(p.inputs == IGNORE_INDEX, 0, p.inputs)
    index = np.arange(len(p.losses))
    return {
        "rows": len(p.losses),
        "inputs_weighted": int((inputs.sum(1) * index).sum()),
        "losses_weighted": float(np.nansum(p.losses * index)),
        "unscored": int(np.isnan(p.losses).sum()),
    }


def contiguous(batches: list, cuts: list[int]) -> list[list]:
    """Split ``batches`` at ``cuts`` into one contiguous part per rank."""
    bounds = [0, *cuts, len(batches)]
    return [batches[a:b] for a, b in zip(bounds, bounds[1:])]


def on_ranks(parts: list[list], run):
    return on_simulated_ranks(len(parts), lambda c: run(c, parts[c.rank]))


# -- examples ---------------------------------------------------------------------------------------


def test_include_for_metrics_sharded_matches_one_process():
    params, batches = make_params(), make_batches(9, 2)
    kw = {"compute_metrics": per_sample, "include_for_metrics": ["inputs", "loss"], "speed_metrics": False}
    whole = evaluate(forward, params, batches, **kw)
    got = on_ranks(
        contiguous(batches, [2, 3]),
        lambda c, mine: evaluate_batches(forward, params, mine, collective=c, eval_accumulation_steps=1, **kw),
    )
    assert whole["eval_rows"] == 9
    for metrics in got:
        assert metrics["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-12)
        assert metrics["eval_rows"] == whole["eval_rows"]
        assert metrics["eval_inputs_weighted"] == whole["eval_inputs_weighted"]  # inputs in dataset order
        assert metrics["eval_unscored"] == whole["eval_unscored"]
        assert metrics["eval_losses_weighted"] == pytest.approx(whole["eval_losses_weighted"], rel=1e-6)


def test_eval_accumulation_steps_moves_predictions_to_the_host_every_n_batches_on_each_rank():
    params, batches = make_params(), make_batches(7, 1)
    parts = contiguous(batches, [4])  # 4 batches on rank 0, 3 on rank 1
    logs: list[list[str]] = [[], []]

    def run(c, mine, every):
        log = logs[c.rank]

        def traced(p, inputs):
            log.append("f")
            return forward(p, inputs)

        def move(t):
            log.append("m")
            return t.to("cpu")

        spec = EvalSpec(compute_metrics=rows, eval_accumulation_steps=every, move=move, speed_metrics=False)
        return predict_batches(traced, params, mine, collective=c, spec=spec)

    def rows(p):
        return {"rows": len(p.label_ids)}

    got = on_ranks(parts, lambda c, mine: run(c, mine, 2))
    # two gathered leaves per batch (predictions, label_ids), each moved once, two batches per move
    assert ["".join(log) for log in logs] == ["ffmmmmffmmmm", "ffmmmmfmm"]
    ref = predict_batches(forward, params, batches, spec=EvalSpec(compute_metrics=rows, speed_metrics=False))
    for out in got:
        assert np.array_equal(out.label_ids, ref.label_ids)
        assert np.array_equal(out.predictions, ref.predictions)
        assert out.metrics == pytest.approx(ref.metrics, rel=1e-12)
    logs[:] = [[], []]
    on_ranks(parts, lambda c, mine: run(c, mine, None))
    assert ["".join(log) for log in logs] == ["ffff" + "m" * 8, "fff" + "m" * 6]  # None: once, at the end


def test_an_objectives_metrics_are_exact_means_over_every_ranks_items():
    def objective(fwd, p, batch, n, key):
        logits = fwd(p, {"input_ids": batch["input_ids"]})
        mask = batch["labels"] != IGNORE_INDEX
        total = torch.nn.functional.cross_entropy(logits[mask], batch["labels"][mask], reduction="sum")
        return total / n, {"mean_logit": logits[mask].mean(-1).sum() / n}

    params, batches = make_params(), make_batches(8, 3)
    spec = EvalSpec(objective=objective, speed_metrics=False)
    whole = evaluate_batches(forward, params, batches, spec=spec)
    for got in on_ranks(
        contiguous(batches, [1]), lambda c, mine: evaluate_batches(forward, params, mine, collective=c, spec=spec)
    ):
        assert sorted(got) == ["eval_loss", "eval_mean_logit"]
        assert got == pytest.approx(whole, rel=1e-12)
    kw = {"objective": objective, "speed_metrics": False}
    for got in on_ranks(
        contiguous(batches, [2]), lambda c, mine: evaluate_batches(forward, params, mine, collective=c, **kw)
    ):
        assert got == pytest.approx(whole, rel=1e-12)


def test_a_rank_without_batches_still_gathers_record_predictions():
    # rank 1 has no batches, so no predictions to show their structure: it takes rank 0's
    params, batches = make_params(), make_batches(5, 2)
    spec = EvalSpec(predictions_of=lambda logits: {"logits": logits, "ids": (logits.argmax(-1),)}, speed_metrics=False)
    ref = predict_batches(forward, params, batches, spec=spec)
    got = on_ranks([batches, []], lambda c, mine: predict_batches(forward, params, mine, collective=c, spec=spec))
    for out in got:
        assert sorted(out.predictions) == ["ids", "logits"]
        assert np.array_equal(out.predictions["logits"], ref.predictions["logits"])
        assert np.array_equal(out.predictions["ids"][0], ref.predictions["ids"][0])
        assert np.array_equal(out.label_ids, ref.label_ids)
        assert out.metrics == ref.metrics


def test_all_ranks_returns_each_ranks_record_in_rank_order():
    got = on_simulated_ranks(3, lambda c: all_ranks({f"m{c.rank}": (torch.tensor(c.rank), c.rank * 0.5)}, c))
    expected = [{"m0": (0, 0.0)}, {"m1": (1, 0.5)}, {"m2": (2, 1.0)}]
    for ranks in got:
        assert [{k: (int(t), x) for k, (t, x) in r.items()} for r in ranks] == expected


def test_the_runtime_is_the_slowest_ranks():
    params, batches = make_params(), make_batches(4, 2)
    got = on_ranks(
        contiguous(batches, [1]),
        lambda c, mine: evaluate_batches(forward, params, mine if c.rank else mine * 30, collective=c),
    )
    assert got[0]["eval_runtime"] == got[1]["eval_runtime"] > 0


# -- properties -------------------------------------------------------------------------------------


@given(
    n_batches=st.integers(1, 6),
    world=st.integers(1, 3),
    data=st.data(),
    every=st.sampled_from([None, 1, 2]),
    include=st.sampled_from([(), ("inputs",), ("inputs", "loss")]),
)
@settings(max_examples=12, deadline=None)
def test_sharding_contiguous_batches_changes_nothing_but_float64_sum_order(n_batches, world, data, every, include):
    params, batches = make_params(), make_batches(2 * n_batches, 2)
    cuts = sorted(data.draw(st.lists(st.integers(0, n_batches), min_size=world - 1, max_size=world - 1)))
    spec = EvalSpec(include_for_metrics=include, eval_accumulation_steps=every, as_numpy=False, speed_metrics=False)
    ref = predict_batches(forward, params, batches, spec=spec)
    got = on_ranks(
        contiguous(batches, cuts), lambda c, mine: predict_batches(forward, params, mine, collective=c, spec=spec)
    )
    for out in got:
        assert torch.equal(out.predictions, ref.predictions)
        assert torch.equal(out.label_ids, ref.label_ids)
        assert out.metrics == pytest.approx(ref.metrics, rel=1e-12)


# -- errors -----------------------------------------------------------------------------------------


def test_sharded_settings_are_checked_on_every_path():
    params, batches = make_params(), make_batches(2, 1)
    with pytest.raises(ValueError, match="eval_accumulation_steps must be a positive int or None, got 0"):
        on_simulated_ranks(
            2, lambda c: evaluate_batches(forward, params, batches, collective=c, eval_accumulation_steps=0)
        )
    with pytest.raises(ValueError, match=r"include_for_metrics takes 'inputs' and 'loss', got \['logits'\]"):
        on_simulated_ranks(
            1, lambda c: predict_batches(forward, params, batches, collective=c, include_for_metrics=["logits"])
        )
    with pytest.raises(KeyError, match="batches have no 'tokens' key"):
        on_simulated_ranks(
            1,
            lambda c: evaluate_batches(
                forward,
                params,
                batches,
                collective=c,
                compute_metrics=per_sample,
                include_for_metrics=["inputs"],
                main_input_name="tokens",
            ),
        )
