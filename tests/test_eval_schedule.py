"""The eval schedule: HF's eval_strategy rules, and settings refused together."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.eval_schedule import check_eval_schedule, resolve_eval_steps, should_evaluate


def test_should_evaluate_follows_hf_steps_and_epoch_rules():
    steps = {"eval_strategy": "steps", "eval_steps": 4, "max_steps": 10}
    assert [s for s in range(1, 11) if should_evaluate(s, **steps)] == [4, 8, 10]
    assert [s for s in range(1, 11) if should_evaluate(s, eval_delay=5, **steps)] == [8, 10]
    assert [s for s in range(1, 9) if should_evaluate(s, eval_strategy="steps", logging_steps=3)] == [3, 6]
    assert not should_evaluate(4, True, **steps)  # an epoch end alone is not a steps-eval
    assert not should_evaluate(4, eval_strategy="epoch")
    assert should_evaluate(4, True, eval_strategy="epoch")
    assert [e for e in (1.0, 2.0, 3.0) if should_evaluate(0, True, eval_strategy="epoch", epoch=e, eval_delay=2)] == [2.0, 3.0]
    assert not any(should_evaluate(s, s % 2 == 0, eval_strategy="no") for s in range(10))
    assert resolve_eval_steps(0.1, max_steps=25) == 3


@settings(max_examples=40, deadline=None)
@given(strategy=st.sampled_from(["no", "steps", "epoch"]), eval_steps=st.integers(1, 6), delay=st.integers(0, 8),
       max_steps=st.integers(1, 20), per_epoch=st.integers(1, 7))
def test_should_evaluate_agrees_with_hf_default_flow_callback(strategy, eval_steps, delay, max_steps, per_epoch):
    cb = pytest.importorskip("transformers.trainer_callback")
    args = types.SimpleNamespace(logging_first_step=False, logging_strategy="no", eval_strategy=strategy,
                                 eval_delay=delay, save_strategy="no")
    state = cb.TrainerState(max_steps=max_steps, eval_steps=eval_steps, logging_steps=500, save_steps=500)
    flow = cb.DefaultFlowCallback()
    for step in range(1, max_steps + 1):
        state.global_step, state.epoch = step, step / per_epoch
        hf = flow.on_step_end(args, state, cb.TrainerControl()).should_evaluate
        ours = should_evaluate(step, eval_strategy=strategy, eval_steps=eval_steps, eval_delay=delay, max_steps=max_steps)
        assert ours == hf, step
        if step % per_epoch == 0 or step == max_steps:  # HF ends an epoch after its last step, even a partial one
            hf = flow.on_epoch_end(args, state, cb.TrainerControl()).should_evaluate
            ours = should_evaluate(step, True, eval_strategy=strategy, eval_steps=eval_steps, eval_delay=delay,
                                   max_steps=max_steps, epoch=state.epoch)
            assert ours == hf, ("epoch end", step)


def test_eval_on_start_needs_a_strategy_and_eval_data():
    with pytest.raises(ValueError, match="eval_on_start=True needs eval_strategy 'steps' or 'epoch'"):
        check_eval_schedule(eval_strategy="no", eval_on_start=True, has_eval_data=True)
    with pytest.raises(ValueError, match=r"eval_strategy='steps' needs an eval dataset.*eval_on_start=True needs an eval"):
        check_eval_schedule(eval_strategy="steps", eval_on_start=True, has_eval_data=False)
    check_eval_schedule(eval_strategy="epoch", eval_on_start=True, has_eval_data=True)


def test_bad_schedule_settings_are_reported_together():
    with pytest.raises(ValueError, match=r"one of \['no', 'steps', 'epoch'\], got 'step'.*eval_delay must be"):
        check_eval_schedule(eval_strategy="step", eval_delay=-1, has_eval_data=True)
    with pytest.raises(ValueError, match="share of max_steps"):
        check_eval_schedule(eval_strategy="steps", eval_steps=0.5, has_eval_data=True)
    with pytest.raises(ValueError, match="whole number"):
        resolve_eval_steps(2.5)
    with pytest.raises(ValueError, match="one of"):
        should_evaluate(1, eval_strategy="sometimes")
    with pytest.raises(ValueError, match="needs epoch="):
        should_evaluate(1, True, eval_strategy="epoch", eval_delay=1)
