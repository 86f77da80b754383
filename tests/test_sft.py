"""SFT as TRL 1.16's ``SFTTrainer``: its settings, its data preparation and collator, its per-step losses.

Every reference is a real TRL ``SFTConfig``/``SFTTrainer`` on a tiny Llama built from a config and a
word-level tokenizer built here (nothing downloaded).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_chat import llama, word_tokenizer

from trainfold.sft import run as sft
from trainfold.sft.args import SFTArguments
from trainfold.sft.data import sft_collate, sft_row, sft_rows

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

# A chat template whose assistant turns, with their end-of-turn token, are {% generation %} blocks.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}assistant: {% generation %}{{ m['content'] }} </s>"
    "{% endgeneration %} {% else %}user: {{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def tokenizer(template: str | None = TEMPLATE):
    return word_tokenizer(template)


def words(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi, (), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 59, (n,), generator=g))


def prompt_completion_rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": words(g, 1, 6), "completion": " " + words(g, 1, 6)} for _ in range(n)]


def chat_rows(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    turns = lambda: [
        {"role": "user", "content": words(g, 1, 4)},
        {"role": "assistant", "content": words(g, 1, 4)},
    ]
    return [{"messages": turns() + (turns() if i % 2 else [])} for i in range(n)]


def text_rows(n: int, seed: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"text": words(g, 2, 9)} for _ in range(n)]


COMMON = dict(bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no")


def trl_trainer(tmp_path, rows, **kw):
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **{**COMMON, **kw})
    return trl.SFTTrainer(
        model=llama(), args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer()
    )


def trl_prepared(tmp_path, rows, **kw):
    data = trl_trainer(tmp_path, rows, **kw).train_dataset
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in data]


# -- settings -------------------------------------------------------------------------------


def test_sft_arguments_take_sft_configs_names_and_defaults():
    theirs = trl.SFTConfig(output_dir="x", use_cpu=True)
    ours = SFTArguments(output_dir="x")
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    own = [f.name for f in dataclasses.fields(trl.SFTConfig) if f.name not in base]
    for name in [*own, "learning_rate", "logging_steps", "gradient_checkpointing", "bf16"]:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert SFTArguments(fp16=True, gradient_checkpointing=False).bf16 is False


def test_settings_trainfold_cannot_honour_are_refused_by_name():
    with pytest.raises(ValueError, match="loss_type='dft' is not supported"):
        SFTArguments(loss_type="dft", bf16=False)
    with pytest.raises(ValueError, match="padding_free=True without packing does not enforce max_length"):
        SFTArguments(padding_free=True, bf16=False)
    SFTArguments(padding_free=True, max_length=None, bf16=False)  # TRL takes this too
    with pytest.raises(ValueError, match="truncation_mode='middle'"):
        SFTArguments(truncation_mode="middle", bf16=False)


# -- data preparation, as TRL's ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "kw"),
    [
        (text_rows(6), {}),
        (text_rows(6), {"max_length": 5}),
        (prompt_completion_rows(6), {}),
        (prompt_completion_rows(6), {"completion_only_loss": False}),
        (prompt_completion_rows(6), {"max_length": 4}),
        (chat_rows(6), {}),
        (chat_rows(6), {"assistant_only_loss": True}),
        (chat_rows(6), {"assistant_only_loss": True, "max_length": 7, "truncation_mode": "keep_end"}),
        ([{"input_ids": [5, 6, 7, 2]}, {"input_ids": [8, 9]}], {}),
        ([{"input_ids": [5, 6, 7, 2], "labels": [-100, 6, 7, 2]}, {"input_ids": [8, 9], "labels": [-100, 9]}], {}),
    ],
)
def test_rows_are_prepared_as_trl_prepares_them(tmp_path, rows, kw):
    ours = sft_rows(rows, tokenizer(), **kw)
    assert ours == trl_prepared(tmp_path, rows, **kw)


def test_assistant_only_loss_without_generation_blocks_is_refused_by_name():
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    with pytest.raises(ValueError, match=r"no \{% generation %\}"):
        sft_row(chat_rows(1)[0], tokenizer(plain), assistant_only_loss=True)
    with pytest.raises(ValueError, match="needs conversational rows"):
        sft_row(text_rows(1)[0], tokenizer(), assistant_only_loss=True)


def test_the_collator_gives_trls_keys_and_values():
    rows = sft_rows(prompt_completion_rows(3), tokenizer())
    theirs = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=4)(rows)
    ours = sft_collate(0, pad_to_multiple_of=4)(rows)
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].tolist() == theirs[k].tolist(), k


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(3, 20), st.booleans())
def test_the_stop_token_is_supervised_and_no_prompt_token_is(seed, max_length, chat):
    tok = tokenizer()
    if chat:
        row = chat_rows(1, seed)[0]
        done = sft_rows([row], tok, max_length=max_length, assistant_only_loss=True)
        prompt_words = {w for m in row["messages"] if m["role"] == "user" for w in m["content"].split()}
        answer_words = {w for m in row["messages"] if m["role"] == "assistant" for w in m["content"].split()}
    else:
        row = prompt_completion_rows(1, seed)[0]
        done = sft_rows([row], tok, max_length=max_length)
        prompt_words, answer_words = set(row["prompt"].split()), set(row["completion"].split())
    full = sft_rows([row], tok, max_length=None, assistant_only_loss=chat)[0]
    assert full["labels"][-1] == full["input_ids"][-1] == tok.eos_token_id  # the stop token is supervised
    for d in done:  # truncated: whatever is kept is the untruncated row's start, labels unchanged
        assert d["labels"] == full["labels"][: len(d["labels"])]
        assert d["input_ids"] == full["input_ids"][: len(d["input_ids"])]
    supervised = {tok.convert_ids_to_tokens(t) for t in full["labels"] if t != -100}
    assert not (supervised - answer_words - {"</s>"}), "a prompt or template token is supervised"
    assert prompt_words.isdisjoint(supervised - answer_words)


# -- a run, step by step as TRL's -------------------------------------------------------------


RUN = dict(
    max_steps=4,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    warmup_steps=2,
    logging_steps=1,
    seed=5,
    disable_tqdm=True,
)


def losses(log_history):
    return [h["loss"] for h in log_history if "loss" in h and "train_loss" not in h]


@pytest.mark.parametrize(
    ("rows", "kw"),
    [(prompt_completion_rows(24), {}), (chat_rows(24), {"assistant_only_loss": True})],
    ids=["prompt-completion", "chat-assistant-only"],
)
def test_per_step_losses_equal_a_trl_sft_run(tmp_path, rows, kw):
    trainer = trl_trainer(tmp_path, rows, **RUN, **kw)
    trainer.train()
    theirs = losses(trainer.state.log_history)
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, **RUN, **kw)
    ours = losses(sft.train(llama(), args, datasets.Dataset.from_list(rows), processing_class=tokenizer()).log_history)
    assert len(ours) == len(theirs) == RUN["max_steps"]
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_a_model_name_is_loaded_with_model_init_kwargs(tmp_path):
    path = tmp_path / "tiny"
    llama().save_pretrained(path)
    args = SFTArguments(
        output_dir=str(tmp_path / "run"), max_steps=1, model_init_kwargs={"dtype": torch.float32}, **COMMON
    )
    result = sft.train(str(path), args, prompt_completion_rows(4), processing_class=tokenizer())
    assert result.global_step == 1
    with pytest.raises(ValueError, match="model_init_kwargs apply when the model is a name or path"):
        sft.train(copy.deepcopy(llama()), args, prompt_completion_rows(4), processing_class=tokenizer())


# -- packing ----------------------------------------------------------------------------------


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_a_packed_sft_step_equals_the_padded_step_on_the_same_rows(seed, chat):
    from trainfold import init_state, make_step, sgd
    from trainfold.core.losses import causal_lm
    from trainfold.data.packing import pack, packed_collate

    rows = chat_rows(4, seed) if chat else prompt_completion_rows(4, seed)
    prepared = sft_rows(rows, tokenizer(), assistant_only_loss=chat, packing=True)
    model = llama()
    opt = sgd(1.0)
    step = make_step(model, causal_lm, opt)
    padded = step(init_state(model, opt), [sft_collate(0)(prepared)])
    packed = step(init_state(model, opt), [packed_collate()(pack(prepared, max_length=48))])
    assert int(padded.metrics["num_items"]) == int(packed.metrics["num_items"])
    torch.testing.assert_close(padded.metrics["loss"], packed.metrics["loss"], rtol=1e-5, atol=1e-6)
    for k in padded.params:  # SGD(lr=1): the update is the gradient
        torch.testing.assert_close(padded.params[k], packed.params[k], rtol=1e-5, atol=1e-5)


def test_a_packed_run_trains_and_evaluates_packed_rows(tmp_path):
    rows = prompt_completion_rows(12)
    args = SFTArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        packing=True,
        max_length=32,
        eval_strategy="steps",
        eval_steps=2,
        per_device_train_batch_size=2,
        **COMMON,
    )
    result = sft.train(llama(), args, rows, eval_dataset=rows[:4], processing_class=tokenizer())
    assert result.global_step == 2
    assert any("eval_loss" in h for h in result.log_history)


def test_peft_config_trains_only_the_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    model = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = SFTArguments(output_dir=str(tmp_path), max_steps=2, learning_rate=1e-2, **COMMON)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_alpha=4)
    result = sft.train(model, args, prompt_completion_rows(8), processing_class=tokenizer(), peft_config=config)
    trained = set(result.state.params)
    assert trained and all("lora_" in k for k in trained)
    for k, v in model.state_dict().items():  # the base weights are untouched
        if k in before:
            assert torch.equal(v, before[k]), k


def test_peft_config_draws_trls_adapter_and_trains_as_trl(tmp_path):
    """TRL seeds with ``args.seed`` before ``get_peft_model``: the same adapter, hence the same per-step losses."""
    peft = pytest.importorskip("peft")
    config = lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8, lora_dropout=0.0)
    rows, kw = prompt_completion_rows(8), {**RUN, "max_steps": 2, "learning_rate": 5e-2}
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **COMMON, **kw)
    data = datasets.Dataset.from_list(rows)
    trainer = trl.SFTTrainer(
        model=llama(), args=args, train_dataset=data, processing_class=tokenizer(), peft_config=config()
    )
    trainer.train()
    ours = sft.train(
        llama(),
        SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, **kw),
        data,
        processing_class=tokenizer(),
        peft_config=config(),
    )
    grad_norms = lambda h: [e["grad_norm"] for e in h if "grad_norm" in e]
    assert grad_norms(ours.log_history) == pytest.approx(grad_norms(trainer.state.log_history), rel=1e-4)
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)


@pytest.mark.parametrize("packing", [False, True])
def test_entropy_and_token_accuracy_are_logged_as_trls(tmp_path, packing):
    """TRL's SFT metrics, per step (one micro-batch each) and in the end-of-training entry, as TRL's tests read them."""
    kw = {**RUN, "gradient_accumulation_steps": 1, "learning_rate": 0.1, "warmup_steps": 0, "max_steps": 4}
    kw |= {"packing": True, "max_length": 16} if packing else {}
    rows = prompt_completion_rows(2) * 8  # learnt within a few steps: the accuracy leaves 0
    trainer = trl_trainer(tmp_path, rows, **kw)
    trainer.train()
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, **kw)
    ours = sft.train(llama(), args, rows, processing_class=tokenizer()).log_history
    steps = lambda h, k: [e[k] for e in h if "loss" in e and "train_loss" not in e]
    for k in ("entropy", "mean_token_accuracy"):
        assert steps(ours, k) == pytest.approx(steps(trainer.state.log_history, k), rel=1e-5, abs=1e-6), k
    assert max(steps(ours, "mean_token_accuracy")) > 0  # the accuracy is not trivially 0 here
    args = args.replace(logging_steps=10, output_dir=str(tmp_path / "end"))  # TRL's tests: no step log is due
    end = sft.train(llama(), args, rows, processing_class=tokenizer()).log_history[-1]
    assert end["train_loss"] is not None and end["mean_token_accuracy"] is not None and end["entropy"] > 0


def test_evaluation_logs_trls_entropy_and_token_accuracy(tmp_path):
    """One eval batch: TRL's batch means are the token means trainfold takes over the eval set."""
    rows = prompt_completion_rows(2) * 8
    kw = {**RUN, "gradient_accumulation_steps": 1, "learning_rate": 0.1, "warmup_steps": 0, "max_steps": 2}
    kw |= {"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 8}
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **COMMON, **kw)
    data = datasets.Dataset.from_list(rows)
    trainer = trl.SFTTrainer(model=llama(), args=args, train_dataset=data, eval_dataset=data.select(range(4)),
                             processing_class=tokenizer())  # fmt: skip
    trainer.train()
    theirs = next(e for e in trainer.state.log_history if "eval_loss" in e)
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, **kw)
    history = sft.train(
        llama(), args, data, eval_dataset=data.select(range(4)), processing_class=tokenizer()
    ).log_history
    ours = next(e for e in history if "eval_loss" in e)
    assert ours["eval_mean_token_accuracy"] > 0
    for k in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert ours[k] == pytest.approx(theirs[k], rel=1e-5), k


def test_a_streamed_dataset_is_prepared_as_read_and_trains_as_trl(tmp_path):
    """A ``datasets.IterableDataset`` (no length) trains in its order, rows prepared as they are read, as TRL's."""
    stream = lambda: datasets.Dataset.from_list(prompt_completion_rows(12)).to_iterable_dataset()
    kw = {**RUN, "max_steps": 3, "gradient_accumulation_steps": 1}
    trainer = trl.SFTTrainer(
        model=llama(),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **COMMON, **kw),
        train_dataset=stream(),
        processing_class=tokenizer(),
    )
    trainer.train()
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, **kw)
    ours = sft.train(llama(), args, stream(), processing_class=tokenizer())
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)


def test_a_file_source_trains_as_trl_on_the_same_rows_streamed_in_file_order(tmp_path):
    """``sft.train(train_dataset=trainfold.data.files(...))``: rows prepared at their position, as TRL's stream."""
    import pyarrow.parquet as pq

    from trainfold.data import files

    rows = prompt_completion_rows(12)
    pq.write_table(datasets.Dataset.from_list(rows).data.table, tmp_path / "rows.parquet", row_group_size=5)
    kw = {**RUN, "max_steps": 3, "gradient_accumulation_steps": 1}
    trainer = trl.SFTTrainer(
        model=llama(),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **COMMON, **kw),
        train_dataset=datasets.Dataset.from_list(rows).to_iterable_dataset(),
        processing_class=tokenizer(),
    )
    trainer.train()
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, **kw)
    source = files(str(tmp_path / "rows.parquet"), shuffle=False)
    ours = sft.train(llama(), args, source, processing_class=tokenizer())
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)
    assert ours.state.cursor.streams[0, 0].item() == 3 * args.per_device_train_batch_size


def test_a_datasets_stream_of_parquet_files_is_read_by_a_file_source_and_trains_as_trl(tmp_path):
    """``load_dataset("parquet", streaming=True)``: TRL reads it with datasets; sft.train reads its files with
    ``files()`` (the same rows in the same order), so its cursor holds the row position a resume seeks to."""
    import pyarrow.parquet as pq

    rows = prompt_completion_rows(12)
    pq.write_table(datasets.Dataset.from_list(rows).data.table, tmp_path / "rows.parquet", row_group_size=5)
    stream = lambda: datasets.load_dataset(
        "parquet", data_files=str(tmp_path / "rows.parquet"), split="train", streaming=True
    )
    kw = {**RUN, "max_steps": 3, "gradient_accumulation_steps": 1}
    trainer = trl.SFTTrainer(
        model=llama(),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **COMMON, **kw),
        train_dataset=stream(),
        processing_class=tokenizer(),
    )
    trainer.train()
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, **kw)
    ours = sft.train(llama(), args, stream(), processing_class=tokenizer())
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)
    assert ours.state.cursor.streams[0, 0].item() == 3 * args.per_device_train_batch_size


def test_a_formatting_func_makes_the_text_as_trls(tmp_path):
    rows = [{"q": r["prompt"], "a": r["completion"]} for r in prompt_completion_rows(12)]
    fmt = lambda row: "user: " + row["q"] + " assistant:" + row["a"]
    kw = {**RUN, "max_steps": 3, "gradient_accumulation_steps": 1}
    trainer = trl.SFTTrainer(
        model=llama(),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **COMMON, **kw),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(),
        formatting_func=fmt,
    )
    trainer.train()
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, **kw)
    ours = sft.train(llama(), args, datasets.Dataset.from_list(rows), processing_class=tokenizer(), formatting_func=fmt)
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)
    with pytest.raises(ValueError, match="formatting_func turns the rows into text"):
        sft.train(
            llama(), args.replace(completion_only_loss=True), rows, processing_class=tokenizer(), formatting_func=fmt
        )


def test_a_formatting_func_with_prompt_completion_rows_is_refused_where_trl_refuses_or_ignores_it(tmp_path):
    rows = prompt_completion_rows(4)
    fmt = lambda row: "user: " + row["prompt"] + " assistant:" + row["completion"]
    args = SFTArguments(output_dir=str(tmp_path / "tf"), **COMMON, max_steps=1)
    config = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **COMMON)
    data = datasets.Dataset.from_list(rows)
    with pytest.raises(ValueError, match="formatting function was provided while `completion_only_loss=True`"):
        trl.SFTTrainer(model=llama(), args=config, train_dataset=data, processing_class=tokenizer(),
                       formatting_func=fmt)  # fmt: skip
    with pytest.raises(ValueError, match="completion_only_loss=True`, which is incompatible"):
        sft.train(llama(), args, rows, processing_class=tokenizer(), formatting_func=fmt)
    # completion_only_loss=False: TRL tokenizes prompt + completion (its EOS goes to the unused text) and drops
    # the formatted text silently
    off = dataclasses.replace(config, completion_only_loss=False)
    with_fmt = trl.SFTTrainer(
        model=llama(), args=off, train_dataset=data, processing_class=tokenizer(), formatting_func=fmt
    ).train_dataset
    without = trl.SFTTrainer(model=llama(), args=off, train_dataset=data, processing_class=tokenizer()).train_dataset
    assert list(with_fmt["input_ids"]) == [r[:-1] for r in without["input_ids"]]
    with pytest.raises(ValueError, match="formatting_func would be ignored"):
        sft.train(
            llama(), args.replace(completion_only_loss=False), rows, processing_class=tokenizer(), formatting_func=fmt
        )


@pytest.mark.parametrize("mask", ["assistant_masks", "completion_mask"])
def test_skip_prepare_dataset_with_mask_columns_and_no_labels_is_refused_as_trl_refuses_it(tmp_path, mask):
    rows = [{"input_ids": [5, 6, 7, 2], mask: [0, 0, 1, 1]}] * 4
    skip = {"skip_prepare_dataset": True}
    config = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, dataset_kwargs=skip, **COMMON)
    with pytest.raises(ValueError, match="has mask columns but no 'labels'"):
        trl.SFTTrainer(
            model=llama(), args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer()
        )
    args = SFTArguments(output_dir=str(tmp_path / "tf"), dataset_kwargs=skip, max_steps=1, **COMMON)
    for data in (rows, datasets.Dataset.from_list(rows)):
        with pytest.raises(ValueError, match=rf"train dataset has mask columns \['{mask}'\] but no 'labels'"):
            sft.train(llama(), args, data, processing_class=tokenizer())
    with pytest.raises(ValueError, match="eval dataset has mask columns"):
        sft.train(llama(), args, [{"input_ids": [5, 6]}] * 4, rows, processing_class=tokenizer())
    labelled = [{**r, "labels": [-100, -100, 7, 2]} for r in rows]  # labels given: trained as given
    assert sft.train(llama(), args, labelled, processing_class=tokenizer()).global_step == 1


def test_train_with_max_length_and_no_packing_truncates_the_rows_as_trl(tmp_path):
    """``trainfold.train`` with ``TrainingArguments.from_hf(SFTConfig(max_length=6))``: rows cut to 6 tokens and rows
    left with no label dropped, train and eval, as ``SFTTrainer`` prepares them (one eval batch: TRL's eval_loss is
    a mean of batch means, trainfold's the token mean)."""
    import trainfold

    g = torch.Generator().manual_seed(4)
    rows = []
    for _ in range(16):
        n, k = int(torch.randint(4, 14, (), generator=g)), int(torch.randint(1, 9, (), generator=g))
        ids = torch.randint(3, 60, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * min(k, n - 1) + ids[min(k, n - 1) :]})
    kw = {**RUN, "max_length": 6, "eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 8}
    config = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **COMMON, **kw)
    trainer = trl.SFTTrainer(
        model=llama(), args=config, train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(rows[:8]), processing_class=tokenizer(),
    )  # fmt: skip
    assert len(trainer.train_dataset) < len(rows)  # some rows were left with no label
    trainer.train()
    args = trainfold.TrainingArguments.from_hf(dataclasses.replace(config, output_dir=str(tmp_path / "tf")))
    ours = trainfold.train(llama(), args, rows, rows[:8], processing_class=tokenizer()).log_history
    assert losses(ours) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)
    evals = lambda h: [e["eval_loss"] for e in h if "eval_loss" in e]
    assert evals(ours) == pytest.approx(evals(trainer.state.log_history), rel=1e-5) and len(evals(ours)) == 2
