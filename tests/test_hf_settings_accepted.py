"""Valid HF settings trainfold refused (issue 44, item 8): each is accepted as ``transformers.Trainer`` accepts it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import trainfold

transformers = pytest.importorskip("transformers")


def hf_args(path, **settings):
    return transformers.TrainingArguments(
        output_dir=str(path), use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=1,
        per_device_train_batch_size=2, train_sampling_strategy="sequential", **settings,
    )  # fmt: skip


def losses(history):
    return [h["loss"] for h in history if "loss" in h]


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


ROWS = [{"input_ids": [1 + (i * 7 + j) % 30 for j in range(8)]} for i in range(8)]
ROWS = [{**r, "labels": r["input_ids"]} for r in ROWS]


def test_metric_for_best_model_without_compute_metrics_trains_when_nothing_is_evaluated(tmp_path):
    settings = dict(max_steps=2, metric_for_best_model="accuracy", eval_strategy="no", save_strategy="no")
    model = llama()
    trainer = transformers.Trainer(copy.deepcopy(model), hf_args(tmp_path / "hf", **settings), train_dataset=ROWS)
    trainer.train()  # transformers trains: nothing reads the metric
    ours = trainfold.train(model, trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf", **settings)), ROWS)
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)


def test_metric_for_best_model_without_compute_metrics_is_still_refused_when_evaluating(tmp_path):
    settings = dict(max_steps=2, metric_for_best_model="accuracy", eval_strategy="steps", eval_steps=1)
    args = trainfold.TrainingArguments.from_hf(hf_args(tmp_path, save_strategy="no", **settings))
    with pytest.raises(ValueError, match="metric_for_best_model='accuracy', but without compute_metrics"):
        trainfold.train(llama(), args, ROWS, eval_dataset=ROWS[:2])


class FloatFeatures(nn.Module):
    """As transformers' test RegressionModel: ``y = a * x + b`` on float features, here under ``input_ids``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))
        self.b = nn.Parameter(torch.tensor(-0.25))

    def forward(self, input_ids, labels=None):
        y = input_ids * self.a + self.b
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


def test_float_input_ids_of_a_module_without_embeddings_train_as_in_hf(tmp_path):
    rows = [{"input_ids": float(i) / 4, "labels": 2.0 * i / 4 + 3.0} for i in range(8)]
    settings = dict(max_steps=4, learning_rate=0.1, save_strategy="no")
    model = FloatFeatures()
    trainer = transformers.Trainer(copy.deepcopy(model), hf_args(tmp_path / "hf", **settings), train_dataset=rows)
    trainer.train()
    ours = trainfold.train(model, trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf", **settings)), rows)
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_restore_callback_states_set_only_on_the_resuming_run_resumes_as_in_hf(tmp_path):
    settings = dict(max_steps=4, save_steps=2)
    hf_first = transformers.Trainer(
        llama(), hf_args(tmp_path / "hf", **settings), train_dataset=ROWS, callbacks=[StopAt(2)]
    )
    hf_first.train()
    hf = transformers.Trainer(
        llama(), hf_args(tmp_path / "hf", restore_callback_states_from_checkpoint=True, **settings), train_dataset=ROWS
    )
    assert hf.train(resume_from_checkpoint=True).global_step == 4  # HF's workflow: the flag on the resume only

    def args(**more):
        return trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf", **settings, **more))

    trainfold.train(llama(), args(), ROWS, stop=lambda s: int(s.step) >= 2)
    resumed = trainfold.train(
        llama(), args(restore_callback_states_from_checkpoint=True), ROWS, resume_from_checkpoint=True
    )  # was refused: "checkpoint-2 ... is another run"
    assert resumed.global_step == 4
    assert losses(resumed.log_history) == pytest.approx(losses(hf.state.log_history), rel=1e-5)
