"""``trainfold.dpo.train``: TRL 1.16 ``DPOConfig``'s settings, ``DPOTrainer``'s tokenization and per-step losses.

The references are real TRL runs on a tiny Llama built from a config and a word-level tokenizer
built here; TRL gets an explicit copy of the initial policy as ``ref_model`` (its ``ref_model=None``
reloads the model from a path), trainfold its default: the model as it is before training.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_chat import llama, word_tokenizer

import trainfold
from trainfold.dpo.args import DPOArguments
from trainfold.dpo.data import preference_row, preference_rows

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}assistant: {{ m['content'] }} </s> "
    "{% else %}user: {{ m['content'] }} {% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def tokenizer():
    return word_tokenizer(TEMPLATE)


def words(g, lo, hi):
    return " ".join(
        f"w{int(i)}" for i in torch.randint(0, 59, (int(torch.randint(lo, hi, (), generator=g)),), generator=g)
    )


def text_rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"prompt": words(g, 1, 5), "chosen": " " + words(g, 1, 5), "rejected": " " + words(g, 1, 5)} for _ in range(n)
    ]


def chat_rows(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    say = lambda role: [{"role": role, "content": words(g, 1, 4)}]
    return [{"prompt": say("user"), "chosen": say("assistant"), "rejected": say("assistant")} for _ in range(n)]


COMMON = dict(bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no")
RUN = dict(
    max_steps=4,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    logging_steps=1,
    seed=3,
    beta=0.2,
    disable_tqdm=True,
)


def trl_trainer(tmp_path, rows, **kw):
    policy = llama()
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **{**COMMON, **kw})
    return trl.DPOTrainer(
        model=policy,
        ref_model=copy.deepcopy(policy),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(),
    )


def test_dpo_arguments_take_dpo_configs_names_and_defaults():
    theirs = trl.DPOConfig(output_dir="x", use_cpu=True)
    ours = DPOArguments(output_dir="x")
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for name in [f.name for f in dataclasses.fields(trl.DPOConfig) if f.name not in base]:
        value = getattr(theirs, name)
        assert getattr(ours, name) == (tuple(value) if isinstance(value, list) else value), name
    for name in ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16"):
        assert getattr(ours, name) == getattr(theirs, name), name
    with pytest.raises(ValueError, match="(?s)ld_alpha=0.5 is not supported.*'kto'"):
        DPOArguments(ld_alpha=0.5, loss_type="kto", bf16=False)


@pytest.mark.parametrize("rows", [text_rows(5), chat_rows(5)], ids=["text", "chat"])
def test_rows_are_tokenized_as_trl_tokenizes_them(tmp_path, rows):
    theirs = trl_trainer(tmp_path, rows).train_dataset
    ours = preference_rows(rows, tokenizer())
    assert ours == [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in theirs]


def implicit(rows):
    """``rows`` with the prompt inside chosen and rejected, as TRL's implicit-prompt datasets hold them."""
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]


@pytest.mark.parametrize("rows", [implicit(text_rows(6)), implicit(chat_rows(6))], ids=["text", "chat"])
def test_an_implicit_prompt_is_extracted_as_trl_extracts_it(tmp_path, rows):
    theirs = trl_trainer(tmp_path, rows).train_dataset
    ours = preference_rows(rows, tokenizer())
    assert ours == [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in theirs]
    assert all(r["prompt_ids"] for r in ours)


def test_rows_without_chosen_or_rejected_are_refused_by_name():
    with pytest.raises(KeyError, match=r"lacks \['rejected'\]"):
        preference_row({"prompt": "a", "chosen": "b"}, tokenizer())


def losses(history):
    return [h["loss"] for h in history if "loss" in h and "train_loss" not in h]


@pytest.mark.parametrize(
    ("rows", "kw"),
    [
        (text_rows(16), {}),
        (chat_rows(16), {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.3]}),
        (text_rows(16), {"precompute_ref_log_probs": True}),
    ],
    ids=["text", "chat-mpo", "precomputed-reference"],
)
def test_per_step_losses_equal_a_trl_dpo_run(tmp_path, rows, kw):
    trainer = trl_trainer(tmp_path, rows, **RUN, **kw)
    trainer.train()
    theirs = losses(trainer.state.log_history)
    args = DPOArguments(output_dir=str(tmp_path / "tf"), **COMMON, **RUN, **kw)
    result = trainfold.dpo.train(llama(), args, datasets.Dataset.from_list(rows), processing_class=tokenizer())
    ours = losses(result.log_history)
    assert len(ours) == len(theirs) == RUN["max_steps"]
    if "loss_type" not in kw:  # the first step's reference is the policy itself: every pair's loss is ln 2
        assert ours[0] == pytest.approx(0.6931472, rel=1e-6)
    assert ours == pytest.approx(theirs, rel=1e-5)


# -- padding-free DPO ---------------------------------------------------------------------------


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["sdpa", "eager"]))
def test_a_padding_free_dpo_step_equals_the_padded_step(seed, attn):
    from trainfold import init_state, make_step, sgd
    from trainfold.dpo.data import padding_free_preference_collate
    from trainfold.dpo.objective import dpo_objective, preference_collate

    items = preference_rows(text_rows(4, seed), tokenizer())
    model = llama()
    model.config._attn_implementation = attn
    ref = {k: v.detach() + 0.01 for k, v in model.named_parameters()}  # a reference other than the policy
    obj = dpo_objective(0.3, ["sigmoid", "sft"], ref_params=ref)
    opt = sgd(1.0)
    step = make_step(model, optimizer=opt, objective=obj, count_items=obj.count_items)
    padded = step(init_state(model, opt), [preference_collate(None)(items)])
    flat = step(init_state(model, opt), [padding_free_preference_collate()(items)])
    torch.testing.assert_close(padded.metrics["loss"], flat.metrics["loss"], rtol=1e-5, atol=1e-6)
    for k in padded.params:  # SGD(lr=1): the update is the gradient
        torch.testing.assert_close(padded.params[k], flat.params[k], rtol=1e-5, atol=1e-5)


def test_a_padding_free_run_has_the_padded_runs_losses(tmp_path):
    rows = datasets.Dataset.from_list(text_rows(8))
    runs = []
    for free in (False, True):
        args = DPOArguments(output_dir=str(tmp_path / str(free)), padding_free=free, **COMMON, **RUN)
        runs.append(losses(trainfold.dpo.train(llama(), args, rows, processing_class=tokenizer()).log_history))
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)


@pytest.mark.parametrize("collator", [True, False], ids=["with-collator", "without"])
def test_padding_free_by_hand_on_preference_rows_is_refused_naming_dpos_own_padding_free(tmp_path, collator):
    """``trainfold.train`` with ``padding_free=True`` on DPO's rows: "drop data_collator" would not help, the refusal
    names DPO's own padding-free collator and run."""
    from trainfold.dpo.objective import dpo_objective, preference_collate

    items, model = preference_rows(text_rows(4), tokenizer()), llama()
    args = trainfold.TrainingArguments(output_dir=str(tmp_path), max_steps=1, padding_free=True, report_to="none")
    objective = dpo_objective(0.1, ["sigmoid"], ref_params={k: v.detach().clone() for k, v in model.named_parameters()})
    collate = preference_collate(None) if collator else None
    with pytest.raises(ValueError, match=r"not DPO's preference rows.*trainfold\.dpo\.train.*padding_free_preference_"):
        trainfold.train(model, args, items, data_collator=collate, objective=objective)


def test_peft_config_draws_trls_adapter_and_trains_as_trl(tmp_path):
    """TRL seeds with ``args.seed`` before ``get_peft_model``: the same adapter, the same steps, the global RNG kept."""
    peft = pytest.importorskip("peft")
    config = lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8, lora_dropout=0.0)
    rows, kw = text_rows(8), dict(**COMMON, **{**RUN, "max_steps": 2, "gradient_accumulation_steps": 1})
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, disable_dropout=False, **kw)
    data = datasets.Dataset.from_list(rows)
    trainer = trl.DPOTrainer(
        model=llama(), args=args, train_dataset=data, processing_class=tokenizer(), peft_config=config()
    )
    adapter = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    trainer.train()
    model = llama()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    ours = trainfold.dpo.train(
        model,
        DPOArguments(output_dir=str(tmp_path / "tf"), disable_dropout=False, **kw).replace(learning_rate=0.0),
        data,
        processing_class=tokenizer(),
        peft_config=config(),
    )
    after = torch.random.get_rng_state()
    torch.random.set_rng_state(before)
    torch.empty((), dtype=torch.int64).random_()  # the run's one epoch began with HF's loader draw (epoch_draw)
    assert torch.equal(after, torch.random.get_rng_state())  # the adapter drawn from the run's seed, not the caller's
    assert set(ours.state.params) == set(adapter)
    for k, v in adapter.items():  # learning rate 0: the adapter as drawn
        assert torch.equal(ours.state.params[k], v), k
    trained = trainfold.dpo.train(
        llama(),
        DPOArguments(output_dir=str(tmp_path / "tf2"), disable_dropout=False, **kw),
        data,
        processing_class=tokenizer(),
        peft_config=config(),
    )
    assert losses(trained.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)
    grad_norms = lambda h: [e["grad_norm"] for e in h if "grad_norm" in e]
    assert grad_norms(trained.log_history) == pytest.approx(grad_norms(trainer.state.log_history), rel=1e-4)


@pytest.mark.parametrize("logging_steps", [10, 2])
def test_the_end_of_training_entry_holds_the_metrics_trls_holds(tmp_path, logging_steps):
    """A window no step log was due for is in TRL's last entry (``log_history[-1]["rewards/margins"]``)."""
    kw = dict(**COMMON, **{**RUN, "max_steps": 2, "gradient_accumulation_steps": 1, "logging_steps": logging_steps})
    trainer = trl_trainer(tmp_path, text_rows(8), **kw)
    trainer.train()
    args = DPOArguments(output_dir=str(tmp_path / "tf"), **kw)
    ours = trainfold.dpo.train(llama(), args, datasets.Dataset.from_list(text_rows(8)), processing_class=tokenizer())
    theirs, last = trainer.state.log_history[-1], ours.log_history[-1]
    ignored = {"total_flos", "num_tokens", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
    assert set(last) - ignored == set(theirs) - ignored
    assert ("rewards/margins" in last) is (logging_steps == 10)
    for k in set(last) - ignored:
        assert last[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), k


def test_a_file_source_is_tokenized_at_its_position_and_trains_as_trl(tmp_path):
    """``dpo.train(train_dataset=trainfold.data.files(...))`` in file order: TRL's losses on the same rows streamed."""
    import pyarrow.parquet as pq

    rows = text_rows(12)
    pq.write_table(datasets.Dataset.from_list(rows).data.table, tmp_path / "pairs.parquet", row_group_size=5)
    kw = dict(**COMMON, **{**RUN, "max_steps": 3, "gradient_accumulation_steps": 1})
    policy = llama()
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=copy.deepcopy(policy),
        args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **kw),
        train_dataset=datasets.Dataset.from_list(rows).to_iterable_dataset(),
        processing_class=tokenizer(),
    )
    trainer.train()
    source = trainfold.data.files(str(tmp_path / "pairs.parquet"), shuffle=False)
    ours = trainfold.dpo.train(llama(), DPOArguments(output_dir=str(tmp_path / "tf"), **kw), source,
                               processing_class=tokenizer())  # fmt: skip
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)


def test_a_streamed_dataset_is_tokenized_as_read_and_trains_as_trl(tmp_path):
    stream = lambda: datasets.Dataset.from_list(text_rows(12)).to_iterable_dataset()
    kw = dict(**COMMON, **{**RUN, "max_steps": 3, "gradient_accumulation_steps": 1})
    policy = llama()
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=copy.deepcopy(policy),
        args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **kw),
        train_dataset=stream(),
        processing_class=tokenizer(),
    )
    trainer.train()
    ours = trainfold.dpo.train(llama(), DPOArguments(output_dir=str(tmp_path / "tf"), **kw), stream(),
                               processing_class=tokenizer())  # fmt: skip
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)
