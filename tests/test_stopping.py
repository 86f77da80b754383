"""Early stopping: counted improvements only, patience and threshold edges, survival across resume."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.core.fold import fit
from trainfold.core.state import TrainState
from trainfold.core.tree import flatten, unflatten
from trainfold.observe.observers import observing
from trainfold.observe.stopping import (
    EARLY_STOPPING,
    EarlyStoppingRecord,
    early_stopping,
    patience_exhausted,
    record_evaluation,
    update_early_stopping,
)

# -- early stopping ------------------------------------------------------------------------------


def reference_bad_evals(values, patience, threshold, greater):
    """The rule in plain Python: counts since the last improvement by more than threshold."""
    best, bad, out = None, 0, []
    for v in values:
        gain = None if best is None else (v - best if greater else best - v)
        if not math.isnan(v) and (best is None or gain > threshold):
            best, bad = v, 0
        else:
            bad += 1
        out.append((bad, bad >= patience))
    return out


def hf_stops(values, patience, threshold):
    """HF's rule (lower is better), to show the difference: the best moves on every improvement."""
    best, bad = None, 0
    for i, v in enumerate(values):
        if best is None or (v < best and abs(v - best) > threshold):
            bad = 0
        else:
            bad += 1
        best = v if best is None or v < best else best
        if bad >= patience:
            return i
    return None


def run_evals(config, values):
    state = TrainState(params={}, buffers={}, opt_state=None, extras={EARLY_STOPPING: EarlyStoppingRecord()})
    stop, out = patience_exhausted(config), []
    for v in values:
        state = record_evaluation(config, state, {"eval_" + config.metric.removeprefix("eval_"): v})
        out.append((int(state.extras[config.key].bad_evals), stop(state)))
    return state, out


def test_steady_progress_below_the_threshold_does_not_stop():
    values = [10.0 - 0.4 * k for k in range(12)]
    config = early_stopping("eval_loss", patience=2, threshold=0.5)
    _, out = run_evals(config, values)
    assert not any(stopped for _, stopped in out)
    assert hf_stops(values, 2, 0.5) == 2  # HF stops at 10 -> 9.6 -> 9.2 (finding N)
    # patience 1 gains only 0.4 <= 0.5 in one evaluation, so it stops at once
    assert run_evals(early_stopping("loss", 1, 0.5), values)[1][1] == (1, True)


def test_plateau_stops_after_patience_evaluations():
    config = early_stopping("accuracy", patience=3, threshold=0.0, greater_is_better=True)
    state, out = run_evals(config, [0.5, 0.7, 0.7, 0.69, 0.7, 0.71])
    assert [s for _, s in out] == [False, False, False, False, True, False]
    assert float(state.extras[EARLY_STOPPING].best) == 0.71


def test_threshold_and_patience_edges():
    config = early_stopping("loss", patience=1, threshold=0.5)
    assert run_evals(config, [2.0, 1.5])[1][-1] == (1, True)  # exactly the threshold does not count
    assert run_evals(config, [2.0, 1.25])[1][-1] == (0, False)
    zero = early_stopping("loss", patience=1, threshold=0.0)
    assert run_evals(zero, [1.0, 1.0])[1][-1] == (1, True)  # equal is no improvement
    assert run_evals(zero, [1.0, float("nan"), 0.5])[1] == [(0, False), (1, True), (0, False)]


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.one_of(st.integers(0, 12).map(lambda k: k / 4), st.just(math.nan)), min_size=1, max_size=15),
    patience=st.integers(1, 4),
    threshold=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    greater=st.booleans(),
)
def test_early_stopping_matches_the_reference(values, patience, threshold, greater):
    config = early_stopping("score", patience, threshold, greater)
    assert run_evals(config, values)[1] == reference_bad_evals(values, patience, threshold, greater)


def test_early_stopping_record_survives_a_resume_and_stops_the_fold():
    config = early_stopping("loss", patience=2, threshold=0.1)
    evals = iter([1.0, 0.95, 0.99, 0.5, 0.5])

    def evaluate_every_other(state: TrainState) -> TrainState:
        return record_evaluation(config, state, {"eval_loss": next(evals)}) if state.step % 2 == 0 else state

    def step(state: TrainState, batch: int) -> TrainState:
        return attrs.evolve(state, step=state.step + batch)

    def template() -> TrainState:
        return TrainState(params={}, buffers={}, opt_state=None, extras={EARLY_STOPPING: EarlyStoppingRecord()})

    observed = observing(step, evaluate_every_other)
    mid = fit(observed, template(), [1] * 4)  # evals at steps 2 and 4: 1.0, 0.95
    restored = unflatten(flatten(mid), template())
    assert int(restored.extras[EARLY_STOPPING].bad_evals) == 1
    final = fit(observed, restored, [1] * 100, stop=patience_exhausted(config))
    assert int(final.step) == 6  # 0.99 at step 6 is the second evaluation without a counted gain


def test_update_early_stopping_is_pure():
    config = early_stopping("loss", patience=1)
    record = EarlyStoppingRecord()
    new = update_early_stopping(config, record, 1.0)
    assert math.isnan(float(record.best)) and int(record.bad_evals) == 0
    assert float(new.best) == 1.0


def test_early_stopping_errors():
    with pytest.raises(ValueError, match=r"'my_score'(.|\n)*greater_is_better(.|\n)*patience=0"):
        early_stopping("my_score", patience=0)
    assert early_stopping("eval_perplexity").greater_is_better is False  # the library's one rule
    with pytest.raises(ValueError, match="threshold=-0.1"):
        early_stopping("loss", threshold=-0.1)
    config = early_stopping("bleu", greater_is_better=True)
    state = TrainState(params={}, buffers={}, opt_state=None)
    with pytest.raises(KeyError, match=r"watches 'bleu'.*\['eval_loss'\]"):
        record_evaluation(config, state, {"eval_loss": 1.0})
