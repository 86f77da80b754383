"""The Trainer-shaped facades: script-shaped flows run against the real transformers / TRL trainers.

``classification_script`` makes the calls transformers' ``run_classification.py`` makes, in its order (written
here, not copied); TRL's ``sft.py`` and ``dpo.py`` are run as installed (``trl/scripts/``). Each runs with the
peer's trainer class and with trainfold's in its place, so a script moves by changing its import line, and
the two runs must agree step by step.
"""

from __future__ import annotations

import inspect
import json

import attrs
import pytest
import torch
import transformers
import trl

import trainfold
from trainfold.trainer.facade import Trainer

# -- tiny local model and data -------------------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(30)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]", unk_token="[UNK]")


def _classifier_dir(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, num_labels=3, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "model"
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def _sentences(n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        words = " ".join(
            f"w{int(w)}" for w in torch.randint(0, 30, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
        )
        rows.append({"sentence": words, "label": i % 3})
    return rows


# -- transformers' run_classification, its calls in its order ------------------------------------------------------


def classification_script(Trainer, argv, model_dir):  # Trainer: the class the script imports
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    (training_args,) = parser.parse_args_into_dataclasses(args=argv)
    transformers.set_seed(training_args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir)

    def tokenized(rows):
        return [{**tokenizer(r["sentence"]), "label": r["label"]} for r in rows]

    train_dataset, eval_dataset, predict_dataset = (
        tokenized(_sentences(16, 0)),
        tokenized(_sentences(6, 1)),
        tokenized(_sentences(5, 2)),
    )

    def compute_metrics(p):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        return {"accuracy": float((preds.argmax(-1) == p.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,
        processing_class=tokenizer,
        data_collator=transformers.DataCollatorWithPadding(tokenizer),
    )
    out = {}
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.save_model()
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    out["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    metrics["eval_samples"] = len(eval_dataset)
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    out["eval"] = metrics
    predictions = trainer.predict(predict_dataset, metric_key_prefix="predict").predictions
    out["predictions"] = predictions
    if trainer.is_world_process_zero():
        (training_args.output_dir and open(f"{training_args.output_dir}/predict_results.txt", "w")).write(
            "\n".join(str(int(p)) for p in predictions.argmax(-1))
        )
    kwargs = {"finetuned_from": model_dir, "tasks": "text-classification"}
    trainer.create_model_card(**kwargs)
    out["history"] = trainer.state.log_history
    return out


def _argv(out, *extra):
    argv = [
        "--output_dir",
        str(out),
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "1e-2",
    ]
    argv += ["--logging_steps", "1", "--report_to", "none", "--use_cpu", "true", "--save_steps", "2", "--seed", "3"]
    return [*argv, "--eval_strategy", "steps", "--eval_steps", "2", "--disable_tqdm", "true", *extra]


def _without_times(metrics):
    """The metrics without the times, and without trainfold's named extra ``*_token_loss`` (the token mean)."""
    return {k: v for k, v in metrics.items() if not any(s in k for s in ("runtime", "per_second", "_token_loss"))}


def test_run_classification_moves_by_its_import_and_trains_evaluates_and_saves_as_the_trainer(tmp_path):
    model_dir = _classifier_dir(tmp_path)
    hf = classification_script(transformers.Trainer, _argv(tmp_path / "hf"), model_dir)
    ours = classification_script(trainfold.Trainer, _argv(tmp_path / "tf"), model_dir)
    assert len(ours["losses"]) == 4
    assert ours["losses"] == hf["losses"]  # bitwise: the same batches, the same float32 mean
    assert _without_times(ours["eval"]).keys() == _without_times(hf["eval"]).keys()
    assert _without_times(ours["eval"]) == pytest.approx(_without_times(hf["eval"]), rel=1e-5)
    assert torch.allclose(torch.as_tensor(ours["predictions"]), torch.as_tensor(hf["predictions"]), atol=1e-5)
    hf_evals = [e for e in hf["history"] if "eval_loss" in e]
    our_evals = [e for e in ours["history"] if "eval_loss" in e]
    assert [e["step"] for e in our_evals] == [e["step"] for e in hf_evals] == [2, 4, 4]  # two in train, then evaluate()
    out = tmp_path / "tf"
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert transformers.AutoTokenizer.from_pretrained(out).pad_token_id == 1 and loaded.config.num_labels == 3
    for name in ("train_results.json", "eval_results.json", "all_results.json", "trainer_state.json", "README.md"):
        assert (out / name).is_file(), name
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and [e.get("loss") for e in state["log_history"][:1]] == [ours["losses"][0]]
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "text-classification" in card and model_dir in card


def test_the_trainer_resumes_bitwise_from_its_checkpoint(tmp_path):
    import shutil

    model_dir = _classifier_dir(tmp_path)
    whole = classification_script(trainfold.Trainer, _argv(tmp_path / "a"), model_dir)
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")  # a run stopped after step 2
    again = classification_script(
        trainfold.Trainer,
        _argv(tmp_path / "b", "--resume_from_checkpoint", str(tmp_path / "b" / "checkpoint-2")),
        model_dir,
    )
    assert again["losses"][-2:] == whole["losses"][2:] and again["eval"]["eval_loss"] == whole["eval"]["eval_loss"]


def _tiny_model(tmp_path):
    model_dir = _classifier_dir(tmp_path)
    return transformers.AutoModelForSequenceClassification.from_pretrained(model_dir)


def test_what_the_facade_cannot_honour_is_refused_by_name_with_the_functional_alternative(tmp_path):
    model = _tiny_model(tmp_path)
    args = trainfold.TrainingArguments(output_dir=str(tmp_path / "o"), report_to="none")
    with pytest.raises(TypeError, match=r"model_init=.*build the model yourself"):
        Trainer(model, args, model_init=lambda: model)
    with pytest.raises(TypeError, match=r"optimizers=.*trainfold.train\(\.\.\., optimizer="):
        Trainer(model, args, optimizers=(torch.optim.SGD(model.parameters(), 0.1), None))
    trainer = Trainer(model, args)
    with pytest.raises(TypeError, match="push_to_hub is not supported.*save_model"):
        trainer.push_to_hub()
    with pytest.raises(TypeError, match="hyperparameter_search"):
        trainer.hyperparameter_search()
    with pytest.raises(TypeError, match="ignore_keys"):
        trainer.evaluate([{"input_ids": [2, 3], "labels": 0}], ignore_keys=["past_key_values"])
    with pytest.raises(ValueError, match="evaluation requires an eval_dataset"):
        trainer.evaluate()
    with pytest.raises(TypeError, match="model= a torch module"):
        Trainer("some/model", args)


def test_args_may_be_trainfolds_own_or_absent(tmp_path, monkeypatch):
    model = _tiny_model(tmp_path)
    args = trainfold.TrainingArguments(output_dir=str(tmp_path / "o"), report_to="none", learning_rate=3e-3)
    assert Trainer(model, args).args is args
    monkeypatch.chdir(tmp_path)
    assert Trainer(model).args.output_dir == "trainer_output"  # HF's default


def test_create_model_card_takes_every_keyword_of_the_trainers(tmp_path):
    import inspect

    model = _tiny_model(tmp_path)
    trainer = Trainer(model, trainfold.TrainingArguments(output_dir=str(tmp_path / "o"), report_to="none"))
    names = [p for p in inspect.signature(transformers.Trainer.create_model_card).parameters if p != "self"]
    trainer.create_model_card(**{name: name if name != "tags" else ["a", "b"] for name in names})
    card = (tmp_path / "o" / "README.md").read_text()
    assert "license: license" in card and "- a\n- b\n" in card and "Tasks: tasks" in card


# -- TRL's own sft.py and dpo.py (the installed trl/scripts/), run with only the trainer class swapped ----------


def _preference_or_completion_rows(path, kind):
    g = torch.Generator().manual_seed(0)

    def say():
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 59, (int(torch.randint(1, 5, (), generator=g)),)))

    if kind == "dpo":
        rows = [{"prompt": say(), "chosen": " " + say(), "rejected": " " + say()} for _ in range(16)]
    elif kind == "kto":  # unpaired: each block of 3 has both labels
        rows = [{"prompt": say(), "completion": " " + say(), "label": i % 3 != 0} for i in range(16)]
    else:
        rows = [{"prompt": say(), "completion": " " + say()} for _ in range(16)]
    path.mkdir()
    for split, part in (("train", rows[:12]), ("test", rows[12:])):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def _recording(cls, into, key):
    """``cls`` whose ``train`` records the per-step losses, and then the metrics of ``evaluate``."""

    class Recorded(cls):
        def train(self, *a, **kw):
            out = super().train(*a, **kw)
            into[key] = [h["loss"] for h in self.state.log_history if "loss" in h and "train_loss" not in h]
            into[key + "_eval"] = self.evaluate()
            return out

    return Recorded


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto"])
def test_trls_script_moves_by_its_import_with_trls_per_step_losses_and_eval(tmp_path, monkeypatch, kind):
    import importlib
    import runpy

    import trl
    from tiny_chat import llama, word_tokenizer

    llama().save_pretrained(tmp_path / "model")
    word_tokenizer(None).save_pretrained(tmp_path / "model")
    _preference_or_completion_rows(tmp_path / "data", kind)
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "data")]
    argv += ["--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    argv += ["--learning_rate", "1e-2", "--logging_steps", "1", "--seed", "3", "--use_cpu", "true"]
    argv += ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--save_strategy", "no"]
    argv += ["--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "3"]
    # eval batches of 3 and 1 rows: eval_loss is HF's row-weighted mean of batch means (issue 48, item 5)
    name = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "kto": "KTOTrainer"}[kind]
    got = {}
    for who, cls in (("trl", getattr(trl, name)), ("trainfold", getattr(getattr(trainfold, kind), name))):
        monkeypatch.setattr(trl, name, _recording(cls, got, who))  # the script's `from trl import ...` line
        script = runpy.run_path(importlib.import_module(f"trl.scripts.{kind}").__file__, run_name=f"facade_{kind}")
        parsed = script["make_parser"]().parse_args_and_config([*argv, "--output_dir", str(tmp_path / who)])
        script["main"](*parsed)
    assert len(got["trainfold"]) == 4
    assert got["trainfold"] == pytest.approx(got["trl"], rel=1e-5)  # as tests/test_{dpo,sft}_train's runs
    ours, theirs = _without_times(got["trainfold_eval"]), _without_times(got["trl_eval"])
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5) and ours["epoch"] == theirs["epoch"]
    out = tmp_path / "trainfold"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "</s>" and model.config.vocab_size == 64


def test_sft_trainer_with_peft_saves_the_adapter_that_peft_loads(tmp_path):
    import peft
    from tiny_chat import llama, word_tokenizer

    rows = [{"prompt": "w1 w2", "completion": " w3 w4"}, {"prompt": "w5", "completion": " w6"}] * 2
    args = trainfold.sft.SFTArguments(
        output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=2, bf16=False, report_to="none",
        gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = trainfold.sft.SFTTrainer(
        llama(), args, train_dataset=rows, processing_class=word_tokenizer(None), peft_config=lora
    )
    assert isinstance(trainer.model, peft.PeftModel)
    trainer.train()
    trainer.save_model()
    out = tmp_path / "o"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").is_file()
    loaded = peft.PeftModel.from_pretrained(llama(), out)
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(v, trained[k]) for k, v in loaded.named_parameters() if "lora_" in k)
    assert transformers.AutoTokenizer.from_pretrained(out).pad_token == "<pad>"


def test_grpo_trainer_is_trainfold_grpo_train(tmp_path):
    from trainfold.core.models import TinyLM, TinyLMConfig

    def model():
        torch.manual_seed(0)
        return TinyLM(TinyLMConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, max_len=16))

    def reward_len(completions, **kwargs):  # a reward that tells completions apart, so the losses are not all 0
        return [float(sum(map(ord, c)) % 7) for c in completions]

    def args(out):
        return trainfold.GRPOArguments(
            output_dir=str(out), max_steps=2, per_device_train_batch_size=2, num_generations=2, logging_steps=1,
            max_completion_length=2, report_to="none", disable_tqdm=True, save_strategy="no",
            gradient_checkpointing=False,
        )  # fmt: skip

    prompts, tok = [{"prompt": "w1 w2"}, {"prompt": "w3"}], _tokenizer()
    # the facade samples as TRL does, from torch's global generator: trainfold.grpo.train does so when asked
    ours = attrs.evolve(args(tmp_path / "a"), generation_rng="global")
    policy = model()
    transformers.set_seed(ours.seed)  # as GRPOTrainer's constructor seeds the global generators (TRL's)
    expected = trainfold.grpo.train(policy, ours, prompts, reward_len, processing_class=tok)
    assert any(e["grad_norm"] != 0 for e in expected.log_history[:2])  # (on-policy, equal lengths: each loss is 0)
    trainer = trainfold.grpo.GRPOTrainer(
        model(), reward_len, args(tmp_path / "b"), train_dataset=prompts, processing_class=tok
    )
    trainer.train()
    keys = ("loss", "grad_norm", "reward", "reward_std")
    assert [[e[k] for k in keys] for e in trainer.state.log_history[:2]] == [
        [e[k] for k in keys] for e in expected.log_history[:2]
    ]
    with pytest.raises(TypeError, match="GRPOTrainer.evaluate is not supported.*eval_strategy"):
        trainer.evaluate()
    with pytest.raises(TypeError, match="tools=.*call tools inside a reward function"):
        trainfold.grpo.GRPOTrainer(model(), reward_len, args(tmp_path / "c"), tools=[print])


def test_trl_facades_take_trl_configs_and_refuse_what_they_cannot_honour(tmp_path):
    import trl
    from tiny_chat import llama

    config = trl.SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, learning_rate=3e-3, report_to="none")
    trainer = trainfold.sft.SFTTrainer(llama(), config)
    assert isinstance(trainer.args, trainfold.sft.SFTArguments) and trainer.args.learning_rate == 3e-3
    assert trainer.args.bf16 == config.bf16  # TRL's hardware-resolved value, as its trainer runs it
    with pytest.raises(TypeError, match="quantization_config=.*load the quantized model yourself"):
        trainfold.sft.SFTTrainer(llama(), config, quantization_config=object())
    with pytest.raises(TypeError, match="data_collator=.*pads preference rows itself"):
        trainfold.dpo.DPOTrainer(llama(), args=trainfold.dpo.DPOArguments(bf16=False), data_collator=list)
    with pytest.raises(TypeError, match="push_to_hub"):
        trainer.push_to_hub(dataset_name="x")


# -- item 2: a peer's config taken as it is; overrides by keyword win -------------------------------------------------


def test_an_override_by_keyword_wins_over_what_from_hf_would_refuse():
    import trl

    reward = trl.RewardConfig(output_dir="o", use_cpu=True, report_to="none")  # disable_dropout=True: TRL's default
    args = trainfold.TrainingArguments.from_hf(reward, disable_dropout=False)
    assert args.learning_rate == 1e-4 and args.bf16 == reward.bf16  # TRL's defaults, as TRL resolved them here
    pushed = trl.SFTConfig(output_dir="o", use_cpu=True, push_to_hub=True, report_to="none")
    assert trainfold.TrainingArguments.from_hf(pushed, push_to_hub=False).output_dir == "o"
    with pytest.raises(TypeError, match="push_to_hub=True"):  # not overridden: still refused by name
        trainfold.TrainingArguments.from_hf(pushed)


def test_a_trl_facade_refuses_another_trainfold_arguments_class_with_the_one_it_takes(tmp_path):
    from tiny_chat import llama

    with pytest.raises(TypeError, match="takes SFTArguments .* not TrainingArguments: build SFTArguments"):
        trainfold.sft.SFTTrainer(llama(), trainfold.TrainingArguments(output_dir=str(tmp_path)))


@pytest.mark.parametrize(("package", "name"), [("sft", "SFT"), ("dpo", "DPO"), ("kto", "KTO"), ("reward", "Reward")])
def test_each_trl_run_refuses_another_arguments_class_naming_its_own_and_the_conversion(tmp_path, package, name):
    run = getattr(trainfold, package).train
    with pytest.raises(
        TypeError,
        match=rf"trainfold\.{package}\.train takes {name}Arguments \(TRL's {name}Config "
        rf"names\), not TrainingArguments; convert a trl\.{name}Config with {name}Arguments\.from_hf",
    ):
        run(torch.nn.Linear(2, 2), trainfold.TrainingArguments(output_dir=str(tmp_path)), [])


def test_dpo_trainer_evaluates_and_predicts_against_the_reference_fixed_when_built(tmp_path):
    from tiny_chat import llama, word_tokenizer

    pairs = [
        {"prompt": "w1 w2", "chosen": " w3", "rejected": " w4 w5"},
        {"prompt": "w6", "chosen": " w7", "rejected": " w8"},
    ]
    args = trainfold.dpo.DPOArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, bf16=False,
        gradient_checkpointing=False, report_to="none", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    trainer = trainfold.dpo.DPOTrainer(llama(), args=args, train_dataset=pairs, processing_class=word_tokenizer(None))
    before = trainer.evaluate(pairs)
    assert before["eval_loss"] == pytest.approx(0.6931472, rel=1e-6)  # the policy is its reference
    trainer.train()
    after, predicted = trainer.evaluate(pairs), trainer.predict(pairs)
    assert after["eval_loss"] < before["eval_loss"] and after["eval_rewards/margins"] > 0
    assert predicted.metrics["test_loss"] == pytest.approx(after["eval_loss"], rel=1e-6)
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [2]  # the one after training


def test_each_trl_facade_takes_its_peers_constructor_keywords_in_order():
    """The facades declare their keywords as data (``PeerTrainer``); the signature a script calls stays TRL's."""
    from trainfold.dpo import DPOTrainer
    from trainfold.grpo import GRPOTrainer
    from trainfold.kto import KTOTrainer
    from trainfold.reward import RewardTrainer
    from trainfold.sft import SFTTrainer

    for ours, theirs in (
        (SFTTrainer, trl.SFTTrainer),
        (DPOTrainer, trl.DPOTrainer),
        (GRPOTrainer, trl.GRPOTrainer),
        (RewardTrainer, trl.RewardTrainer),
        (KTOTrainer, trl.KTOTrainer),
    ):
        names = list(inspect.signature(ours).parameters)
        peer = inspect.signature(theirs).parameters
        assert names == [n for n in peer if n in names], ours.__name__
        for name in set(names) - {"reward_funcs"}:  # TRL defaults it for environment_factory, which is refused
            assert inspect.signature(ours).parameters[name].default == peer[name].default, (ours.__name__, name)
    with pytest.raises(TypeError, match="reward_funcs"):
        GRPOTrainer(model=torch.nn.Linear(1, 1))
    with pytest.raises(TypeError, match="the run pads preference rows itself"):
        DPOTrainer(torch.nn.Linear(1, 1), None, None, lambda rows: rows)


def test_building_the_trainer_seeds_the_global_generators_as_the_trainers_constructor(tmp_path):
    """``Trainer(...)`` calls ``set_seed(args.seed)``: what a script (or its collator) draws next is the same."""
    import random

    import numpy as np

    drawn = []
    for cls in (transformers.Trainer, Trainer):
        torch.manual_seed(1)
        args = transformers.TrainingArguments(output_dir=str(tmp_path), seed=7, use_cpu=True, report_to="none")
        cls(model=torch.nn.Linear(2, 2), args=args)
        drawn.append((torch.rand(2).tolist(), float(np.random.rand()), random.random()))
    assert drawn[0] == drawn[1]


def test_grpo_trainer_loads_a_named_model_with_its_arguments_model_init_kwargs_once(tmp_path):
    """As the other TRL facades: ``model_init_kwargs`` load the model when the trainer is built, and the run gets
    them spent (it was handed them again, for a built module, and refused them)."""
    from tiny_chat import llama, word_tokenizer

    path = tmp_path / "model"
    llama().save_pretrained(path)
    word_tokenizer(None).save_pretrained(path)
    args = trainfold.GRPOArguments(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=2, report_to="none", disable_tqdm=True, save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    reward_len = lambda completions, **kwargs: [float(len(c)) for c in completions]
    trainer = trainfold.grpo.GRPOTrainer(str(path), reward_len, args, train_dataset=[{"prompt": "w1 w2"}] * 2)
    assert trainer.train().global_step == 1
    assert trainer.args.model_init_kwargs == {"dtype": torch.float32}  # the trainer's arguments: as given


@pytest.mark.parametrize("package", ["sft", "dpo", "kto", "grpo", "reward"])
def test_each_trl_facade_defaults_its_output_dir_as_trl_names_it(package):
    """TRL's trainers default to ``{model name}-{config class name less Config}`` (``tiny-SFT``)."""
    from tiny_chat import llama, word_tokenizer

    facade = getattr(trainfold, package)
    kind = {"sft": "SFT", "dpo": "DPO", "kto": "KTO", "grpo": "GRPO", "reward": "Reward"}[package]
    peer = getattr(trl, f"{kind}Trainer")
    model = llama() if package != "reward" else transformers.LlamaForSequenceClassification(llama().config)
    model.config._name_or_path, model.config.num_labels = "org/tiny", 1
    extra = {"reward_funcs": lambda completions, **kwargs: [0.0] * len(completions)} if package == "grpo" else {}
    trainer = getattr(facade, peer.__name__)(model, processing_class=word_tokenizer(None), **extra)
    assert trainer.args.output_dir == f"tiny-{getattr(trl, f'{kind}Config').__name__.removesuffix('Config')}"


def test_args_parameters_name_what_they_take():
    """``train``, the Trainer-shaped facades and the trainer package type each ``args`` parameter (a trainfold
    Arguments record, a transformers/TRL config: ``GivenArguments``), so a type checker checks their callers."""
    import ast
    from pathlib import Path

    src = Path(trainfold.__file__).parent
    files = [*(src / "trainer").glob("*.py"), *src.glob("*/trainer.py")]
    untyped = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                bad = [
                    p
                    for p in params
                    if p.arg == "args" and (p.annotation is None or ast.unparse(p.annotation) == "Any")
                ]
                untyped += [f"{path.relative_to(src)}:{p.lineno} {node.name}" for p in bad]
    assert untyped == []


def test_evaluate_and_predict_take_a_scripts_transformers_arguments_as_train_does(tmp_path):
    """``trainfold.evaluate``/``predict`` convert a ``transformers.TrainingArguments`` with ``from_hf``, as ``train``
    does (it failed inside with ``'NoneType' object is not iterable``), and refuse a dict by name."""
    from trainfold.core.models import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]
    hf = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    ours = trainfold.TrainingArguments.from_hf(hf)
    untimed = lambda metrics: {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}
    assert untimed(trainfold.evaluate(model, hf, rows)) == untimed(trainfold.evaluate(model, ours, rows))
    predicted, expected = trainfold.predict(model, hf, rows), trainfold.predict(model, ours, rows)
    assert torch.equal(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))
    with pytest.raises(TypeError, match=r"args is a dict, not trainfold's TrainingArguments; pass trainfold"):
        trainfold.evaluate(model, {"output_dir": str(tmp_path)}, rows)


def test_a_facade_subclass_keeps_the_arguments_class_it_declares():
    """``PeerTrainer[SFTArguments]`` declares a facade's class; a subclass inherits it or sets its own."""
    from trainfold.dpo import DPOArguments, DPOTrainer
    from trainfold.sft import SFTArguments, SFTTrainer

    class Mine(DPOArguments):
        pass

    class Inherits(SFTTrainer):
        pass

    class Own(DPOTrainer):
        arguments_class = Mine

    assert (SFTTrainer.arguments_class, Inherits.arguments_class) == (SFTArguments, SFTArguments)
    assert (DPOTrainer.arguments_class, Own.arguments_class) == (DPOArguments, Mine)
