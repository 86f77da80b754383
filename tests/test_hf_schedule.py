"""When ``train`` logs, evaluates and saves: step for step what a real ``transformers.Trainer`` does.

Each case runs the Trainer on a tiny Llama with a callback that records ``on_evaluate``,
``on_save`` and ``on_log``, then ``trainfold.train`` with the same settings, and compares the
step numbers: trainfold's eval entries in ``log_history``, the checkpoints on disk, the logs
(trainfold also logs the last step's partial window, which HF drops) and the best step.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume_fixture import ListDataset

from trainfold import TrainingArguments, train
from trainfold.observe.stopping import early_stopping
from trainfold.trainer.train import BEST

transformers = pytest.importorskip("transformers")

FULL = os.environ.get("TRAINFOLD_SLOW") == "full"


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def rows(n):
    ids = [torch.tensor([i % 12, i % 12 + 1, i % 12 + 2]) for i in range(n)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


class Recorder(transformers.TrainerCallback):
    def __init__(self):
        self.evaluations, self.saves, self.logs = [], [], []

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations.append(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.logs.append(state.global_step)


def scores(values):
    """Return a ``compute_metrics`` that reports ``values`` in turn as ``score`` (one per evaluation)."""
    it = itertools.cycle(values)
    return lambda pred: {"score": next(it)}


def checkpoints(out):
    return sorted(int(p.name.split("-")[1]) for p in Path(out).glob("checkpoint-*"))


def run_both(tmp_path, n_rows, settings_, score_values, patience=None):
    """Train on ``n_rows`` rows, one per micro-batch, with both trainers; return what each recorded."""
    data, eval_data = rows(n_rows), rows(1)
    common = dict(
        per_device_train_batch_size=1,
        train_sampling_strategy="sequential",
        report_to="none",
        disable_tqdm=True,
        learning_rate=1e-3,
        **settings_,
    )
    if settings_.get("eval_strategy", "no") != "no":
        common.update(metric_for_best_model="score", greater_is_better=True)
    hf_out, tf_out = tmp_path / "hf", tmp_path / "tf"
    recorder = Recorder()
    trainer = transformers.Trainer(
        model=llama(),
        args=transformers.TrainingArguments(output_dir=str(hf_out), use_cpu=True, **common),
        train_dataset=ListDataset(data),
        eval_dataset=ListDataset(eval_data),
        compute_metrics=scores(score_values),
        callbacks=[recorder] + ([transformers.EarlyStoppingCallback(patience)] if patience else []),
    )
    trainer.train()
    stopper = early_stopping("score", patience, greater_is_better=True) if patience else None
    ours = train(
        llama(),
        TrainingArguments(output_dir=str(tf_out), **common),
        data,
        eval_dataset=eval_data,
        compute_metrics=scores(score_values),
        early_stopping=stopper,
    )
    return trainer, recorder, ours, hf_out, tf_out


def compare(trainer, recorder, ours, hf_out, tf_out, logging_strategy, save_strategy="steps"):
    history = ours.log_history
    assert ours.global_step == trainer.state.global_step
    assert [h["step"] for h in history if "eval_loss" in h] == recorder.evaluations
    assert checkpoints(tf_out) == sorted(set(recorder.saves)) == checkpoints(hf_out)
    last_saved = ours.last_checkpoint.name if ours.last_checkpoint is not None else None
    assert last_saved == (f"checkpoint-{recorder.saves[-1]}" if recorder.saves else None)
    logged = [h["step"] for h in history if "loss" in h and "train_loss" not in h]
    last = {trainer.state.global_step} if logging_strategy != "no" else set()
    assert logged == sorted(set(recorder.logs) | last)
    best = ours.state.extras.get(BEST)
    our_best = None if best is None or int(best.step) < 0 else int(best.step)
    if save_strategy != "no":  # HF records the best step only when it saves (trainfold always does)
        assert our_best == trainer.state.best_global_step


# -- concrete cases from the issue ---------------------------------------------------------------


def test_eval_and_save_steps_equal_to_the_steps_per_epoch(tmp_path):
    """eval_steps == steps per epoch: HF evaluates at every epoch end; trainfold used to skip them all."""
    settings_ = dict(
        num_train_epochs=2, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3, logging_steps=3
    )
    trainer, recorder, ours, hf_out, tf_out = run_both(tmp_path, 3, settings_, [1.0, 2.0])
    assert recorder.evaluations == [3, 6] and recorder.saves == [3, 6]
    compare(trainer, recorder, ours, hf_out, tf_out, "steps")


def test_load_best_model_at_end_finds_the_best_at_an_epoch_end(tmp_path):
    settings_ = dict(
        num_train_epochs=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        logging_steps=2,
        load_best_model_at_end=True,
    )
    trainer, recorder, ours, hf_out, tf_out = run_both(tmp_path, 2, settings_, [2.0, 1.0])
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert ours.best_checkpoint is not None and ours.best_checkpoint.name == "checkpoint-2"
    compare(trainer, recorder, ours, hf_out, tf_out, "steps")


def test_max_steps_mid_epoch_evaluates_and_saves_by_epoch(tmp_path):
    """max_steps ends the run inside an epoch: HF ends that epoch there, so it evaluates and saves."""
    settings_ = dict(max_steps=6, eval_strategy="epoch", save_strategy="epoch", logging_strategy="epoch")
    trainer, recorder, ours, hf_out, tf_out = run_both(tmp_path, 4, settings_, [1.0])
    assert recorder.evaluations == [4, 6] and recorder.saves == [4, 6]
    compare(trainer, recorder, ours, hf_out, tf_out, "epoch")


def test_early_stopping_mid_epoch_ends_the_epoch_there(tmp_path):
    """HF leaves the epoch loop when early stopping fires, so on_epoch_end saves (and logs) by epoch there."""
    settings_ = dict(
        num_train_epochs=2, eval_strategy="steps", eval_steps=1, save_strategy="epoch", logging_strategy="epoch"
    )
    trainer, recorder, ours, hf_out, tf_out = run_both(tmp_path, 4, settings_, [1.0, 0.0], patience=1)
    assert recorder.evaluations == [1, 2] and recorder.saves == [2] and recorder.logs == [2]
    assert ours.status == "stopped"
    compare(trainer, recorder, ours, hf_out, tf_out, "epoch", "epoch")


def test_logging_first_step_logs_under_logging_strategy_no(tmp_path):
    settings_ = dict(max_steps=3, logging_strategy="no", logging_first_step=True, save_strategy="no")
    trainer, recorder, ours, hf_out, tf_out = run_both(tmp_path, 2, settings_, [1.0])
    assert recorder.logs == [1]
    compare(trainer, recorder, ours, hf_out, tf_out, "no")


# -- the grid ------------------------------------------------------------------------------------

STEPS = [1, 2, 3, 0.3, 0.5]


@st.composite
def schedules(draw):
    accumulation = draw(st.sampled_from([1, 1, 2, 3]))  # a short last step when it does not divide the rows
    n_rows = draw(st.integers(1, min(8, 4 * accumulation)))
    epochs = draw(st.integers(1, 3))
    s = {
        "max_steps": draw(st.sampled_from([-1, -1, 1, 2, 3, 5, 7])),
        "num_train_epochs": epochs,
        "gradient_accumulation_steps": accumulation,
    }
    s["eval_strategy"] = draw(st.sampled_from(["no", "steps", "epoch"]))
    if s["eval_strategy"] != "no":
        s["eval_steps"] = draw(st.sampled_from([None, *STEPS]))
        s["eval_delay"] = draw(st.sampled_from([0, 0, 1, 2, 1.5, 4]))
        s["eval_on_start"] = draw(st.booleans())
    saves = ["no", "steps", "epoch"] + (["best"] if s["eval_strategy"] != "no" else [])
    s["save_strategy"] = draw(st.sampled_from(saves))
    s["save_steps"] = draw(st.sampled_from(STEPS))
    s["logging_strategy"] = draw(st.sampled_from(["steps", "epoch", "no"]))
    s["logging_steps"] = draw(st.sampled_from(STEPS))
    s["logging_first_step"] = draw(st.booleans())
    values = draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=1, max_size=4))
    patience = draw(st.sampled_from([None, 1, 2])) if s["eval_strategy"] != "no" else None
    return n_rows, s, values, patience


@pytest.mark.slow
@settings(max_examples=60 if FULL else 4, deadline=None)
@given(case=schedules())
def test_schedule_matches_transformers_trainer(tmp_path_factory, case):
    n_rows, settings_, values, patience = case
    tmp = tmp_path_factory.mktemp("grid")
    trainer, recorder, ours, hf_out, tf_out = run_both(tmp, n_rows, settings_, values, patience)
    compare(trainer, recorder, ours, hf_out, tf_out, settings_["logging_strategy"], settings_["save_strategy"])


# -- logging_nan_inf_filter (issue 15, item 10) --------------------------------------------------


def nan_at(loss, steps):
    """Wrap ``loss`` so its value is NaN at the given calls (1-based), its gradient unchanged."""
    calls = []

    def wrapped(outputs, labels, num_items_in_batch=None):
        calls.append(1)
        value = loss(outputs, labels, num_items_in_batch)
        return value + math.nan * value.detach() if len(calls) in steps else value

    return wrapped


def hf_causal_lm(outputs, labels, num_items_in_batch=None):
    return transformers.loss.loss_utils.ForCausalLMLoss(
        outputs.logits, labels, vocab_size=16, num_items_in_batch=num_items_in_batch
    )


def hf_filtered(losses, nan_steps, every):
    """HF's ``logging_nan_inf_filter`` (trainer.py ``_run_epoch``): a NaN step adds ``tr_loss / (1 + steps logged)``.

    ``steps logged`` is ``global_step - _globalstep_last_logged`` before the step is counted.
    """
    logged, total, last = [], 0.0, 0
    for step, loss in enumerate(losses, 1):
        total += total / (1 + (step - 1) - last) if step in nan_steps else loss
        if step % every == 0:
            logged.append(total / (step - last))
            total, last = 0.0, step
    return logged


def test_nan_losses_are_filtered_from_the_logged_loss_never_logged_as_nan(tmp_path):
    from trainfold.core.losses import causal_lm

    # the first label masked: the shifted and unshifted label counts agree, so a wrapped loss normalises alike
    data = [
        {"input_ids": x["input_ids"], "labels": torch.cat([torch.tensor([-100]), x["labels"][1:]])} for x in rows(8)
    ]
    nan_steps = {2, 5, 6}  # windows of 2: [finite, nan], [finite, finite], [nan, nan], [finite, finite]
    common = dict(
        max_steps=8,
        per_device_train_batch_size=1,
        train_sampling_strategy="sequential",
        report_to="none",
        disable_tqdm=True,
        learning_rate=1e-2,
        save_strategy="no",
    )

    def hf_run(loss, logging_steps, out):
        hf_args = transformers.TrainingArguments(
            output_dir=str(out), use_cpu=True, logging_steps=logging_steps, **common
        )
        trainer = transformers.Trainer(
            model=llama(), args=hf_args, train_dataset=ListDataset(data), compute_loss_func=loss
        )
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    clean = hf_run(hf_causal_lm, 1, tmp_path / "clean")  # the NaN only hides the value: the updates are the same
    hf = hf_run(nan_at(hf_causal_lm, nan_steps), 2, tmp_path / "hf")
    ours = train(
        llama(),
        TrainingArguments(output_dir=str(tmp_path / "tf"), logging_steps=2, **common),
        data,
        compute_loss_func=nan_at(causal_lm, nan_steps),
    )
    logged = [h["loss"] for h in ours.log_history if "loss" in h and "train_loss" not in h]

    assert hf == pytest.approx(hf_filtered(clean, nan_steps, 2), rel=1e-6)  # HF's rule, as read from trainer.py
    assert hf[2] == 0.0 and hf[0] == pytest.approx(0.75 * clean[0], rel=1e-6)  # HF: 0.0 for a NaN-only window
    finite_so_far = [c for s, c in enumerate(clean[:6], 1) if s not in nan_steps]
    expected = [clean[0], (clean[2] + clean[3]) / 2, sum(finite_so_far) / len(finite_so_far), (clean[6] + clean[7]) / 2]
    assert logged == pytest.approx(expected, rel=1e-5)
    assert ours.status == "completed" and not any(math.isnan(v) for v in logged)
