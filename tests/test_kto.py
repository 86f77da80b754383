"""``trainfold.kto``: TRL 1.16 ``KTOTrainer``'s tokenization, loss, metrics and per-step losses.

The references are real TRL runs on a tiny Llama built from a config and a word-level tokenizer built
here; TRL gets an explicit copy of the initial policy as ``ref_model`` (its ``ref_model=None`` reloads
the model from a path), trainfold its default: the model as it is before training.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_chat import llama, word_tokenizer

import trainfold
from trainfold import kto
from trainfold.core.generate import functional_forward
from trainfold.kto import KTOArguments, kl_estimate, kto_loss, unpaired_rows

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
        {"prompt": words(g, 1, 5), "completion": " " + words(g, 1, 5), "label": i % 3 != 0}  # each block of 3: both
        for i in range(n)
    ]


def paired_chat_rows(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    say = lambda role: [{"role": role, "content": words(g, 1, 4)}]
    return [{"prompt": say("user"), "chosen": say("assistant"), "rejected": say("assistant")} for _ in range(n)]


COMMON = dict(bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no")
RUN = dict(
    max_steps=4,
    per_device_train_batch_size=3,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    logging_steps=1,
    seed=3,
    beta=0.2,
    disable_tqdm=True,
)


def trl_trainer(tmp_path, rows, eval_rows=None, **kw):
    policy = llama()
    args = trl.KTOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **{**COMMON, **kw})
    return trl.KTOTrainer(
        model=policy,
        ref_model=copy.deepcopy(policy),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=None if eval_rows is None else datasets.Dataset.from_list(eval_rows),
        processing_class=tokenizer(),
    )


# -- the loss -------------------------------------------------------------------------------------


def test_kto_loss_equals_hand_computed_values():
    logps, ref = torch.tensor([-1.0, -4.0, -2.0]), torch.tensor([-2.0, -3.0, -2.0])
    label, beta = torch.tensor([True, False, False]), 0.5
    kl = kl_estimate(torch.tensor([-1.5, -2.5]), torch.tensor([-2.0, -2.5]))  # mean(0.5, 0) = 0.25
    assert kl.item() == 0.25
    assert kl_estimate(torch.tensor([-3.0]), torch.tensor([-2.0])).item() == 0.0  # clamped at 0
    s = lambda x: 1 / (1 + math.exp(-x))
    want = [2.0 * (1 - s(0.5 * (1 - 0.25))), 0.5 * (1 - s(0.5 * (0.25 + 1))), 0.5 * (1 - s(0.5 * 0.25))]
    got = kto_loss(logps, ref, label, kl, beta, "kto", desirable_weight=2.0, undesirable_weight=0.5)
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    apo = kto_loss(logps, ref, label, kl, beta, "apo_zero_unpaired")
    assert apo.tolist() == pytest.approx([1 - s(0.5), s(-0.5), s(0.0)], rel=1e-6)


def test_settings_trl_refuses_are_refused_by_name():
    with pytest.raises(ValueError, match="(?s)loss_type='sigmoid'.*desirable_weight=-1"):
        KTOArguments(loss_type="sigmoid", desirable_weight=-1.0, bf16=False)
    with pytest.raises(ValueError, match="train_sampling_strategy='sequential', got 'random'"):
        KTOArguments(train_sampling_strategy="random", bf16=False)
    with pytest.raises(ValueError, match="per_device_train_batch_size=1 leaves no mismatched pair"):
        KTOArguments(per_device_train_batch_size=1, bf16=False)
    with pytest.raises(ValueError, match="sync_ref_model=True is not supported"):
        KTOArguments(sync_ref_model=True, bf16=False)
    assert KTOArguments(loss_type="apo_zero_unpaired", per_device_train_batch_size=1, bf16=False).beta == 0.1


def test_kto_arguments_take_kto_configs_names_and_defaults():
    theirs = trl.KTOConfig(output_dir="x", use_cpu=True)
    ours = KTOArguments(output_dir="x")
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for name in [f.name for f in dataclasses.fields(trl.KTOConfig) if f.name not in base]:
        assert getattr(ours, name) == getattr(theirs, name), name
    for name in ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "train_sampling_strategy"):
        assert getattr(ours, name) == getattr(theirs, name), name
    config = trl.KTOConfig(output_dir="x", use_cpu=True, beta=0.3, loss_type="apo_zero_unpaired", undesirable_weight=2)
    converted = KTOArguments.from_hf(config)
    assert (converted.beta, converted.loss_type, converted.undesirable_weight) == (0.3, "apo_zero_unpaired", 2.0)


# -- rows -----------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(3, 60), min_size=1, max_size=3), min_size=1, max_size=11), st.integers(2, 5))
def test_kl_completions_are_the_blocks_completions_rotated_by_one(completions, size):
    rows = [{"prompt_ids": [1], "completion_ids": c, "label": True} for c in completions]
    out = kto.with_kl_completions(rows, size)
    assert [r["completion_ids"] for r in out] == completions and rows[0].keys() == {"prompt_ids", "completion_ids",
                                                                                      "label"}  # fmt: skip
    for start in range(0, len(rows), size):
        block = completions[start : start + size]
        assert [r["KL_completion_ids"] for r in out[start : start + size]] == [block[-1], *block[:-1]]


@pytest.mark.parametrize(
    ("rows", "max_length"),
    [(text_rows(7), 1024), (text_rows(9), 3), (paired_chat_rows(4), 1024)],
    ids=["unpaired-text", "long-prompts-dropped", "paired-chat"],
)
def test_rows_are_prepared_as_trl_prepares_them(tmp_path, rows, max_length):
    theirs = trl_trainer(tmp_path, rows, per_device_train_batch_size=3, max_length=max_length).train_dataset
    ours = unpaired_rows(rows, tokenizer(), max_length=max_length, kl_batch_size=3)
    keys = ("prompt_ids", "completion_ids", "label", "KL_completion_ids")
    assert ours == [{k: r[k] for k in keys} for r in theirs]
    assert len(ours) < len(rows) if max_length == 3 else len(ours) >= len(rows)


def test_objective_equals_trls_compute_loss_and_metrics(tmp_path):
    """One batch through ``KTOTrainer.compute_loss`` (its loss and ``_metrics``) and through ``kto_objective``."""
    trainer = trl_trainer(tmp_path, text_rows(6), per_device_train_batch_size=6, desirable_weight=1.5)
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    ref = copy.deepcopy(trainer.ref_model)  # TRL's ref model, perturbed so that the rewards are not 0
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    trainer.ref_model = ref
    theirs = trainer.compute_loss(trainer.model, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    obj = kto.kto_objective(0.1, ref_params=dict(ref.named_parameters()), desirable_weight=1.5)
    params = {k: v.detach() for k, v in trainer.model.named_parameters()}
    loss, aux = obj(functional_forward(trainer.model), params, batch, obj.count_items(batch))
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-5)
    counted = {k: v for k, v in aux.items() if not k.endswith("#micro_batches")}  # each value's count: 1 here
    assert set(counted) == set(metrics) - {"num_tokens"} and all(aux.get(f"{k}#micro_batches", 1) == 1 for k in counted)
    for k, v in counted.items():
        assert v.item() == pytest.approx(metrics[k], rel=1e-4, abs=1e-6), k


def test_prepare_takes_the_runs_typed_values_and_its_stored_reference_equals_the_reference_forward():
    """``prepare`` gets the device and batch sizes (not the arguments object): the rows it returns carry the
    reference log-probs, and the objective it returns scores them as the one with the reference params."""
    model, ref = llama(), llama()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    rows, collate = unpaired_rows(text_rows(6), tokenizer(), kl_batch_size=3), kto.unpaired_collate()
    obj = kto.kto_objective(0.1, ref_params=ref_params, precompute_ref_log_probs=True)
    prepared, train_rows, eval_rows = obj.prepare(
        model, rows, rows[:3], collate, device=torch.device("cpu"), train_batch_size=3, eval_batch_size=2
    )
    assert prepared.ref_params is None and "ref_logps" in train_rows[0] and "ref_logps" in eval_rows[0]
    params = {k: v.detach() for k, v in model.named_parameters()}
    stored = prepared(functional_forward(model), params, collate(train_rows), torch.tensor(6))[0]
    direct = obj(functional_forward(model), params, collate(rows), torch.tensor(6))[0]
    assert stored.item() == pytest.approx(direct.item(), rel=1e-5)


# -- runs -----------------------------------------------------------------------------------------


def step_entries(history):
    return [h for h in history if "loss" in h and "train_loss" not in h]


@pytest.mark.parametrize(
    ("rows", "kw"),
    [
        (text_rows(24), {}),
        (text_rows(24), {"gradient_accumulation_steps": 1, "logging_steps": 2, "max_steps": 8}),
        (paired_chat_rows(12), {"desirable_weight": 1.3, "undesirable_weight": 0.7}),
        (text_rows(24), {"loss_type": "apo_zero_unpaired"}),
        (text_rows(24), {"precompute_ref_log_probs": True}),
        (text_rows(24), {"max_length": 5, "pad_to_multiple_of": 4}),
    ],
    ids=[
        "text",
        "text-no-accumulation",
        "paired-chat-weights",
        "apo-zero-unpaired",
        "precomputed-reference",
        "truncated-padded",
    ],  # fmt: skip
)
def test_per_step_losses_equal_a_trl_kto_run(tmp_path, rows, kw):
    run = {**RUN, **kw}
    trainer = trl_trainer(tmp_path, rows, **run)
    trainer.train()
    theirs = step_entries(trainer.state.log_history)
    args = KTOArguments(output_dir=str(tmp_path / "tf"), **COMMON, **run)
    result = trainfold.kto.train(llama(), args, datasets.Dataset.from_list(rows), processing_class=tokenizer())
    ours = step_entries(result.log_history)
    assert len(ours) == len(theirs) == run["max_steps"] // run["logging_steps"]
    assert [h["loss"] for h in ours] == pytest.approx([h["loss"] for h in theirs], rel=1e-5)
    ignored = {"num_tokens", "step"}  # TRL's running token count is not logged; trainfold adds the step
    for mine, other in zip(ours, theirs, strict=True):
        # a micro-batch without desirable (undesirable) rows is left out of the chosen (rejected) metrics, as TRL's
        assert set(other) - ignored == set(mine) - ignored
        for k in set(other) - ignored:
            assert mine[k] == pytest.approx(other[k], rel=1e-4, abs=1e-6), k


def test_a_stopped_and_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    rows = datasets.Dataset.from_list(text_rows(24))
    kw = dict(**{**COMMON, **RUN, "save_strategy": "steps", "save_steps": 2})

    def run(out, **extra):
        args = KTOArguments(output_dir=str(tmp_path / out), **kw)
        return trainfold.kto.train(llama(), args, rows, processing_class=tokenizer(), **extra)

    whole = run("whole")
    stopped = run("parts", stop=lambda s: int(s.step) >= 2)
    assert stopped.status == "stopped" and stopped.global_step == 2
    resumed = run("parts", resume_from_checkpoint=True)
    assert resumed.global_step == whole.global_step == RUN["max_steps"]
    for k in whole.state.params:
        assert torch.equal(resumed.state.params[k], whole.state.params[k]), k
    losses = lambda r: [h["loss"] for h in step_entries(r.log_history)]
    assert losses(resumed) == losses(whole)


def test_evaluation_equals_trls_evaluate(tmp_path):
    """TRL's ``eval_loss`` (batch means weighted by rows) and eval metrics (unweighted means of batch values; the KL
    rows rotate in blocks of ``per_device_train_batch_size``, for the eval set too)."""
    rows, held_out = text_rows(12), text_rows(6, seed=7)
    kw = {**RUN, "max_steps": 2, "per_device_eval_batch_size": 3, "eval_strategy": "steps", "eval_steps": 2}
    trainer = trl_trainer(tmp_path, rows, held_out, **kw)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "eval_loss" in h][-1]
    args = KTOArguments(output_dir=str(tmp_path / "tf"), **COMMON, **kw)
    result = trainfold.kto.train(
        llama(), args, datasets.Dataset.from_list(rows), datasets.Dataset.from_list(held_out), tokenizer()
    )
    ours = [h for h in result.log_history if "eval_loss" in h][-1]
    timing = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_num_tokens", "step"}
    assert set(theirs) - timing == set(ours) - timing
    for k in set(theirs) - timing:
        assert ours[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), k


def test_inputs_kto_cannot_use_are_refused_by_name(tmp_path):
    obj = kto.kto_objective()
    rows = unpaired_rows(text_rows(2), tokenizer(), kl_batch_size=None)
    batch = kto.unpaired_collate()(rows)
    with pytest.raises(KeyError, match="needs the KL sequences"):
        obj(functional_forward(llama()), {}, batch, obj.count_items(batch))
    with pytest.raises(KeyError, match="needs 'label'"):
        obj.count_items({k: v for k, v in batch.items() if k != "label"})
    with pytest.raises(KeyError, match=r"lacks \['label'\]"):
        kto.unpaired_collate()([{"prompt_ids": [1], "completion_ids": [2]}])
    with pytest.raises(KeyError, match=r"unpaired row lacks \['label'\]"):
        kto.unpaired_row({"prompt": "w1", "completion": " w2"}, tokenizer())
    stream = datasets.Dataset.from_list(text_rows(4)).to_iterable_dataset()
    args = KTOArguments(output_dir=str(tmp_path), **COMMON, **RUN)
    with pytest.raises(TypeError, match="a streamed dataset is not supported"):
        trainfold.kto.train(llama(), args, stream, processing_class=tokenizer())


def test_a_peft_run_takes_the_model_without_its_adapter_as_reference_as_trl(tmp_path):
    """TRL's ``ref_model=None`` with ``peft_config``: the adapter disabled is the reference; trainfold's reference
    is the adapter as drawn (LoRA's B = 0: the same function)."""
    peft = pytest.importorskip("peft")
    config = lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8, lora_dropout=0.0)
    rows, kw = text_rows(12), dict(**COMMON, **{**RUN, "max_steps": 2, "gradient_accumulation_steps": 1})
    args = trl.KTOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **kw)
    data = datasets.Dataset.from_list(rows)
    trainer = trl.KTOTrainer(
        model=llama(), args=args, train_dataset=data, processing_class=tokenizer(), peft_config=config()
    )
    trainer.train()
    ours = trainfold.kto.train(
        llama(), KTOArguments(output_dir=str(tmp_path / "tf"), **kw), data, processing_class=tokenizer(),
        peft_config=config(),
    )  # fmt: skip
    losses = lambda h: [e["loss"] for e in step_entries(h)]
    assert losses(ours.log_history) == pytest.approx(losses(trainer.state.log_history), rel=1e-5)
    assert losses(ours.log_history)[1] != pytest.approx(0.5, abs=1e-4)  # the adapter moved: not 1 - σ(0)
