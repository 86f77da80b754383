"""TrainingArguments: HF names and defaults, one error listing every problem."""

from __future__ import annotations

import dataclasses

import pytest

from trainfold.trainer.args import TrainingArguments


def test_defaults_match_transformers_where_names_are_shared():
    transformers = pytest.importorskip("transformers")
    theirs = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = TrainingArguments()
    differ = {}
    for name, value in ours.to_dict().items():
        if name in theirs and theirs[name] is not dataclasses.MISSING:
            if name in ("output_dir", "label_names"):  # HF: None then derived; ours: the derived value
                continue
            if theirs[name] != value:
                differ[name] = (theirs[name], value)
    assert differ == {}


def test_unknown_names_suggest_the_closest():
    with pytest.raises(TypeError, match=r"'learnig_rate' \(did you mean 'learning_rate'\?\), 'zzz'"):
        TrainingArguments(learnig_rate=1e-3, zzz=1)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValueError) as info:
        TrainingArguments(
            per_device_train_batch_size=0,
            learning_rate="fast",
            eval_on_start=True,
            save_strategy="best",
            dataloader_persistent_workers=True,
            lr_scheduler_type="triangle",
        )
    text = str(info.value)
    for needle in (
        "learning_rate must be int or float, got 'fast'",
        "per_device_train_batch_size must be > 0, got 0",
        "eval_on_start=True needs eval_strategy",
        "save_strategy='best' needs metric_for_best_model",
        "dataloader_persistent_workers=True needs dataloader_num_workers > 0",
        "lr_scheduler_type='triangle' is not one of",
    ):
        assert needle in text


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"load_best_model_at_end": True}, "load_best_model_at_end=True needs eval_strategy"),
        (
            {"load_best_model_at_end": True, "eval_strategy": "epoch", "save_strategy": "steps"},
            "needs save_strategy to match",
        ),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 4},
            "multiple of eval_steps",
        ),
        ({"logging_steps": 1.5}, "logging_steps must be a positive int, or a float < 1"),
        ({"max_steps": -1, "num_train_epochs": 0}, "needs max_steps > 0 or num_train_epochs > 0"),
        ({"report_to": ["jsonl", "mlflow"]}, r"unknown reporters \['mlflow'\]"),
        ({"eval_strategy": "always"}, "eval_strategy='always' is not one of"),
        ({"dataloader_prefetch_factor": 2}, "dataloader_prefetch_factor needs dataloader_num_workers > 0"),
        ({"seed": 1.5}, "seed must be int, got 1.5"),
        ({"lr_scheduler_type": "warmup_stable_decay"}, r"needs \['num_decay_steps'\] in lr_scheduler_kwargs"),
        ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"min_lr": 0.1}}, r"not taken by 'cosine'"),
        ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "follows evaluation metrics, not the step"),
        ({"lr_scheduler_kwargs": "num_cycles=2"}, "lr_scheduler_kwargs must be dict or None"),
        ({"logging_nan_inf_filter": False}, "logged means always leave out inf/NaN step losses"),
        ({"label_smoothing_factor": 1.0}, r"label_smoothing_factor must be in \[0, 1\), got 1.0"),
        ({"optim": "adamw_8bit"}, r"optim='adamw_8bit' is not supported: .* bitsandbytes package"),
        ({"optim": "lomo"}, r"optim='lomo' is not supported: LOMO fuses the update into backward"),
        ({"optim": "adam"}, r"optim='adam' is not one of \['adamw_torch_fused', 'adamw_torch', 'sgd', 'adagrad'"),
        (
            {"optim": "sgd", "optim_args": "momentum=0.9,weight_decay=0.1"},
            r"optim_args \['weight_decay'\] are not taken",
        ),
        ({"optim": "sgd", "optim_args": "momentum"}, "optim_args must be 'key=value,key=value'"),
        ({"optim": "sgd", "optim_args": "momentum=fast"}, "optim_args values must be numbers"),
        ({"optim_args": "momentum=0.9"}, r"not taken by optim='adamw_torch_fused' \(it takes \[\]\)"),
        ({"bf16": 1}, "bf16 must be bool, got 1"),
    ],
)
def test_impossible_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments(**settings)


def test_valid_combinations_and_helpers():
    args = TrainingArguments(
        eval_strategy="steps",
        eval_steps=5,
        save_steps=10,
        load_best_model_at_end=True,
        report_to=["jsonl", "tensorboard"],
    )
    assert args.metric_key == "eval_loss"
    assert args.reporters == ("jsonl", "tensorboard")
    assert args.replace(learning_rate=0.1).learning_rate == 0.1
    assert TrainingArguments.from_dict(args.to_dict()) == args
    with pytest.raises(ValueError, match="per_device_train_batch_size must be > 0"):
        args.replace(per_device_train_batch_size=-2)


def test_optim_args_are_parsed_like_hf():
    args = TrainingArguments(optim="sgd", optim_args="momentum=0.9, nesterov=True,dampening=0")
    assert args.optimizer_options == {"momentum": 0.9, "nesterov": True, "dampening": 0.0}


# -- non-finite settings (issue 15, item 9) -------------------------------------------------------

NAN, INF = float("nan"), float("inf")


def test_non_finite_settings_are_refused_by_name_all_at_once():
    with pytest.raises(ValueError) as info:
        TrainingArguments(
            learning_rate=NAN,
            weight_decay=NAN,
            adam_epsilon=0.0,
            max_grad_norm=NAN,
            warmup_steps=NAN,
            save_steps=NAN,
            eval_steps=NAN,
            num_train_epochs=NAN,
            seed=2**70,
            logging_steps=INF,
        )
    text = str(info.value)
    for needle in (
        "learning_rate=nan is not a finite number",
        "weight_decay=nan is not a finite number",
        "adam_epsilon must be > 0",
        "max_grad_norm=nan is not a finite number (0 turns clipping off)",
        "warmup_steps=nan is not",
        "save_steps=nan is not",
        "eval_steps=nan is not",
        "num_train_epochs=nan is not",
        "logging_steps=inf is not",
        "seed must be in [0, 9223372036854775807], got 1180591620717411303424",
    ):
        assert needle in text
    assert "cannot convert" not in text and text.count("\n  - ") == 10  # one line per setting, nothing doubled


@pytest.mark.parametrize(
    "settings",
    [
        {"learning_rate": INF},
        {"adam_epsilon": -1e-8},
        {"max_grad_norm": INF},
        {"eval_delay": NAN},
        {"neftune_noise_alpha": NAN},
        {"data_seed": 2**64},
        {"seed": -1},
        {"num_train_epochs": INF, "max_steps": 5},
    ],
)
def test_each_non_finite_or_out_of_range_setting_is_named(settings):
    name = next(iter(settings))
    with pytest.raises(ValueError, match=rf"- {name}(=| must)"):
        TrainingArguments(**settings)


def test_the_largest_seed_and_tiny_epsilon_are_taken():
    args = TrainingArguments(seed=2**63 - 1, data_seed=0, adam_epsilon=1e-30, max_grad_norm=0.0)
    assert args.seed == 2**63 - 1


# -- transformers settings trainfold does not take (issue 15, item 12) ---------------------------


def test_every_transformers_setting_is_taken_or_refused_as_an_hf_setting_never_as_a_typo():
    import attrs

    transformers = pytest.importorskip("transformers")
    ours = {f.name for f in attrs.fields(TrainingArguments)}
    theirs = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    unexplained = []
    for name in sorted(theirs - ours):
        with pytest.raises(TypeError) as info:
            TrainingArguments(**{name: object()})  # a value that asks for something trainfold does not do
        text = str(info.value)
        if (
            "is a transformers.TrainingArguments setting that trainfold does not take: " not in text
            or "did you" in text
        ):
            unexplained.append((name, text))
    assert unexplained == []


def test_hf_settings_say_why_and_what_instead_all_at_once():
    with pytest.raises(TypeError) as info:
        TrainingArguments(
            push_to_hub=True,
            hub_model_id="me/model",
            deepspeed="ds.json",
            fsdp_min_num_params=9,
            auto_find_batch_size=True,
            save_safetensors=False,
            include_inputs_for_metrics=True,
            group_by_length=True,
            learnig_rate=1e-3,
        )
    text = str(info.value)
    assert text.startswith("unknown TrainingArguments: 'learnig_rate' (did you mean 'learning_rate'?)\n")
    for needle in (
        "push_to_hub=True is a transformers.TrainingArguments setting that trainfold does not take: trainfold never "
        "uploads",
        "hub_model_id='me/model' is",
        "deepspeed='ds.json' is",
        "fsdp_min_num_params=9 is",
        "auto_find_batch_size=True is",
        "save_safetensors=False is",
        "include_inputs_for_metrics=True is a transformers.TrainingArguments setting that trainfold does not take: "
        "removed from transformers; write include_for_metrics=['inputs']",
        "group_by_length=True is",
        "write train_sampling_strategy='group_by_length'",
        "set per_device_train_batch_size",
    ):
        assert needle in text
    assert text.count("did you mean") == 1


@pytest.mark.parametrize(
    "name, value, fix",
    [
        ("evaluation_strategy", "epoch", "write eval_strategy='epoch'"),
        ("per_gpu_train_batch_size", 4, "write per_device_train_batch_size=4"),
        ("no_cuda", True, "write use_cpu=True"),
        ("warmup_ratio", 0.1, "write warmup_steps=0.1"),
        ("torchdynamo", "inductor", "write torch_compile_backend='inductor'"),
    ],
)
def test_older_transformers_names_point_to_the_current_one(name, value, fix):
    with pytest.raises(TypeError, match=rf"{name}=.* is a transformers.TrainingArguments setting .*{fix}"):
        TrainingArguments(**{name: value})


def test_hf_settings_that_ask_for_what_trainfold_does_anyway_are_taken():
    args = TrainingArguments(
        push_to_hub=False,
        save_safetensors=True,
        group_by_length=False,
        do_train=True,
        deepspeed=None,
        fsdp="",
        average_tokens_across_devices=True,
        max_steps=3,
    )
    assert args == TrainingArguments(max_steps=3) and "push_to_hub" not in args.to_dict()
    assert TrainingArguments(gradient_checkpointing=True).checkpoint_every == 1  # HF 5's own alias, taken


def test_non_finite_values_inside_scheduler_and_optimizer_options_are_named():
    with pytest.raises(
        ValueError,
        match=r"lr_scheduler_kwargs min_lr=nan is not a finite number(.|\n)*"
        r"optim_args momentum=inf is not a finite number",
    ):
        TrainingArguments(
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr": NAN},
            optim="sgd",
            optim_args="momentum=inf",
        )


def test_the_arguments_checks_take_a_typed_arguments_record_not_any():
    """Issue 45: a check that reads trainfold's Arguments says so in its signature (no ``args: Any``)."""
    import ast
    import inspect

    from trainfold.trainer import args as args_module
    from trainfold.trainer import args_checks

    untyped = []
    for module in (args_module, args_checks):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.arg == "args" and (a.annotation is None or ast.unparse(a.annotation) == "Any"):
                        untyped.append(f"{module.__name__}.{node.name}")
    assert untyped == []
    assert "fp16=True and bf16=True: choose one" in str(
        pytest.raises(ValueError, TrainingArguments, fp16=True, bf16=True).value
    )
