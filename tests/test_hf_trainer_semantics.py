"""What a script migrating from ``transformers.Trainer`` reads back is HF's: keys, order, shapes, decay groups.

Each case runs the real ``transformers.Trainer`` and trainfold on the same tiny model and data in one process.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from resume_fixture import ListDataset

import trainfold
from trainfold.optim.masks import decay_mask

transformers = pytest.importorskip("transformers")


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def row(i):
    ids = [1 + (i * 7 + j) % 30 for j in range(8)]
    return {"input_ids": ids, "labels": [-100, *ids[1:]]}


ROWS = [row(i) for i in range(10)]


def hf_args(path, **settings):
    return transformers.TrainingArguments(
        output_dir=str(path), use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no", **settings
    )


def side_by_side(tmp_path, settings, rows=ROWS, eval_rows=None, hf_callbacks=(), tf_callbacks=()):
    """Train one Llama with a real Trainer and with trainfold on the same settings: (trainer, its output, ours)."""
    model, evals = llama(), {} if eval_rows is None else {"eval_dataset": ListDataset(eval_rows)}
    args = hf_args(tmp_path / "hf", **settings)
    trainer = transformers.Trainer(
        model=copy.deepcopy(model), args=args, train_dataset=ListDataset(rows), callbacks=list(hf_callbacks), **evals
    )
    theirs = trainer.train()
    ours = trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf", **settings))
    return trainer, theirs, trainfold.train(model, ours, rows, eval_dataset=eval_rows, callbacks=list(tf_callbacks))


def test_from_hf_and_callbacks_leave_a_trainer_of_the_same_process_working(tmp_path):
    # transformers' TrainingArguments.__post_init__ clears accelerate's shared state: building one aside (the
    # defaults from_hf compares with, the args HF callbacks get) made the script's Trainer fail at its next call
    args = hf_args(tmp_path, max_steps=1, per_device_train_batch_size=2)
    trainer = transformers.Trainer(model=llama(), args=args, train_dataset=ListDataset(ROWS))
    ours = trainfold.TrainingArguments.from_hf(args)
    assert "eval_loss" in trainer.evaluate(ListDataset(ROWS[:2]))
    trainfold.train(llama(), ours, ROWS, callbacks=[transformers.TrainerCallback()])
    assert trainer.train().global_step == 1


def test_predict_with_prediction_loss_only_returns_the_loss_alone_as_hf(tmp_path):
    args = hf_args(tmp_path, prediction_loss_only=True, per_device_eval_batch_size=4)
    ours = trainfold.TrainingArguments.from_hf(args)
    model = llama()
    theirs = transformers.Trainer(model=model, args=args).predict(ListDataset(ROWS))
    out = trainfold.predict(model, ours, ROWS)
    assert theirs.predictions is None and theirs.label_ids is None
    assert out.predictions is None and out.label_ids is None  # were the whole set's logits and labels
    assert out.metrics["test_loss"] == pytest.approx(theirs.metrics["test_loss"], rel=1e-5)


def test_the_decay_groups_are_hfs_a_bias_anywhere_in_the_name_is_not_decayed(tmp_path):
    # T5's relative_attention_bias is an Embedding: its ".weight" was decayed (HF: any name with "bias" is not)
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    model = transformers.T5ForConditionalGeneration(cfg)
    trainer = transformers.Trainer(model=model, args=hf_args(tmp_path, weight_decay=0.1))
    theirs = set(trainer.get_decay_parameter_names(model)) & {n for n, _ in model.named_parameters()}  # not tied twins
    assert {n for n, decays in decay_mask(model).items() if decays} == theirs
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" not in theirs


def test_train_metrics_have_hfs_keys(tmp_path):
    settings = dict(max_steps=2, per_device_train_batch_size=2, logging_steps=1)
    hf_model = llama()
    theirs = transformers.Trainer(
        model=hf_model, args=hf_args(tmp_path / "hf", **settings), train_dataset=ListDataset(ROWS)
    ).train()
    ours = trainfold.train(llama(), trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf", **settings)), ROWS)
    assert sorted(ours.metrics) == sorted(theirs.metrics)  # no "step": TrainOutput.metrics has none
    assert ours.metrics["train_loss"] == pytest.approx(theirs.metrics["train_loss"], rel=1e-5)
    assert ours.log_history[-1]["step"] == 2  # the log entry keeps it, as HF's log_history


def test_an_evaluation_by_steps_at_an_epoch_end_is_logged_before_the_epochs_log_as_hf(tmp_path):
    # logging by epoch, evaluating by steps: HF evaluates at the step's end, then logs at the epoch's end;
    # trainfold kept this order only when HF callbacks were given
    settings = dict(
        num_train_epochs=2,
        per_device_train_batch_size=4,
        logging_strategy="epoch",
        eval_strategy="steps",
        eval_steps=3,
        train_sampling_strategy="sequential",
    )
    trainer, _, ours = side_by_side(tmp_path, settings, eval_rows=ROWS[:2])

    def shape(history):
        return [(h["step"], "eval_loss" in h, "loss" in h, "train_loss" in h) for h in history]

    assert shape(ours.log_history) == shape(trainer.state.log_history)
    assert shape(ours.log_history)[-3:] == [(6, True, False, False), (6, False, True, False), (6, False, False, True)]


class EpochsSeen(transformers.TrainerCallback):
    def __init__(self):
        self.epochs = []

    def on_step_end(self, args, state, control, **kwargs):
        self.epochs.append(round(state.epoch, 6))


def test_a_logged_epoch_counts_micro_batches_as_hf_in_an_epoch_with_a_short_last_step(tmp_path):
    # 10 rows in micro-batches of 2, accumulation 2: 5 micro-batches, 3 steps; HF's epoch after step 1 is 2/5 = 0.4
    # (trainfold said 1/3), in the log history and in the state a TrainerCallback reads
    settings = dict(
        num_train_epochs=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        train_sampling_strategy="sequential",
    )
    seen_hf, seen_tf = EpochsSeen(), EpochsSeen()
    trainer, _, ours = side_by_side(
        tmp_path, settings, eval_rows=ROWS[:2], hf_callbacks=[seen_hf], tf_callbacks=[seen_tf]
    )

    def epochs(history):
        return [(h["step"], round(h["epoch"], 6)) for h in history]

    assert epochs(ours.log_history) == epochs(trainer.state.log_history)
    assert epochs(ours.log_history)[:3] == [(1, 0.4), (2, 0.8), (2, 0.8)]
    assert seen_tf.epochs == seen_hf.epochs


def test_counting_tokens_every_log_has_hfs_keys(tmp_path):
    # HF adds num_input_tokens_seen to every log (evaluations and the summary too) and the session's train_runtime
    # and train_tokens_per_second to each training log
    settings = dict(
        max_steps=4,
        per_device_train_batch_size=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        include_num_input_tokens_seen="all",
    )
    trainer, theirs, ours = side_by_side(tmp_path, settings, eval_rows=ROWS[:2])
    hf_keys = [sorted(set(h) - {"total_flos"}) for h in trainer.state.log_history]  # trainfold counts no FLOPs
    assert [sorted(set(h) - {"eval_token_loss"}) for h in ours.log_history] == hf_keys  # trainfold's named extra
    assert [h["num_input_tokens_seen"] for h in ours.log_history] == [
        h["num_input_tokens_seen"] for h in trainer.state.log_history
    ]
    assert all(h["train_tokens_per_second"] > 0 for h in ours.log_history if "loss" in h)
    assert sorted(ours.metrics) == sorted(theirs.metrics)


def test_remove_unused_columns_false_leaves_a_text_column_out_of_the_default_collation_as_hf(tmp_path):
    # HF's default_data_collator leaves strings out; trainfold's refused the run ("cannot make a tensor of ... 'text'")
    rows = [{**r, "text": f"row {i}"} for i, r in enumerate(ROWS)]
    settings = dict(max_steps=2, per_device_train_batch_size=2, logging_steps=1, remove_unused_columns=False)
    trainer, _, ours = side_by_side(tmp_path, settings, rows=rows)
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [h["loss"] for h in ours.log_history if "loss" in h] == pytest.approx(theirs, rel=1e-5)


@pytest.mark.parametrize(
    ("keyword", "fix"),
    [
        ("optimizers", "optimizer=trainfold.optim.from_torch"),
        ("tokenizer", "processing_class="),
        ("model_init", "model_init()"),
    ],
)
def test_trainer_keywords_taken_another_way_are_refused_by_name_with_the_fix(tmp_path, keyword, fix):
    # were Python's bare "got an unexpected keyword argument 'optimizers'"
    model = llama()
    value = {"optimizers": (torch.optim.SGD(model.parameters(), lr=0.1), None), "tokenizer": None, "model_init": llama}
    args = trainfold.TrainingArguments(output_dir=str(tmp_path), max_steps=1, save_strategy="no", disable_tqdm=True)
    for call in (trainfold.train, trainfold.evaluate):
        with pytest.raises(TypeError, match=rf"{call.__name__}\(\) takes no {keyword}= .*{re.escape(fix)}"):
            call(model, args, ROWS, **{keyword: value[keyword]})


def test_include_for_metrics_inputs_gives_compute_metrics_hfs_inputs(tmp_path):
    # was refused by name though the evaluation underneath gathers inputs; 'loss' (HF: the batch mean per sample)
    # stays refused by name
    seen = []

    def metrics(p):
        seen.append(p.inputs)
        return {"tokens": float((p.inputs > 0).sum())}

    rows = [{"input_ids": r["input_ids"][: 3 + i % 5], "labels": r["labels"][: 3 + i % 5]} for i, r in enumerate(ROWS)]
    args = hf_args(tmp_path, per_device_eval_batch_size=3, include_for_metrics=["inputs"])
    ours = trainfold.TrainingArguments.from_hf(args)
    pad = trainfold.pad_collate()  # right-pads input_ids with 0, labels with -100: a collator for both
    model = llama()
    trainer = transformers.Trainer(model=model, args=args, data_collator=pad, compute_metrics=metrics)
    theirs = trainer.evaluate(ListDataset(rows))
    mine = trainfold.evaluate(model, ours, rows, data_collator=pad, compute_metrics=metrics)
    assert mine["eval_tokens"] == theirs["eval_tokens"] > 0
    assert seen[0].shape == seen[1].shape and (seen[0] == seen[1]).all()  # padded with -100 across batches, as HF
    with pytest.raises(ValueError, match="include_for_metrics has 'loss'.*batch's mean loss"):
        trainfold.TrainingArguments(include_for_metrics=["loss"])


def test_a_seq2seq_model_trains_as_hf_with_decoder_inputs_in_the_batches_and_cross_entropy(tmp_path):
    # the refusal of a default loss names the fix; with it, T5 (relative_attention_bias not decayed) trains as HF
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, dropout_rate=0.0)
    cfg.decoder_start_token_id, cfg.pad_token_id = 0, 0
    model = transformers.T5ForConditionalGeneration(cfg)
    rows = []
    for i in range(4):
        labels = [1 + (2 * i + j) % 30 for j in range(4)]
        shifted = model._shift_right(torch.tensor([labels]))[0].tolist()  # what DataCollatorForSeq2Seq(model=) adds
        rows.append({"input_ids": ROWS[i]["input_ids"][:6], "labels": labels, "decoder_input_ids": shifted})
    settings = dict(max_steps=2, per_device_train_batch_size=2, logging_steps=1, weight_decay=0.1, learning_rate=1e-2)
    args = trainfold.TrainingArguments.from_hf(hf_args(tmp_path / "tf", **settings))
    with pytest.raises(TypeError, match="put decoder_input_ids in the batches"):
        trainfold.train(copy.deepcopy(model), args, rows)
    theirs = copy.deepcopy(model)
    transformers.Trainer(
        model=theirs, args=hf_args(tmp_path / "hf", **settings), train_dataset=ListDataset(rows)
    ).train()
    trainfold.train(model, args, rows, compute_loss_func=trainfold.core.losses.cross_entropy)
    for name, p in theirs.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


@pytest.mark.parametrize("resume", ["bogus", True], ids=["a-path", "true"])
def test_a_resume_that_finds_no_checkpoint_raises_the_trainers_error_and_words(tmp_path, resume):
    args = hf_args(tmp_path / "out", max_steps=1, per_device_train_batch_size=2)
    given = str(tmp_path / "checkpoint-5-bogus") if resume == "bogus" else True
    trainer = transformers.Trainer(model=llama(), args=args, train_dataset=ListDataset(ROWS))
    with pytest.raises(Exception) as theirs:
        trainer.train(resume_from_checkpoint=given)
    with pytest.raises(Exception) as ours:
        trainfold.train(llama(), trainfold.TrainingArguments.from_hf(args), ROWS, resume_from_checkpoint=given)
    assert isinstance(ours.value, type(theirs.value)) and isinstance(ours.value, FileNotFoundError)
    words = str(theirs.value).split(str(given) if resume == "bogus" else str(tmp_path))[0]  # up to the path
    assert str(ours.value).startswith(words), (str(ours.value), str(theirs.value))
