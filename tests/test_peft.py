"""PEFT / LoRA (issue 21, item 4): adapter checkpoints that PeftModel.from_pretrained loads, no frozen base, bitwise
resume."""

from __future__ import annotations

import json
import warnings

import pytest
import safetensors.torch
import torch

from trainfold import TrainingArguments, train
from trainfold import ckpt as checkpoint
from trainfold.ckpt import STATE_FILE, CheckpointError
from trainfold.core.adapters import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from trainfold.core.state import init_state
from trainfold.core.tree import flatten
from trainfold.optim import adamw

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64


def base(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def lora(seed: int = 0):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(base(seed), config)


def rows():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, VOCAB, (16, 10), generator=g)]


def args(out, **over) -> TrainingArguments:
    base_args = dict(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        seed=3,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
    )
    return TrainingArguments(**{**base_args, **over})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A LoRA run of 4 steps, checkpoints at 2 and 4; the model ends holding the trained adapter."""
    out = tmp_path_factory.mktemp("lora") / "run"
    model = lora()
    result = train(model, args(out), rows())
    return model, result, out


def test_a_lora_checkpoint_holds_the_adapter_as_peft_writes_it_and_no_base_weights(straight, tmp_path):
    model, result, out = straight
    path = out / "checkpoint-4"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [ADAPTER_CONFIG_FILE, ADAPTER_FILE, STATE_FILE, "trainfold.json"]
    )
    model.save_pretrained(tmp_path / "peft")  # peft's own save of the trained model
    theirs = safetensors.torch.load_file(tmp_path / "peft" / ADAPTER_FILE)
    ours = safetensors.torch.load_file(path / ADAPTER_FILE)
    assert sorted(ours) == sorted(theirs) and any(".lora_A.weight" in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert json.loads((path / ADAPTER_CONFIG_FILE).read_text()) == json.loads(
        (tmp_path / "peft" / ADAPTER_CONFIG_FILE).read_text()
    )
    state_file = safetensors.torch.load_file(path / STATE_FILE)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and not any(f"buffers.{n}" in state_file for n in frozen)  # the frozen base is in no file
    assert not any(k.startswith("params.") for k in state_file)  # the adapter is written once
    assert sorted(checkpoint.read_metadata(path)["frozen"]) == sorted(f"buffers.{n}" for n in frozen)
    on_disk = sum(p.stat().st_size for p in path.iterdir())
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert on_disk < base_bytes  # a tiny base: the sidecar (the global generators' states too) is most of the rest


def test_peft_from_pretrained_gives_identical_logits(straight):
    model, result, out = straight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = peft.PeftModel.from_pretrained(base(), out / "checkpoint-4")
    ids = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    trained = result.apply_to(lora())
    trained.eval(), reloaded.eval()
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        assert torch.equal(reloaded(input_ids=ids).logits, expected)
        assert not torch.equal(base()(input_ids=ids).logits, expected)  # the adapter changed the model


def test_a_lora_run_resumes_bitwise(straight, tmp_path):
    _, result, _ = straight
    out = tmp_path / "stopped"
    stopped = train(lora(), args(out), rows(), stop=lambda s: int(s.step) >= 2)
    assert stopped.global_step == 2
    resumed = train(lora(), args(out), rows(), resume_from_checkpoint=True)
    a, b = flatten(result.state), flatten(resumed.state)
    assert a.keys() == b.keys()
    for key in a:
        if key.startswith("extras.") or key == "metrics.num_items":
            continue
        assert torch.equal(a[key], b[key]), key
    final = checkpoint.load(out / "checkpoint-4", like=result.state)
    assert all(torch.equal(final.params[k], v) for k, v in result.state.params.items())


def test_resuming_on_another_base_is_refused_naming_the_frozen_weights(straight):
    _, result, out = straight
    with pytest.raises(
        CheckpointError,
        match=r"field 'frozen': the template's frozen weights are not those.*"
        r"base_model\.model\.model\..*same base weights",
    ):
        checkpoint.load(out / "checkpoint-4", like=init_state(lora(seed=1), adamw(1e-2)))
    with pytest.raises(CheckpointError, match="frozen weights are not those"):
        checkpoint.load_weights(out / "checkpoint-4", like=init_state(lora(seed=1), adamw(1e-2)))
    weights = checkpoint.load_weights(out / "checkpoint-4", like=init_state(lora(), adamw(1e-2)))  # the same base
    assert all(torch.equal(weights.params[k], v) for k, v in result.state.params.items())


def test_a_run_resumed_on_another_base_is_refused_by_name_and_the_checkpoint_kept(tmp_path):
    out = tmp_path / "stopped"
    train(lora(), args(out), rows(), stop=lambda s: int(s.step) >= 2)
    # the base's fingerprints are checked by the load, before the first step: refused, not set aside
    with pytest.raises(
        checkpoint.FrozenWeightsError,
        match=r"checkpoint-2/trainfold.json: field 'frozen': the template's frozen weights are not those.*same base",
    ):
        train(lora(seed=1), args(out), rows(), resume_from_checkpoint=True)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert checkpoint.is_complete(out / "checkpoint-2")  # the checkpoint is whole: kept as it was
    resumed = train(lora(), args(out), rows(), resume_from_checkpoint=True)  # on its own base it resumes
    assert resumed.global_step == 4


def test_a_model_with_two_adapters_is_refused_by_name(tmp_path):
    model = lora()
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"adapters \['default', 'other'\].*one adapter"):
        checkpoint.save(init_state(model, adamw(1e-3)), tmp_path / "c", model=model)
    assert not (tmp_path / "c").exists()


def _adapter_run(config, out):
    """Train ``base()`` with the adapter ``config`` for 4 steps (checkpoints at 2 and 4): the model, the result."""
    model = peft.get_peft_model(base(), config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, train(model, args(out), rows())


def _same_as_peft_writes(model, path, tmp_path):
    """The checkpoint's adapter files are what ``save_pretrained`` writes, and ``from_pretrained`` gives its logits."""
    model.save_pretrained(tmp_path / "peft")
    theirs = safetensors.torch.load_file(tmp_path / "peft" / ADAPTER_FILE)
    ours = safetensors.torch.load_file(path / ADAPTER_FILE)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    config = json.loads((tmp_path / "peft" / ADAPTER_CONFIG_FILE).read_text())
    assert json.loads((path / ADAPTER_CONFIG_FILE).read_text()) == config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = peft.PeftModel.from_pretrained(base(), path).eval()
    ids = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_a_vera_checkpoint_holds_its_shared_projections_as_peft_writes_them_and_resumes_bitwise(tmp_path):
    # VeRA's vera_A / vera_B are one tensor held by every adapted layer; the state keeps it once, under the first
    # layer's name, and peft's state dict wanted it under the model's own: the first save raised peft's ValueError
    config = peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model, result = _adapter_run(config, tmp_path / "run")
    _same_as_peft_writes(model, tmp_path / "run" / "checkpoint-4", tmp_path)
    assert any("vera_A" in k for k in safetensors.torch.load_file(tmp_path / "run" / "checkpoint-4" / ADAPTER_FILE))
    out = tmp_path / "stopped"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(peft.get_peft_model(base(), config), args(out), rows(), stop=lambda s: int(s.step) >= 2)
        resumed = train(peft.get_peft_model(base(), config), args(out), rows(), resume_from_checkpoint=True)
    assert all(torch.equal(resumed.state.params[k], v) for k, v in result.state.params.items())


@pytest.mark.parametrize(
    "options",
    [
        dict(target_modules="all-linear", use_rslora=True),
        dict(target_modules=["q_proj", "v_proj"], use_dora=True, modules_to_save=["lm_head"]),
        dict(target_modules=["embed_tokens", "q_proj"], bias="lora_only"),
    ],
    ids=["all-linear-rslora", "dora-modules_to_save", "embedding"],
)
def test_lora_variants_checkpoint_as_peft_saves_them(options, tmp_path):
    model, _ = _adapter_run(peft.LoraConfig(r=4, task_type="CAUSAL_LM", **options), tmp_path / "run")
    _same_as_peft_writes(model, tmp_path / "run" / "checkpoint-4", tmp_path)


def _adalora(orth_reg_weight: float):
    config = peft.AdaLoraConfig(
        init_r=4, target_r=2, total_step=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    config.orth_reg_weight = orth_reg_weight
    return peft.get_peft_model(base(), config)


def test_adalora_is_refused_by_name_while_its_forward_adds_a_regularizer_the_step_would_drop(tmp_path):
    # transformers.Trainer trains on outputs.loss, into which AdaLoRA's forward adds orth_reg_weight * ||PP^T - I||;
    # the step's loss comes from the logits: the term was silently dropped (a different loss and trajectory)
    with pytest.raises(ValueError, match=r"AdaLoRA adapter 'default' has orth_reg_weight=0.5.*orth_reg_weight=0.0"):
        train(_adalora(0.5), args(tmp_path / "a"), rows())
    ids = rows()[0]["input_ids"][None]
    with torch.no_grad():  # the term is there: the model's own loss is above the logits' cross entropy
        model = _adalora(0.5).train()
        own = model(input_ids=ids, labels=ids).loss
        plain = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:])
    assert own > plain + 0.1


def test_adalora_without_the_regularizer_trains_as_the_hf_trainer(tmp_path):
    settings = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=5e-2, optim="sgd", seed=7)
    settings |= dict(logging_steps=1, report_to="none", save_strategy="no", max_grad_norm=0, disable_tqdm=True)
    data = rows()

    class Sequential(transformers.Trainer):
        def _get_train_sampler(self, *unused, **unused_too):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    theirs = _adalora(0.0)
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **settings)
    trainer = Sequential(model=theirs, args=hf_args, train_dataset=data)
    trainer.train()
    ours = _adalora(0.0)
    sequential = TrainingArguments(output_dir=str(tmp_path / "tf"), train_sampling_strategy="sequential", **settings)
    result = train(ours, sequential, data)
    hf_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [h["loss"] for h in result.log_history if "loss" in h] == pytest.approx(hf_losses, rel=1e-6)
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_lora_dora_with_modules_to_save_trains_as_the_hf_trainer_on_padded_accumulated_batches(tmp_path):
    # the reference: transformers.Trainer + PEFT on the same model, seed and rows (sequential order, right padding,
    # accumulation 2, SGD + momentum, decay, warmup + cosine, clipping); float32 rounding of the same sums is all
    # that may differ (measured: losses equal, params within 3e-8)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(16):
        ids = torch.randint(1, VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        data.append({"input_ids": ids, "labels": ids})

    def collate(rows):
        width = max(len(r["input_ids"]) for r in rows)
        pad = lambda r, key, value: r[key] + [value] * (width - len(r[key]))
        return {
            "input_ids": torch.tensor([pad(r, "input_ids", 0) for r in rows]),
            "labels": torch.tensor([pad(r, "labels", -100) for r in rows]),
            "attention_mask": torch.tensor(
                [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows]
            ),
        }

    def model():
        config = peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], use_dora=True, modules_to_save=["lm_head"], task_type="CAUSAL_LM"
        )
        return peft.get_peft_model(base(), config)

    settings = dict(max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=5e-2)
    settings |= dict(optim="sgd", optim_args="momentum=0.9", weight_decay=0.01, warmup_steps=1)
    settings |= dict(lr_scheduler_type="cosine", max_grad_norm=1.0, seed=7, logging_steps=1, report_to="none")
    settings |= dict(save_strategy="no", disable_tqdm=True)

    class Sequential(transformers.Trainer):
        def _get_train_sampler(self, *unused, **unused_too):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    theirs = model()
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, remove_unused_columns=False, **settings
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Sequential(model=theirs, args=hf_args, train_dataset=data, data_collator=collate)
        trainer.train()
        ours = model()
        sequential = TrainingArguments(
            output_dir=str(tmp_path / "tf"), train_sampling_strategy="sequential", **settings
        )
        result = train(ours, sequential, data, data_collator=collate)
    logged = lambda history, key: [h[key] for h in history if key in h]
    assert logged(result.log_history, "loss") == pytest.approx(logged(trainer.state.log_history, "loss"), rel=1e-6)
    assert logged(result.log_history, "grad_norm") == pytest.approx(
        logged(trainer.state.log_history, "grad_norm"), rel=1e-5
    )
    assert logged(result.log_history, "learning_rate") == logged(trainer.state.log_history, "learning_rate")
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_resume_with_another_adapter_config_is_refused_by_name_and_from_pretrained_resumes(straight, tmp_path):
    # lora_alpha changes the forward, not a shape: the run's fingerprint matched and the resume went on silently
    _, result, _ = straight
    out = tmp_path / "stopped"
    train(lora(), args(out), rows(), stop=lambda s: int(s.step) >= 2)
    other = peft.get_peft_model(
        base(), peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    with pytest.raises(
        CheckpointError, match=r"adapter_config.json: .*\(lora_alpha: 8 there, 32 here\).*from_pretrained"
    ):
        train(other, args(out), rows(), resume_from_checkpoint=True)
    assert checkpoint.is_complete(out / "checkpoint-2")  # refused, not set aside
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rebuilt = peft.PeftModel.from_pretrained(base(), out / "checkpoint-2", is_trainable=True)
    resumed = train(rebuilt, args(out), rows(), resume_from_checkpoint=True)
    assert all(torch.equal(resumed.state.params[k], v) for k, v in result.state.params.items())


def test_save_model_after_an_sft_run_with_peft_config_saves_the_adapter_as_peft_does(tmp_path):
    """TRL's ``--use_peft`` script moved over (``examples/migration/trainfold_sft.py``): ``trainfold.save_model`` of
    the module given to ``sft.train(..., peft_config=)`` writes ``PeftModel.save_pretrained``'s files, which
    ``PeftModel.from_pretrained(base)`` loads with the trained model's logits."""
    import trainfold
    from trainfold import sft

    config = lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = base()
    sft_args = sft.SFTArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
        bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    result = sft.train(model, sft_args, [{"input_ids": r.tolist()} for r in torch.randint(0, VOCAB, (8, 10))],
                       peft_config=config())  # fmt: skip
    trainfold.save_model(model, tmp_path / "final")
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_FILE]
    theirs = result.apply_to(peft.get_peft_model(base(), config()))
    theirs.save_pretrained(tmp_path / "peft")  # peft's own save of the same trained adapter
    ours_w = safetensors.torch.load_file(tmp_path / "final" / ADAPTER_FILE)
    theirs_w = safetensors.torch.load_file(tmp_path / "peft" / ADAPTER_FILE)
    assert sorted(ours_w) == sorted(theirs_w) and all(torch.equal(ours_w[k], theirs_w[k]) for k in theirs_w)
    assert json.loads((tmp_path / "final" / ADAPTER_CONFIG_FILE).read_text()) == json.loads(
        (tmp_path / "peft" / ADAPTER_CONFIG_FILE).read_text()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = peft.PeftModel.from_pretrained(base(), tmp_path / "final")
    ids = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    model.eval(), reloaded.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert torch.equal(reloaded(input_ids=ids).logits, expected)
        assert not torch.equal(base()(input_ids=ids).logits, expected)  # the adapter was trained
