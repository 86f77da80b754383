"""Where trainfold is deliberately better than the HF Trainer: gradients independent of accumulation.

Each case trains one SGD step (lr 1, no clipping) so the parameter change is exactly minus the
gradient, and compares it with the gradient of the true mean loss over the whole batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from resume_fixture import ListDataset

from trainfold import init_state, make_step, sgd
from trainfold.core.losses import causal_lm, cross_entropy

transformers = pytest.importorskip("transformers")


def hf_one_step_update(model, rows, batch_size, accumulation, tmp_path):
    """Run one HF Trainer step with SGD(lr=1) and return new_params - old_params."""
    model = copy.deepcopy(model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        max_grad_norm=0.0,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        logging_strategy="no",
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ListDataset(rows), optimizers=(opt, None))
    trainer.train()
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}


def trainfold_one_step_update(model, rows, batch_size, loss):
    opt = sgd(1.0)
    state = init_state(model, opt)
    micro = [
        {k: torch.stack([torch.as_tensor(r[k]) for r in rows[i : i + batch_size]]) for k in rows[0]}
        for i in range(0, len(rows), batch_size)
    ]
    new = make_step(model, loss, opt)(state, micro)
    return {k: new.params[k] - state.params[k] for k in state.params}


def true_gradient(model, rows, mean_loss):
    model = copy.deepcopy(model)
    batch = {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in rows[0]}
    mean_loss(model, batch).backward()
    return {k: -p.grad for k, p in model.named_parameters()}


def relative_error(update, reference):
    num = sum(((update[k] - reference[k]) ** 2).sum() for k in reference) ** 0.5
    den = sum((reference[k] ** 2).sum() for k in reference) ** 0.5
    return (num / den).item()


def test_gpt2_shifted_label_count(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(4):
        ids = torch.randint(0, 64, (10,), generator=g)
        labels = ids.clone()
        labels[7:] = -100  # padding at the end; labels[0] is a real token, which HF miscounts
        rows.append({"input_ids": ids, "labels": labels})

    def mean_loss(m, batch):  # the true token mean over the shifted labels
        logits = m(input_ids=batch["input_ids"]).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
        )

    ref = true_gradient(model, rows, mean_loss)
    ours = trainfold_one_step_update(model, rows, 2, causal_lm)
    theirs = hf_one_step_update(model, rows, 2, 2, tmp_path)
    assert relative_error(ours, ref) < 1e-5
    # HF counts labels[...] instead of labels[..., 1:]: 28 items instead of 24, so 14% too small.
    assert relative_error(theirs, ref) == pytest.approx(1 - 24 / 28, rel=1e-3)


def test_sequence_classification_with_accumulation(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=3,
        pad_token_id=0,
    )
    model = transformers.LlamaForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": torch.randint(1, 64, (8,), generator=g), "labels": torch.tensor(i % 3)} for i in range(4)]

    def mean_loss(m, batch):
        return torch.nn.functional.cross_entropy(m(input_ids=batch["input_ids"]).logits, batch["labels"])

    ref = true_gradient(model, rows, mean_loss)
    ours = trainfold_one_step_update(model, rows, 2, cross_entropy)
    theirs = hf_one_step_update(model, rows, 2, 2, tmp_path)
    no_accumulation = hf_one_step_update(model, rows, 4, 1, tmp_path)
    assert relative_error(ours, ref) < 1e-5
    assert relative_error(no_accumulation, ref) < 1e-5
    # HF believes the head normalises by num_items_in_batch (it has **kwargs) and skips /GA: 2x.
    assert relative_error(theirs, ref) == pytest.approx(1.0, rel=1e-3)
