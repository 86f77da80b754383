"""``trainfold.train`` reproduces ``transformers.Trainer`` where the Trainer is right.

A small LlamaForCausalLM from config, the same initial weights and data order (sequential),
gradient accumulation 2, warmup, weight decay, clipping and the linear schedule, 12 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from resume_fixture import ListDataset as Rows
from tolerance import assert_within, causal_lm_run_bounds, sgd_rtol

from trainfold import TrainingArguments, train

transformers = pytest.importorskip("transformers")

STEPS = 12


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def rows(n=4 * STEPS, t=16):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (t,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, 6, (1,), generator=g))] = -100  # prompt tokens masked
        out.append({"input_ids": ids, "labels": labels})
    return out


SETTINGS = dict(
    max_steps=STEPS,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    warmup_steps=3,
    weight_decay=0.1,
    max_grad_norm=0.5,
    lr_scheduler_type="linear",
    seed=7,
    train_sampling_strategy="sequential",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = llama()
    data = rows()
    hf_model = copy.deepcopy(base)
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path_factory.mktemp("hf")), use_cpu=True, **SETTINGS)
    trainer = transformers.Trainer(model=hf_model, args=hf_args, train_dataset=Rows(data))
    trainer.train()
    hf_logs = [h for h in trainer.state.log_history if "loss" in h]

    before = {k: v.clone() for k, v in base.state_dict().items()}
    ours = train(base, TrainingArguments(output_dir=str(tmp_path_factory.mktemp("tf")), **SETTINGS), data)
    our_logs = [h for h in ours.log_history if "loss" in h and "train_loss" not in h]
    # as HF: the module given to train ends with the trained weights (issue 15, item 8)
    written = all(torch.equal(v, ours.state.params.get(k, v)) for k, v in base.state_dict().items())
    changed = any(not torch.equal(v, before[k]) for k, v in base.state_dict().items())
    return hf_model, hf_logs, ours, our_logs, written and changed


def test_per_step_losses_agree(runs):
    _, hf_logs, _, our_logs, _ = runs
    assert len(hf_logs) == len(our_logs) == STEPS
    for h, o in zip(hf_logs, our_logs):
        assert o["step"] == h["step"]
        assert o["loss"] == pytest.approx(h["loss"], rel=1e-5)


def test_learning_rates_and_grad_norms_agree(runs):
    _, hf_logs, _, our_logs, _ = runs
    assert [o["learning_rate"] for o in our_logs] == pytest.approx([h["learning_rate"] for h in hf_logs], rel=1e-12)
    assert our_logs[0]["learning_rate"] == 0.0  # warmup: the first update uses LR 0, as in HF
    assert [o["grad_norm"] for o in our_logs] == pytest.approx([h["grad_norm"] for h in hf_logs], rel=1e-4)


def test_final_params_agree(runs):
    hf_model, _, ours, _, _ = runs
    for name, p in hf_model.named_parameters():  # the same forward, loss and AdamW ops in the same order
        assert torch.equal(ours.state.params[name], p.detach()), name


def test_the_model_passed_in_holds_the_trained_weights(runs):
    *_, ours, _, written = runs
    assert ours.status == "completed" and ours.global_step == STEPS
    assert written, "train must leave the final weights in the model it was given, as HF does"


def test_sgd_with_momentum_and_a_min_lr_cosine_agree(tmp_path):
    settings = {
        **SETTINGS,
        "optim": "sgd",
        "optim_args": "momentum=0.9,nesterov=true",
        "learning_rate": 3e-2,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
    }
    base, data = llama(), rows()
    hf_model = copy.deepcopy(base)
    trainer = transformers.Trainer(
        model=hf_model,
        train_dataset=Rows(data),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **settings),
    )
    trainer.train()
    assert (
        type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__name__
        == "SGD"
    )
    hf_logs = [h for h in trainer.state.log_history if "loss" in h]
    ours = train(base, TrainingArguments(output_dir=str(tmp_path / "tf"), **settings), data)
    our_logs = [h for h in ours.log_history if "loss" in h and "train_loss" not in h]
    assert [o["learning_rate"] for o in our_logs] == pytest.approx([h["learning_rate"] for h in hf_logs], rel=1e-12)
    assert [o["loss"] for o in our_logs] == pytest.approx([h["loss"] for h in hf_logs], rel=1e-5)
    # The gradients are the same ops as in test_final_params_agree; torch.optim.SGD's foreach kernel orders the
    # momentum, Nesterov and update ops its own way: at most 3 roundings a step, each eps |p| or eps lr |m|, with
    # |m| <= max_grad_norm / (1 - momentum) (a clipped gradient's elements are at most its norm), and SGD adds
    # them up over the T steps (tests/tolerance.py)
    largest_update = settings["learning_rate"] * SETTINGS["max_grad_norm"] / (1 - 0.9)
    for name, p in hf_model.named_parameters():
        torch.testing.assert_close(
            ours.state.params[name],
            p.detach(),
            rtol=3 * sgd_rtol(STEPS),
            atol=3 * sgd_rtol(STEPS) * largest_update,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_label_smoothing_agrees_with_one_micro_batch_per_step(tmp_path):
    # HF smooths with its own formula (a mean over the vocabulary, then over tokens), another summation order
    # than ours: SGD + momentum, and the params within the derived bound (tests/tolerance.py)
    settings = {
        **SETTINGS,
        "gradient_accumulation_steps": 1,
        "label_smoothing_factor": 0.1,
        "optim": "sgd",
        "optim_args": "momentum=0.9",
    }
    base, data = llama(), rows()
    hf_model = copy.deepcopy(base)
    trainer = transformers.Trainer(
        model=hf_model,
        train_dataset=Rows(data),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **settings),
    )
    trainer.train()
    hf_logs = [h for h in trainer.state.log_history if "loss" in h]
    ours = train(base, TrainingArguments(output_dir=str(tmp_path / "tf"), **settings), data)
    our_logs = [h for h in ours.log_history if "loss" in h and "train_loss" not in h]
    plain = train(
        llama(),
        TrainingArguments(output_dir=str(tmp_path / "plain"), **{**settings, "label_smoothing_factor": 0.0}),
        data,
    )
    assert our_logs[0]["loss"] > plain.log_history[0]["loss"]  # smoothing raises the loss of a random model
    listed = [{k: v.tolist() for k, v in r.items()} for r in data]
    bound, rtol, loss_atol = causal_lm_run_bounds(
        llama(), listed, 2, hf_logs, settings["learning_rate"], 0.9, max_norm=0.5, label_smoothing=0.1
    )
    assert len(our_logs) == len(hf_logs)
    assert all(
        o["loss"] == pytest.approx(h["loss"], abs=loss_atol(h["loss"]), rel=0) for o, h in zip(our_logs, hf_logs)
    )
    for name, p in hf_model.named_parameters():
        assert_within(ours.state.params[name], p.detach(), bound[name], rtol, name)


@pytest.mark.parametrize(
    ("optim", "optim_args", "cls"),
    [
        ("adagrad", "lr_decay=0.01", "Adagrad"),
        ("rmsprop", "momentum=0.5,centered=true", "RMSprop"),
        ("adafactor", None, "Adafactor"),
    ],
)
def test_the_optimizers_torch_and_transformers_provide_agree(tmp_path, optim, optim_args, cls):
    """optim= names beyond AdamW and SGD run torch's (or transformers') own optimizer through from_torch."""
    settings = {**SETTINGS, "max_steps": 4, "optim": optim, "optim_args": optim_args, "learning_rate": 1e-2}
    base, data = llama(), rows(16)
    hf_model = copy.deepcopy(base)
    trainer = transformers.Trainer(
        model=hf_model,
        train_dataset=Rows(data),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **settings),
    )
    trainer.train()
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert type(inner).__name__ == cls
    hf_logs = [h for h in trainer.state.log_history if "loss" in h]
    ours = train(base, TrainingArguments(output_dir=str(tmp_path / "tf"), **settings), data)
    our_logs = [h for h in ours.log_history if "loss" in h and "train_loss" not in h]
    assert [o["loss"] for o in our_logs] == pytest.approx([h["loss"] for h in hf_logs], rel=1e-5)
    for name, p in hf_model.named_parameters():
        torch.testing.assert_close(ours.state.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
