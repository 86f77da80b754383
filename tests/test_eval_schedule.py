"""The eval schedule: HF's eval_strategy rules, and settings refused together."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.ckpt.policy import should_save
from trainfold.evaluation.schedule import check_eval_schedule, resolve_eval_steps, should_evaluate


def test_should_evaluate_follows_hf_steps_and_epoch_rules():
    steps = {"eval_strategy": "steps", "eval_steps": 4, "max_steps": 10}
    assert [s for s in range(1, 11) if should_evaluate(s, **steps)] == [4, 8, 10]
    assert [s for s in range(1, 11) if should_evaluate(s, eval_delay=5, **steps)] == [8, 10]
    assert [s for s in range(1, 9) if should_evaluate(s, eval_strategy="steps", logging_steps=3)] == [3, 6]
    assert should_evaluate(4, True, **steps)  # a multiple of eval_steps that ends an epoch is still evaluated
    assert not should_evaluate(3, True, **steps)  # an epoch end alone is not a steps-eval
    assert not should_evaluate(4, eval_strategy="epoch")
    assert should_evaluate(4, True, eval_strategy="epoch")
    assert should_evaluate(6, eval_strategy="epoch", max_steps=6)  # max_steps ends the epoch early
    assert should_evaluate(6, eval_strategy="epoch", last=True)
    assert should_evaluate(5, eval_strategy="steps", eval_steps=4, last=True)
    assert [e for e in (1.0, 2.0, 3.0) if should_evaluate(0, True, eval_strategy="epoch", epoch=e, eval_delay=2)] == [
        2.0,
        3.0,
    ]
    assert not any(should_evaluate(s, s % 2 == 0, eval_strategy="no", last=True) for s in range(10))
    assert resolve_eval_steps(0.1, max_steps=25) == 3


def hf_flow(strategy, eval_steps, delay, max_steps, per_epoch, save_strategy="no", save_steps=500):
    """Yield ``(step, epoch_end, should_evaluate, should_save)`` as HF's DefaultFlowCallback decides them.

    One TrainerControl runs through ``on_step_end`` and, at an epoch's end or the run's last step,
    ``on_epoch_end`` (HF leaves the epoch loop there); an evaluation or a save resets its flag.
    """
    cb = pytest.importorskip("transformers.trainer_callback")
    args = types.SimpleNamespace(
        logging_first_step=False,
        logging_strategy="no",
        eval_strategy=strategy,
        eval_delay=delay,
        save_strategy=save_strategy,
    )
    state = cb.TrainerState(max_steps=max_steps, eval_steps=eval_steps, logging_steps=500, save_steps=save_steps)
    flow = cb.DefaultFlowCallback()
    for step in range(1, max_steps + 1):
        state.global_step, state.epoch = step, step / per_epoch
        control = flow.on_step_end(args, state, cb.TrainerControl())
        evaluated, saved = control.should_evaluate, control.should_save
        control.should_evaluate = control.should_save = False
        epoch_end = step % per_epoch == 0
        if epoch_end or step == max_steps:
            control = flow.on_epoch_end(args, state, control)
            assert not (evaluated and control.should_evaluate) and not (saved and control.should_save)
            evaluated, saved = evaluated or control.should_evaluate, saved or control.should_save
        yield step, epoch_end, evaluated, saved


@settings(max_examples=60, deadline=None)
@given(
    strategy=st.sampled_from(["no", "steps", "epoch"]),
    eval_steps=st.integers(1, 6),
    delay=st.integers(0, 8),
    max_steps=st.integers(1, 20),
    per_epoch=st.integers(1, 7),
)
def test_should_evaluate_agrees_with_hf_default_flow_callback(strategy, eval_steps, delay, max_steps, per_epoch):
    for step, epoch_end, hf, _ in hf_flow(strategy, eval_steps, delay, max_steps, per_epoch):
        ours = should_evaluate(
            step,
            epoch_end,
            eval_strategy=strategy,
            eval_steps=eval_steps,
            eval_delay=delay,
            max_steps=max_steps,
            epoch=step / per_epoch,
        )
        assert ours == hf, (step, epoch_end)


@settings(max_examples=60, deadline=None)
@given(
    strategy=st.sampled_from(["no", "steps", "epoch"]),
    save_steps=st.integers(1, 6),
    max_steps=st.integers(1, 20),
    per_epoch=st.integers(1, 7),
)
def test_should_save_agrees_with_hf_default_flow_callback(strategy, save_steps, max_steps, per_epoch):
    for step, epoch_end, _, hf in hf_flow("no", None, 0, max_steps, per_epoch, strategy, save_steps):
        ours = should_save(
            step, save_strategy=strategy, save_steps=save_steps, epoch_end=epoch_end, max_steps=max_steps
        )
        assert ours == hf, (step, epoch_end)


def test_eval_on_start_needs_a_strategy_and_eval_data():
    with pytest.raises(ValueError, match="eval_on_start=True needs eval_strategy 'steps' or 'epoch'"):
        check_eval_schedule(eval_strategy="no", eval_on_start=True, has_eval_data=True)
    with pytest.raises(
        ValueError, match=r"eval_strategy='steps' needs an eval dataset.*eval_on_start=True needs an eval"
    ):
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
