"""A run's ``Plan`` is built from ``TrainingArguments`` without training, and each piece is checked on its own."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import TrainingArguments, train
from trainfold.ckpt import policy
from trainfold.ckpt.best import greater_is_better_for
from trainfold.data import loaders, samplers
from trainfold.evaluation import schedule as eval_schedule
from trainfold.observe import observers, reporters
from trainfold.observe.stopping import early_stopping
from trainfold.trainer import args as hf_args
from trainfold.trainer.evaluating import eval_plan_for
from trainfold.trainer.extras import BEST, run_extras
from trainfold.trainer.plan import CheckpointPlan, StopRules, sampler_for, schedule_for, step_options, stop_rules
from trainfold.trainer.planning import TrainCall, plan_for
from trainfold.trainer.resume import initial_state, on_device


def rows(n: int = 8) -> list[dict]:
    return [
        {"input_ids": [i % 16, (i + 1) % 16, (i + 2) % 16], "labels": [i % 16, (i + 1) % 16, (i + 2) % 16]}
        for i in range(n)
    ]


def tiny():
    from trainfold.core.models import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))


def args_of(tmp_path, **changes) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    return TrainingArguments(**{**base, **changes})


# -- concrete examples -----------------------------------------------------------------------------


def test_plan_is_built_without_training(tmp_path):
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = args_of(
        tmp_path,
        gradient_accumulation_steps=3,
        train_sampling_strategy="group_by_length",
        bf16=True,
        eval_strategy="steps",
        eval_steps=2,
        data_seed=7,
    )
    plan = plan_for(args, TrainCall(model, rows(12), {"a": rows(4), "b": rows(2)}))
    assert (plan.sampler.strategy, plan.sampler.gradient_accumulation_steps, plan.sampler.seed) == (
        "group_by_length",
        3,
        7,
    )
    assert plan.sampler.global_batch_size == 6 and plan.samples_per_step == 6
    assert plan.step_options.execution.autocast == torch.bfloat16 and plan.step_options.execution.loss_scaling is None
    assert [s.prefix for s in plan.evals.sets] == ["eval_a", "eval_b"]
    assert [s for s in range(1, 5) if plan.evals.due(s, total_steps=4, steps_per_epoch=2)] == [2, 4]
    assert plan.stops.names == ("max_steps",) and plan.schedule.total_steps == 4
    assert plan.checkpoints == CheckpointPlan(str(tmp_path), "no", 500, None, False, False, True)
    assert plan.reporters.names == ("none",) and plan.reporters.bar is False
    assert plan.settings["world_size"] == 1 and plan.settings["gradient_accumulation_steps"] == 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing trained
    assert not any(tmp_path.iterdir())  # nothing written


def test_plan_tracks_the_early_stoppers_metric_and_assembles_the_extras_from_their_owners(tmp_path):
    args = args_of(tmp_path, eval_strategy="steps", eval_steps=1, fp16=False, include_num_input_tokens_seen=True)
    stopper = early_stopping("loss", patience=2)
    plan = plan_for(args, TrainCall(tiny(), rows(), rows(4), early_stopping=stopper, stop=lambda state: False))
    assert plan.metric_key == "eval_loss" and plan.early is stopper
    assert plan.stops.names == ("max_steps", "early_stopping", "stop")
    assert list(plan.extras) == [observers.LOG_MARK, observers.TOKENS_SEEN, stopper.key, BEST]
    assert sorted(initial_state(plan).extras) == sorted(plan.extras)


def test_sampler_and_schedule_follow_the_arguments():
    args = TrainingArguments(
        max_steps=0, num_train_epochs=1.5, per_device_train_batch_size=3, train_sampling_strategy="sequential", seed=5
    )
    sampler = sampler_for(args, list(range(10)))
    assert (sampler.strategy, sampler.seed, sampler.steps_per_epoch()) == ("sequential", 5, 4)
    assert schedule_for(args, sampler).total_steps == 6 and schedule_for(args, sampler).num_epochs == 2
    assert step_options(TrainingArguments(fp16=True)).execution.loss_scaling is not None


def test_vocabularies_come_from_their_owners():
    assert hf_args.SAVE_STRATEGIES is policy.SAVE_STRATEGIES
    assert hf_args.SAMPLING_STRATEGIES is samplers.STRATEGIES
    assert hf_args.INTERVALS is eval_schedule.EVAL_STRATEGIES
    assert hf_args.LOG_LEVELS is reporters.LOG_LEVELS
    with pytest.raises(ValueError, match=r"dataloader_prefetch_factor=0 must be a positive int"):
        TrainingArguments(dataloader_num_workers=2, dataloader_prefetch_factor=0)  # the pipeline's own check
    assert loaders.loader_errors(2, False, None) == []


def test_the_stop_rule_is_asked_once_per_step_not_again_after_the_run(tmp_path):
    calls: list[int] = []

    def stop(state) -> bool:
        calls.append(int(state.step))
        return int(state.step) >= 2

    result = train(tiny(), args_of(tmp_path), rows(), stop=stop)
    assert result.status == "stopped" and result.global_step == 2
    assert calls == [0, 1, 2]  # the status comes from the rule that held, not from asking it again


def test_stop_rules_record_the_first_that_holds():
    fired: list[str] = []
    rules = StopRules((("max_steps", lambda s: s >= 5),)).including("stop", lambda s: s >= 3).including("x", None)
    assert rules.names == ("max_steps", "stop")
    assert [rules.predicate(fired)(s) for s in (1, 3, 6)] == [False, True, True] and fired == ["stop", "max_steps"]


def test_on_device_moves_every_tensor_but_integer_counters():
    record = {"step": torch.tensor(3), "exp_avg": [torch.zeros(2)], "scale": torch.tensor(1.0), "n": 3}
    out = on_device(record, torch.device("meta"))
    assert out["step"].device.type == "cpu" and out["exp_avg"][0].is_meta and out["scale"].is_meta and out["n"] == 3


# -- properties --------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 5),
    accumulation=st.integers(1, 4),
    epochs=st.floats(0.1, 3.0),
    drop_last=st.booleans(),
)
def test_schedule_is_the_epochs_of_the_samplers_steps(n, batch, accumulation, epochs, drop_last):
    args = TrainingArguments(
        max_steps=0,
        num_train_epochs=epochs,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        dataloader_drop_last=drop_last,
    )
    sampler = sampler_for(args, list(range(n)))
    plan = schedule_for(args, sampler)
    assert sampler.global_batch_size == batch * accumulation
    assert plan.steps_per_epoch == sampler.steps_per_epoch()
    assert plan.total_steps == math.ceil(epochs * sampler.steps_per_epoch()) and plan.num_epochs == math.ceil(epochs)


@settings(max_examples=30, deadline=None)
@given(fp16=st.booleans(), tokens=st.booleans(), metric=st.sampled_from([None, "eval_loss", "eval_accuracy"]))
def test_extras_hold_one_record_per_owner(fp16, tokens, metric):
    args = TrainingArguments(fp16=fp16, include_num_input_tokens_seen=tokens)
    extras = run_extras(args, metric_key=metric)
    assert (observers.TOKENS_SEEN in extras) is tokens and ("grad_scaler" in extras) is fp16
    assert (BEST in extras) is (metric is not None)
    if metric is not None:
        assert bool(extras[BEST].greater_is_better) is greater_is_better_for(metric)


# -- errors --------------------------------------------------------------------------------------------


def test_a_dataset_without_length_needs_max_steps():
    stream_like = iter(range(4))
    args = TrainingArguments(max_steps=0, num_train_epochs=1)
    with pytest.raises(ValueError, match="without __len__ needs max_steps > 0"):
        schedule_for(args, sampler_for(args, stream_like))


def test_an_eval_strategy_needs_an_eval_dataset():
    with pytest.raises(ValueError, match="eval_strategy='steps' needs an eval dataset"):
        eval_plan_for(TrainingArguments(eval_strategy="steps"), None, list, total_steps=4, loss=None)


def test_stop_rules_agree_across_ranks_only_with_a_collective():
    mine = lambda state: False
    assert dict(stop_rules(3, stop=mine).rules)["stop"] is mine
