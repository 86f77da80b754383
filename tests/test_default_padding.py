"""Without a data_collator and a processing_class, rows are padded with the model's ``config.pad_token_id``, or the
run is refused when they need padding and no pad id is known (``transformers.Trainer`` refuses ragged rows)."""

from __future__ import annotations

import copy

import pytest
import torch
from resume_fixture import ListDataset

import trainfold

transformers = pytest.importorskip("transformers")

PAD = 1  # not 0: padding with 0 made last-token pooling read the wrong positions


def classifier(pad_token_id):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        num_labels=2,
        pad_token_id=pad_token_id,
        use_cache=False,
    )
    return transformers.LlamaForSequenceClassification(cfg)


def rows(n=8):  # ragged: lengths 3..6, no id is the pad id
    return [{"input_ids": [2 + (i * 5 + j) % 29 for j in range(3 + i % 4)], "labels": i % 2} for i in range(n)]


def hf_args(path, **settings):
    return transformers.TrainingArguments(
        output_dir=str(path),
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        train_sampling_strategy="sequential",
        **settings,
    )


class PadWith:
    """What HF's DataCollatorWithPadding does with a tokenizer whose pad id is ``pad``: pad input_ids with it."""

    def __init__(self, pad):
        self.pad = pad

    def __call__(self, items):
        width = max(len(x["input_ids"]) for x in items)
        ids = [x["input_ids"] + [self.pad] * (width - len(x["input_ids"])) for x in items]
        mask = [[1] * len(x["input_ids"]) + [0] * (width - len(x["input_ids"])) for x in items]
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "labels": torch.tensor([x["labels"] for x in items]),
        }


def losses(history):
    return [h["loss"] for h in history if "loss" in h]


def test_rows_are_padded_with_the_models_pad_id_and_train_as_hf_does_with_it(tmp_path):
    model = classifier(PAD)
    trainer = transformers.Trainer(
        model=copy.deepcopy(model),
        args=hf_args(tmp_path / "hf"),
        train_dataset=ListDataset(rows()),
        data_collator=PadWith(PAD),
    )
    trainer.train()
    ours = trainfold.train(model, trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf")), rows())
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)
    padded_with_0 = trainfold.train(
        classifier(PAD),
        trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "zero")),
        rows(),
        data_collator=trainfold.data.pad_collate(pad_token_id=0),
    )
    assert losses(padded_with_0.log_history) != pytest.approx(losses(ours.log_history), rel=1e-5)  # it matters


def test_ragged_rows_without_a_pad_id_are_refused_as_hf_refuses_them(tmp_path):
    with pytest.raises(ValueError):  # HF's default_data_collator cannot make a tensor of ragged rows
        transformers.Trainer(
            model=classifier(None), args=hf_args(tmp_path / "hf"), train_dataset=ListDataset(rows())
        ).train()
    args = trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf"))
    with pytest.raises(ValueError, match=r"'input_ids' need padding .* no pad id .*processing_class.*pad_token_id"):
        trainfold.train(classifier(None), args, rows())


def test_rows_of_one_length_need_no_pad_id(tmp_path):
    torch.manual_seed(0)
    cfg = classifier(None).config
    model = transformers.LlamaForCausalLM(cfg)  # no pad id: batches of one length still train, as in HF
    even = [{"input_ids": r["input_ids"][:3], "labels": r["input_ids"][:3]} for r in rows()]
    trainer = transformers.Trainer(
        model=copy.deepcopy(model), args=hf_args(tmp_path / "hf"), train_dataset=ListDataset(even)
    )
    trainer.train()
    ours = trainfold.train(model, trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf")), even)
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)


def test_evaluate_and_predict_pad_with_the_models_pad_id_too(tmp_path):
    model = classifier(PAD)
    args = trainfold.TrainingArguments.from_hf(hf_args(tmp_path, per_device_eval_batch_size=4))
    hf = transformers.Trainer(model=model, args=hf_args(tmp_path / "hf", per_device_eval_batch_size=4),
                              data_collator=PadWith(PAD))  # fmt: skip
    expected = hf.evaluate(ListDataset(rows()))["eval_loss"]
    assert trainfold.evaluate(model, args, rows())["eval_loss"] == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="no pad id"):
        trainfold.predict(classifier(None), args, rows())
