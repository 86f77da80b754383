"""Migration from transformers/TRL (issue 33): a parsed argument object, the module names, the exit status."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import runpy
import signal
from pathlib import Path

import pytest
import torch

import trainfold
from trainfold import GRPOArguments, TrainingArguments
from trainfold.core.state import init_state
from trainfold.optim import sgd
from trainfold.trainer.train import TrainResult

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

# -- 1. from_hf ------------------------------------------------------------------------------------


def _parsed(cls, argv):
    """What HfArgumentParser makes of a command line (TrlParser's parser is the same for one config)."""
    (config,) = transformers.HfArgumentParser(cls).parse_args_into_dataclasses(args=argv)
    return config


@pytest.mark.parametrize("cls", [transformers.TrainingArguments, trl.SFTConfig, trl.DPOConfig, trl.GRPOConfig])
def test_a_parsed_config_at_its_defaults_converts_with_the_values_transformers_resolved(cls):
    acting = ["--disable_dropout", "false"] if cls is trl.DPOConfig else []  # the one TRL default that acts
    config = _parsed(cls, ["--output_dir", "out", "--use_cpu", "true", *acting])
    args = (GRPOArguments if cls is trl.GRPOConfig else TrainingArguments).from_hf(config)
    for f in dataclasses.fields(config):
        if hasattr(args, f.name) and f.name not in ("label_names", "report_to", "generation_batch_size"):
            value = getattr(config, f.name)
            value = value.value if hasattr(value, "value") else value
            value = tuple(value) if isinstance(value, list) else value  # include_for_metrics: [] is ()
            assert getattr(args, f.name) == value, f.name
    assert args.report_to == "none" and args.label_names == ("labels",)


def test_what_the_user_set_is_kept_and_enums_become_their_names():
    argv = ["--output_dir", "o", "--learning_rate", "3e-4", "--lr_scheduler_type", "cosine", "--eval_strategy", "steps"]
    argv += ["--logging_steps", "7", "--save_total_limit", "2", "--report_to", "none", "--seed", "3"]
    argv += ["--resume_from_checkpoint", "o/checkpoint-5", "--do_train", "--ddp_timeout", "1800"]
    args = TrainingArguments.from_hf(_parsed(transformers.TrainingArguments, argv))
    assert (args.learning_rate, args.lr_scheduler_type, args.eval_strategy) == (3e-4, "cosine", "steps")
    assert (args.logging_steps, args.eval_steps, args.save_total_limit, args.seed) == (7, 7, 2, 3)  # eval_steps: HF's
    assert type(args.lr_scheduler_type) is str and type(args.eval_strategy) is str


def test_changes_apply_after_the_conversion():
    hf = transformers.TrainingArguments(output_dir="o", learning_rate=1e-3)
    args = TrainingArguments.from_hf(hf, overwrite_output_dir=True, max_steps=4)
    assert (args.overwrite_output_dir, args.max_steps, args.learning_rate) == (True, 4, 1e-3)


def test_every_setting_trainfold_cannot_honour_is_refused_by_name_at_once():
    hf = trl.SFTConfig(
        output_dir="o", use_cpu=True, push_to_hub=True, ddp_timeout=60, dataset_text_field="content", use_cache=True
    )
    with pytest.raises(TypeError) as caught:
        TrainingArguments.from_hf(hf)
    text = str(caught.value)
    assert text.startswith("trl.SFTConfig settings that trainfold cannot honour:")
    for name in ("push_to_hub=True", "ddp_timeout=60", "dataset_text_field='content'", "use_cache=True"):
        assert name in text
    assert "model.push_to_hub" in text and "model.config.use_cache" in text  # the fix


def test_a_trl_default_that_acts_is_refused_until_turned_off():
    with pytest.raises(TypeError, match=r"disable_dropout=True \(a trl.DPOConfig default that acts\)"):
        TrainingArguments.from_hf(trl.DPOConfig(output_dir="o", use_cpu=True))
    assert TrainingArguments.from_hf(trl.DPOConfig(output_dir="o", use_cpu=True, disable_dropout=False)).bf16


def test_from_hf_refuses_what_is_not_a_parsed_config():
    with pytest.raises(TypeError, match="for a dict use from_dict"):
        TrainingArguments.from_hf({"learning_rate": 1e-3})


def test_grpo_arguments_defaults_are_grpo_configs_field_by_field():
    config, ours = trl.GRPOConfig(output_dir="o", use_cpu=True), GRPOArguments()
    # bf16: TRL's None resolves to True on every device; trainfold trains in full precision unless asked
    # (from_hf takes the resolved value). activation_checkpointing: TRL copies gradient_checkpointing=True into
    # it; trainfold reads the older name (checkpoint_every below). The rest are the run's own (output_dir,
    # the device: use_cpu, dataloader_pin_memory) or resolved by TRL's __post_init__ to what None means here.
    exceptions = {"output_dir", "bf16", "activation_checkpointing", "use_cpu", "dataloader_pin_memory"}
    exceptions |= {"disable_tqdm", "report_to", "label_names", "steps_per_generation", "generation_batch_size"}
    differ = []
    for f in dataclasses.fields(config):
        if hasattr(ours, f.name) and f.name not in exceptions:
            value = getattr(config, f.name)
            value = value.value if hasattr(value, "value") else value
            value = tuple(value) if isinstance(value, list) else value  # include_for_metrics: [] is ()
            if getattr(ours, f.name) != value:
                differ.append((f.name, getattr(ours, f.name), value))
    assert differ == []
    assert (ours.learning_rate, ours.logging_steps, ours.checkpoint_every, ours.report_to) == (1e-6, 10, 1, "none")
    assert ours.generation_steps == config.steps_per_generation


def test_a_grpo_config_that_filled_both_generation_sizes_converts():
    config = trl.GRPOConfig(
        output_dir="o", use_cpu=True, per_device_train_batch_size=4, generation_batch_size=16, num_generations=4
    )
    assert (config.steps_per_generation, config.generation_batch_size) == (4, 16)  # TRL fills in both
    args = GRPOArguments.from_hf(config)
    assert (args.generation_steps, args.generation_batch, args.prompts_per_generation) == (4, 16, 4)
    config.generation_batch_size = 8  # changed after parsing: the pair disagrees
    with pytest.raises(ValueError, match="generation_batch_size=8 and steps_per_generation=4, which disagree"):
        GRPOArguments.from_hf(config)


def test_grpo_from_hf_refuses_trl_settings_with_their_reasons_all_at_once():
    config = trl.GRPOConfig(output_dir="o", use_cpu=True, use_vllm=True, top_k=5, per_device_train_batch_size=8)
    with pytest.raises(TypeError) as caught:
        GRPOArguments.from_hf(config)
    assert "use_vllm=True" in str(caught.value) and "top_k=5" in str(caught.value)


# -- 4. preemption is not success ------------------------------------------------------------------------


def _result(status, sig=None):
    return TrainResult(init_state(torch.nn.Linear(2, 1), sgd(0.1)), status, {}, [], signal=sig)


def test_a_preempted_result_exits_143_and_a_finished_one_returns():
    assert _result("preempted", signal.SIGTERM).exit_code == 143
    assert _result("preempted", signal.SIGINT).exit_code == 130
    assert [_result(s).exit_code for s in ("completed", "stopped", "diverged")] == [0, 0, 0]
    with pytest.raises(SystemExit) as caught:
        _result("preempted", signal.SIGTERM).exit_if_preempted()
    assert caught.value.code == 143
    assert _result("completed").exit_if_preempted() is None


# -- 10. every module name imports -------------------------------------------------------------------------

MODULE_NAMES = [n for n in trainfold.__all__ if type(getattr(trainfold, n)).__name__ == "module"]


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_every_exported_module_name_is_a_module_that_imports(name):
    module = importlib.import_module(f"trainfold.{name}")
    assert module is getattr(trainfold, name)
    assert all(hasattr(module, n) for n in getattr(module, "__all__", ()))


def test_the_names_of_the_issue_import():
    from trainfold.ckpt import save
    from trainfold.core.losses import causal_lm
    from trainfold.data.samplers import make_sampler
    from trainfold.grpo import grpo_stream, train

    assert save is trainfold.ckpt.save and causal_lm is trainfold.core.losses.causal_lm
    assert make_sampler is trainfold.data.samplers.make_sampler and train is trainfold.grpo.run.train
    assert grpo_stream is trainfold.grpo.run.grpo_stream


# -- 2. processing_class ------------------------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(30)}}  # pad id 1, not 0
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]", unk_token="[UNK]")


def _classifier(seed=0):
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, num_labels=3, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForSequenceClassification(config)


def _sentences(tok, n=8):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = int(torch.randint(2, 9, (1,), generator=g))
        words = " ".join(f"w{int(w)}" for w in torch.randint(0, 30, (length,), generator=g))
        rows.append({**tok(words), "label": i % 3})
    return rows


def _hf_args(out, **kw):
    base = dict(output_dir=str(out), max_steps=1, per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1)
    return transformers.TrainingArguments(**{**base, "report_to": "none", "use_cpu": True, "save_strategy": "no", **kw})


def test_processing_class_pads_with_its_pad_id_as_the_trainer_does(tmp_path):
    tok = _tokenizer()
    rows = _sentences(tok)
    hf = _hf_args(tmp_path / "hf")
    trainer = transformers.Trainer(_classifier(), args=hf, train_dataset=rows, processing_class=tok)
    expected = trainer.train() and trainer.state.log_history[0]["loss"]
    args = TrainingArguments.from_hf(hf).replace(output_dir=str(tmp_path / "tf"), disable_tqdm=True)
    ours = trainfold.train(_classifier(), args, rows, processing_class=tok).log_history[0]["loss"]
    # one batch of 8: the same mean of 8 per-row losses, summed in another order at most (float32 rounding)
    assert ours == pytest.approx(expected, rel=1e-6)
    # without processing_class: padded with the model's config.pad_token_id (1), the tokenizer's too (was 0)
    model_padded = trainfold.train(_classifier(), args.replace(output_dir=str(tmp_path / "z")), rows)
    assert model_padded.log_history[0]["loss"] == pytest.approx(expected, rel=1e-6)

    def pad_0(items):
        return trainfold.data.pad_collate()([{"input_ids": r["input_ids"], "labels": r["label"]} for r in items])

    zero = args.replace(output_dir=str(tmp_path / "0"))
    zero_padded = trainfold.train(_classifier(), zero, rows, data_collator=pad_0)
    assert abs(zero_padded.log_history[0]["loss"] - expected) > 1e-3  # padding with 0 trains on other inputs
    model = _classifier()
    eval_hf = transformers.Trainer(model, args=hf, processing_class=tok).evaluate(rows)["eval_loss"]
    assert trainfold.evaluate(model, args, rows, processing_class=tok)["eval_loss"] == pytest.approx(eval_hf, rel=1e-6)
    predicted = trainfold.predict(model, args, rows, processing_class=tok).predictions
    reference = transformers.Trainer(model, args=hf, processing_class=tok).predict(rows).predictions
    assert torch.allclose(torch.as_tensor(predicted), torch.as_tensor(reference), rtol=0, atol=1e-6)


def test_every_checkpoint_holds_the_tokenizer(tmp_path):
    tok = _tokenizer()
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, save_steps=1, per_device_train_batch_size=4, disable_tqdm=True
    )
    result = trainfold.train(_classifier(), args, _sentences(tok), processing_class=tok)
    for step in (1, 2):
        loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / f"checkpoint-{step}")
        assert (len(loaded), loaded.pad_token_id, loaded("w3 w4")["input_ids"]) == (32, 1, [5, 6])
    assert result.last_checkpoint == tmp_path / "checkpoint-2"


# -- 9. log_history is a value --------------------------------------------------------------------------------


def test_the_log_history_is_a_list_that_outlives_the_output_dir(tmp_path):
    import shutil

    tok = _tokenizer()
    args = TrainingArguments(
        output_dir=str(tmp_path / "o"), max_steps=3, logging_steps=1, per_device_train_batch_size=4, disable_tqdm=True
    )
    result = trainfold.train(_classifier(), args, _sentences(tok), processing_class=tok)
    shutil.rmtree(tmp_path / "o")
    assert type(result.log_history) is list and len(result.log_history) == 4  # 3 steps + the summary
    assert [e["step"] for e in result.log_history[:3]] == [1, 2, 3] and "train_runtime" in result.log_history[-1]


# -- 5. reward functions are called by keyword, as TRL calls them ---------------------------------------------


def test_trls_documented_reward_signature_works_and_a_wrong_one_is_named():
    from trainfold.grpo import combine_rewards

    def reward_len(completions, **kwargs):  # TRL's documentation's example
        return [-abs(20 - len(c)) for c in completions]

    def by_column(prompts, completions, answer, **_):
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    total, each = combine_rewards([reward_len, by_column], ["p", "q"], ["x" * 20, "y"], {"answer": ["z", "y"]})
    assert each.tolist() == [[0.0, 0.0], [-19.0, 1.0]] and total.tolist() == [0.0, -18.0]

    def positional(p, c):
        return [0.0] * len(c)

    with pytest.raises(TypeError, match="reward function positional cannot be called as TRL calls it"):
        combine_rewards([positional], ["p"], ["x"])


# -- 3. the Trainer's methods after training -------------------------------------------------------------------


def test_log_and_save_metrics_print_and_write_what_the_trainer_does(tmp_path, capsys):
    from trainfold.trainer.trainer_methods import log_metrics, save_metrics

    metrics = {"train_runtime": 75.123, "train_loss": 1.234567, "epoch": 3.0, "train_samples": 120, "total_flos": 2**31}
    trainer = transformers.Trainer(_classifier(), args=_hf_args(tmp_path / "hf"))
    trainer.log_metrics("train", metrics)
    expected = capsys.readouterr().out
    log_metrics("train", metrics)
    assert capsys.readouterr().out == expected
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_loss": 0.5})
    save_metrics("train", metrics, tmp_path / "tf")
    save_metrics("eval", {"eval_loss": 0.5}, tmp_path / "tf")
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        assert (tmp_path / "tf" / name).read_text() == (tmp_path / "hf" / name).read_text()


def test_save_model_state_and_card_after_a_run(tmp_path):
    from trainfold.trainer.trainer_methods import create_model_card, save_model, save_state

    tok = _tokenizer()
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=4, disable_tqdm=True
    )
    model = _classifier()
    result = trainfold.train(model, args, _sentences(tok), processing_class=tok)
    save_model(model, tmp_path / "final", tok)
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "final").pad_token_id == 1
    save_state(result, args)
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert (state["global_step"], state["log_history"]) == (2, result.log_history)
    card = create_model_card(tmp_path, args, result, model_name="tiny-llama", dataset="sentences")
    text = card.read_text()
    assert text.startswith("---\nlibrary_name: transformers\n") and "\n# tiny-llama\n" in text
    assert "- train_loss:" in text


def test_the_methods_write_and_print_nothing_off_rank_zero(tmp_path, monkeypatch, capsys):
    from trainfold.trainer import trainer_methods

    monkeypatch.setenv("RANK", "1")
    assert not trainer_methods.is_world_process_zero()
    trainer_methods.log_metrics("train", {"loss": 1.0})
    trainer_methods.save_metrics("train", {"loss": 1.0}, tmp_path)
    trainer_methods.save_model(torch.nn.Linear(2, 1), tmp_path / "m")
    assert capsys.readouterr().out == "" and list(tmp_path.iterdir()) == []


def test_a_grpo_run_saves_its_tokenizer_into_every_checkpoint(tmp_path):
    from trainfold.core.models import TinyLM, TinyLMConfig

    tok = _tokenizer()
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, max_len=16))
    args = GRPOArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=2, report_to="none", disable_tqdm=True, save_steps=1, gradient_checkpointing=False,
    )  # fmt: skip

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainfold.grpo.train(model, args, [{"prompt": "w1 w2"}, {"prompt": "w3"}], reward_len, processing_class=tok)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "checkpoint-1").pad_token_id == 1


# -- 12. an HfArgumentParser script migrates in 8 changed lines ---------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "migration"


def _main(name):
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=f"migration_{name}")["main"]


def _code_lines(path):
    """The lines of a script after its docstring, blank ones left out."""
    text = path.read_text()
    body = text[text.index('"""', 3) + 3 :]
    return [line for line in body.splitlines() if line.strip()]


def test_the_migrated_classification_script_changes_8_lines_and_trains_as_the_trainer(tmp_path):
    hf, ours = EXAMPLES / "hf_classification.py", EXAMPLES / "trainfold_classification.py"
    diff = difflib.unified_diff(_code_lines(hf), _code_lines(ours), lineterm="", n=0)
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len(added) <= 8, added
    _classifier().save_pretrained(tmp_path / "model")
    _tokenizer().save_pretrained(tmp_path / "model")
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--max_steps", "4", "--per_device_train_batch_size", "8"]
    argv += ["--learning_rate", "1e-2", "--logging_steps", "1", "--report_to", "none", "--use_cpu", "true"]
    expected = _main("hf_classification")([*argv, "--output_dir", str(tmp_path / "hf")])
    got = _main("trainfold_classification")([*argv, "--output_dir", str(tmp_path / "tf")])
    assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-6)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "train_results.json", "all_results.json"):
        assert (tmp_path / "tf" / name).is_file(), name
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "tf" / "checkpoint-4").pad_token_id == 1


def _script(name):
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=f"migration_{name}")


def _added_lines(before, after):
    diff = difflib.unified_diff(_code_lines(EXAMPLES / before), _code_lines(EXAMPLES / after), lineterm="", n=0)
    return [line for line in diff if line.startswith("+") and not line.startswith("+++")]


def _write_rows(path, kind):
    g = torch.Generator().manual_seed(0)
    say = lambda: " ".join(f"w{int(i)}" for i in torch.randint(0, 59, (int(torch.randint(1, 5, (), generator=g)),)))
    if kind == "dpo":
        rows = [{"prompt": say(), "chosen": " " + say(), "rejected": " " + say()} for _ in range(16)]
    else:
        rows = [{"prompt": say(), "completion": " " + say()} for _ in range(16)]
    path.mkdir()
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize(
    ("kind", "trainer", "extra"), [("dpo", "DPOTrainer", ["--beta", "0.2"]), ("sft", "SFTTrainer", [])]
)
def test_trls_example_script_migrates_in_8_changed_lines_with_trls_per_step_losses(
    tmp_path, monkeypatch, kind, trainer, extra
):
    import trl
    from tiny_chat import llama, word_tokenizer

    assert len(_added_lines(f"trl_{kind}.py", f"trainfold_{kind}.py")) <= 8
    llama().save_pretrained(tmp_path / "model")
    word_tokenizer(None).save_pretrained(tmp_path / "model")
    _write_rows(tmp_path / "data", kind)
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "data"), *extra]
    argv += ["--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    argv += ["--learning_rate", "1e-2", "--logging_steps", "1", "--seed", "3", "--use_cpu", "true"]
    argv += ["--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--save_strategy", "no"]
    losses = {}
    trl_train, tf_train = getattr(trl, trainer).train, getattr(trainfold, kind).train

    def recorded_trl(self, *a, **kw):
        out = trl_train(self, *a, **kw)
        losses["trl"] = [h["loss"] for h in self.state.log_history if "loss" in h and "train_loss" not in h]
        return out

    def recorded_trainfold(*a, **kw):
        result = tf_train(*a, **kw)
        losses["trainfold"] = [h["loss"] for h in result.log_history if "loss" in h and "train_loss" not in h]
        return result

    monkeypatch.setattr(getattr(trl, trainer), "train", recorded_trl)
    monkeypatch.setattr(getattr(trainfold, kind), "train", recorded_trainfold)
    for name in (f"trl_{kind}", f"trainfold_{kind}"):
        script = _script(name)
        parsed = script["make_parser"]().parse_args_and_config([*argv, "--output_dir", str(tmp_path / name)])
        script["main"](*parsed)
        assert (tmp_path / name / "model.safetensors").is_file()
    assert len(losses["trainfold"]) == 4
    if kind == "dpo":  # the first step's reference is the policy itself: every pair's loss is ln 2
        assert losses["trainfold"][0] == pytest.approx(0.6931472, rel=1e-6)
    assert losses["trainfold"] == pytest.approx(losses["trl"], rel=1e-5)  # as tests/test_{dpo,sft}_train's runs


# -- 6. PEFT ------------------------------------------------------------------------------------------------------


def _llama_lm(seed=0, pad_token_id=None):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.config.pad_token_id = pad_token_id  # set after building: the same weights (no padding_idx row)
    return model


def _lm_rows():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(2, 32, (int(n),), generator=g).tolist()} for n in torch.randint(3, 9, (12,))]


@pytest.mark.parametrize(("task_type", "packing"), [(None, False), (None, True), ("CAUSAL_LM", True)])
def test_a_peft_model_with_or_without_task_type_trains_with_its_base_models_loss(tmp_path, task_type, packing):
    peft = pytest.importorskip("peft")
    rows = [{**r, "labels": r["input_ids"]} for r in _lm_rows()]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True,
        save_strategy="no", packing=packing, max_length=16,
    )  # fmt: skip
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type=task_type)
    lora = peft.get_peft_model(_llama_lm(pad_token_id=0), config)  # no task_type: the generic PeftModel wrapper
    ours = trainfold.train(lora, args, rows).log_history[0]["loss"]
    plain = trainfold.train(_llama_lm(pad_token_id=0), args.replace(output_dir=str(tmp_path / "b")), rows)
    plain = plain.log_history[0]["loss"]
    assert ours == plain  # LoRA's B starts at zero: the first step's forward is the base model's, bit for bit


# -- 7. evaluation without labels ---------------------------------------------------------------------------------


def test_rows_with_only_input_ids_get_an_eval_loss_when_training_builds_their_labels(tmp_path):
    rows = _lm_rows()  # only input_ids, as SFT rows after tokenization
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True,
        save_strategy="no", packing=True, max_length=16, eval_strategy="steps", eval_steps=2,
    )  # fmt: skip
    model = _llama_lm(pad_token_id=0)  # eval rows are padded (not packed): with the model's pad id
    result = trainfold.train(model, args, rows, eval_dataset=rows[:5])
    logged = [e["eval_loss"] for e in result.log_history if "eval_loss" in e]
    labelled = [{**r, "labels": r["input_ids"]} for r in rows[:5]]
    expected = trainfold.evaluate(model, args.replace(packing=False), labelled)["eval_loss"]
    assert logged == [expected]
    assert trainfold.evaluate(model, args, rows[:5])["eval_loss"] == expected


# -- 8. restore_callback_states_from_checkpoint ---------------------------------------------------------------------


class _StopAt3(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = control.should_training_stop or state.global_step == 3


@pytest.mark.parametrize("restore", [True, False])
def test_early_stopping_resumes_with_the_checkpoints_settings_as_the_trainer(tmp_path, restore):
    """Patience 5 until step 3, resumed with a callback of patience 1: HF takes the checkpoint's 5 when restoring.

    ``greater_is_better=True`` on the loss makes every evaluation after the first one a bad one.
    """
    tok = _tokenizer()
    rows = _sentences(tok)
    hf = _hf_args(
        tmp_path / "hf", max_steps=20, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        metric_for_best_model="loss",
        greater_is_better=True, lr_scheduler_type="constant", restore_callback_states_from_checkpoint=restore,
    )  # fmt: skip
    stopper = transformers.EarlyStoppingCallback
    first = transformers.Trainer(_classifier(), args=hf, train_dataset=rows, eval_dataset=rows, processing_class=tok)
    for callback in (stopper(early_stopping_patience=5), _StopAt3()):
        first.add_callback(callback)
    first.train()
    second = transformers.Trainer(_classifier(), args=hf, train_dataset=rows, eval_dataset=rows, processing_class=tok)
    second.add_callback(stopper(early_stopping_patience=1))
    expected = second.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-3")).global_step

    args = TrainingArguments.from_hf(hf).replace(output_dir=str(tmp_path / "tf"), disable_tqdm=True)
    given = dict(eval_dataset=rows, processing_class=tok)
    stop3 = trainfold.train(_classifier(), args, rows, callbacks=[stopper(5)], stop=lambda s: int(s.step) >= 3, **given)
    assert stop3.global_step == 3
    resumed = trainfold.train(_classifier(), args, rows, callbacks=[stopper(1)], resume_from_checkpoint=True, **given)
    assert (resumed.global_step, resumed.status) == (expected, "stopped")
    assert expected == (6 if restore else 4)  # restored: patience 5 and the count of 2 bad evaluations at step 3


# -- 11. another run's directory ------------------------------------------------------------------------------------


def test_the_refusal_of_another_runs_directory_names_a_fix_a_transformers_5_script_reaches(tmp_path):
    tok = _tokenizer()
    rows = _sentences(tok)
    hf = _hf_args(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    assert not hasattr(hf, "overwrite_output_dir")  # transformers 5 has no such setting
    trainfold.train(_classifier(), TrainingArguments.from_hf(hf, disable_tqdm=True), rows, processing_class=tok)
    other = TrainingArguments.from_hf(hf, disable_tqdm=True, seed=7)
    with pytest.raises(ValueError, match=r"TrainingArguments.from_hf\(hf_args, overwrite_output_dir=True\)"):
        trainfold.train(_classifier(), other, rows, processing_class=tok)
    again = trainfold.train(_classifier(), other.replace(overwrite_output_dir=True), rows, processing_class=tok)
    assert again.status == "completed"


@pytest.mark.parametrize(
    ("fsdp", "expected"), [("full_shard", ("full_shard",)), ("full_shard auto_wrap", ("full_shard",))]
)
def test_transformers_5s_fsdp_true_and_its_filled_in_config_convert(fsdp, expected):
    from trainfold.step.fsdp import FullShard

    hf = transformers.TrainingArguments(output_dir="o", use_cpu=True, fsdp=fsdp)
    assert hf.fsdp is True and hf.fsdp_config["reshard_after_forward"] is True  # what transformers 5 makes of it
    assert (TrainingArguments.from_hf(hf).fsdp, TrainingArguments.from_hf(hf).full_shard) == ("full_shard", True)
    assert TrainingArguments.from_hf(hf).fsdp_config == {"reshard_after_forward": True}  # the rest: transformers'
    assert TrainingArguments.from_hf(hf).fsdp_plan == FullShard()
    grad_op = transformers.TrainingArguments(output_dir="o", use_cpu=True, fsdp="shard_grad_op")
    assert not TrainingArguments.from_hf(grad_op).fsdp_plan.reshard_after_forward  # fully_shard's SHARD_GRAD_OP
    offload = transformers.TrainingArguments(output_dir="o", use_cpu=True, fsdp=f"{fsdp} offload")
    assert TrainingArguments.from_hf(offload).fsdp_plan.offload
    layers = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    named = transformers.TrainingArguments(output_dir="o", use_cpu=True, fsdp=fsdp, fsdp_config=layers)
    assert TrainingArguments.from_hf(named).fsdp_plan.layer_classes == ("LlamaDecoderLayer",)
    custom = transformers.TrainingArguments(output_dir="o", use_cpu=True, fsdp=fsdp, fsdp_config={"min_num_params": 9})
    with pytest.raises(ValueError, match=r"fsdp_config\['min_num_params'\]=9 is not supported"):
        TrainingArguments.from_hf(custom)
