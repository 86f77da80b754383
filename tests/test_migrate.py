"""Migration from transformers/TRL (issue 33): a parsed argument object, the module names, the exit status."""

from __future__ import annotations

import dataclasses
import importlib
import signal
import warnings

import pytest
import torch

import trainfold
from trainfold import GRPOArguments, TrainingArguments
from trainfold.core.state import init_state
from trainfold.hf.train import TrainResult
from trainfold.optim import sgd

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

# -- 1. from_hf ------------------------------------------------------------------------------------


def _parsed(cls, argv):
    """What HfArgumentParser makes of a command line (TrlParser's parser is the same for one config)."""
    (config,) = transformers.HfArgumentParser(cls).parse_args_into_dataclasses(args=argv)
    return config


@pytest.mark.parametrize("cls", [transformers.TrainingArguments, trl.SFTConfig, trl.DPOConfig, trl.GRPOConfig])
def test_a_parsed_config_at_its_defaults_converts_with_the_values_transformers_resolved(cls):
    config = _parsed(cls, ["--output_dir", "out", "--use_cpu", "true"])
    args = (GRPOArguments if cls is trl.GRPOConfig else TrainingArguments).from_hf(config)
    for f in dataclasses.fields(config):
        if hasattr(args, f.name) and f.name not in ("label_names", "report_to", "generation_batch_size"):
            value = getattr(config, f.name)
            value = value.value if hasattr(value, "value") else value
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
    from trainfold.checkpoint import save
    from trainfold.grpo import make_rollout, train
    from trainfold.losses import causal_lm
    from trainfold.samplers import make_sampler

    assert save is trainfold.ckpt.save and causal_lm is trainfold.core.losses.causal_lm
    assert make_sampler is trainfold.data.samplers.make_sampler and train is trainfold.hf.grpo_run.train
    assert make_rollout is trainfold.recipes.grpo.make_rollout


def test_a_moved_name_still_imports_from_its_old_module_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="trainfold.losses.dpo moved: use trainfold.dpo.dpo_loss"):
        from trainfold.losses import dpo
    assert dpo is trainfold.dpo.dpo_loss
    with pytest.raises(ImportError):
        from trainfold.losses import no_such_name  # noqa: F401


def test_make_rollout_takes_the_old_keyword_with_a_warning():
    from trainfold.grpo import make_rollout

    model = torch.nn.Linear(2, 2)
    common = dict(encode=list, decode=list, num_generations=2, max_new_tokens=2)
    with pytest.warns(DeprecationWarning, match="renamed optimizer_steps_per_generation"):
        old = make_rollout(model, lambda completions, **_: [0.0] * len(completions), steps_per_generation=3, **common)
    assert old.optimizer_steps_per_generation == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = make_rollout(model, lambda completions, **_: [0.0], optimizer_steps_per_generation=3, **common)
    assert new.optimizer_steps_per_generation == 3
    with pytest.raises(TypeError, match="pass only optimizer_steps_per_generation"):
        make_rollout(model, len, steps_per_generation=2, optimizer_steps_per_generation=3, **common)
