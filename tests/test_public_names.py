"""Every name ``trainfold.__all__`` offered before the restructure still works, with every name its old
modules exported (``trainfold.checkpoint.save``, ``trainfold.grpo.train`` ...): module paths moved, the API did not."""

import pytest

import trainfold

TOP = [
    "Cursor",
    "EvalPrediction",
    "GRPOArguments",
    "Sampler",
    "StepBatch",
    "TrainResult",
    "TrainState",
    "TrainingArguments",
    "adamw",
    "any_of",
    "chain",
    "checkpoint",
    "chunked_causal_lm",
    "chunked_loss",
    "clip_by_global_norm",
    "compiled",
    "data",
    "decay_mask",
    "distributed",
    "dpo",
    "early_stopping",
    "ensemble",
    "evaluate",
    "evaluation",
    "fit",
    "generate",
    "grpo",
    "grpo_args",
    "grpo_run",
    "init_ensemble_state",
    "init_state",
    "keyed",
    "latest_checkpoint",
    "load",
    "losses",
    "make_ensemble_step",
    "make_sampler",
    "make_step",
    "max_steps",
    "max_time",
    "observe",
    "optim",
    "pack",
    "packed_collate",
    "packing",
    "pad_collate",
    "padding_free_collate",
    "predict",
    "reducers",
    "reporters",
    "samplers",
    "save",
    "schedules",
    "sgd",
    "split_ensemble",
    "stream",
    "train",
    "trajectory",
    "tree",
    "warm_up_kernels",
]

# the old module names in ``__all__`` and the names each of those modules exported
MODULES = {
    "checkpoint": [
        "ADAPTER_CONFIG_FILE",
        "ADAPTER_FILE",
        "CONFIG_FILE",
        "CheckpointError",
        "CheckpointWarning",
        "INCOMPLETE_MARKER",
        "MODEL_FILE",
        "SIDECAR_FILE",
        "STATE_FILE",
        "checkpoint_path",
        "fingerprint",
        "is_complete",
        "latest_checkpoint",
        "list_checkpoints",
        "load",
        "load_weights",
        "mark_jit",
        "model_weights",
        "read_metadata",
        "resume_checkpoint",
        "save",
        "validate_sidecar",
        "warm_start",
    ],
    "chunked_loss": [
        "ChunkedCausalLM",
        "OutputHead",
        "check_chunk_size",
        "chunked_causal_lm",
        "chunked_cross_entropy",
        "chunked_token_logps",
        "output_head",
    ],
    "compiled": ["CompileFallbackWarning", "compile_step"],
    "data": [
        "KeyedCollate",
        "PadCollate",
        "StateStream",
        "StepBatch",
        "close_loader",
        "eval_loader",
        "generation_batches",
        "keyed",
        "pad_collate",
        "sample_key",
        "stream",
    ],
    "distributed": [
        "GatherCollective",
        "ProcessGroupCollective",
        "SingleProcess",
        "agreed_stop",
        "collective_from_env",
        "evaluate_sharded",
        "failure_of",
        "gather_rows",
        "group_timeout",
        "joins_torchrun",
        "predict_sharded",
        "process_group_collective",
        "shard",
        "shard_bounds",
    ],
    "dpo": [
        "DPOObjective",
        "LOSS_TYPES",
        "PREFERENCE_COLUMNS",
        "PreferenceCollate",
        "count_pairs",
        "dpo_loss",
        "dpo_objective",
        "precompute_ref_logps",
        "preference_collate",
        "sequence_logps",
    ],
    "ensemble": [
        "ensemble_size",
        "init_ensemble_state",
        "make_ensemble_step",
        "split_ensemble",
        "stack_batches",
        "stack_ensemble",
    ],
    "evaluation": [
        "EvalPrediction",
        "PredictionOutput",
        "check_metrics",
        "eval_sets",
        "evaluate",
        "final_metrics",
        "predict",
        "prefix_metrics",
        "resolve_forward",
        "throughput",
        "to_numpy",
    ],
    "generate": ["functional_forward", "generate", "pad_right", "token_logps"],
    "grpo": [
        "GRPOObjective",
        "GRPO_LOSS_TYPES",
        "RewardFunc",
        "SCALE_REWARDS",
        "chunk_head",
        "combine_rewards",
        "group_advantages",
        "grpo_objective",
        "next_token_logps",
        "reward_name",
        "token_entropy",
    ],
    "grpo_args": ["GRPOArguments", "TRL_ONLY", "generation_order"],
    "grpo_run": ["BUFFER", "GRPORun", "GenerationBuffer", "grpo_stream", "train"],
    "losses": [
        "DPO_LOSS_TYPES",
        "IGNORE_INDEX",
        "Loss",
        "bce_with_logits",
        "causal_lm",
        "count_labels",
        "count_shifted_labels",
        "counter_for",
        "cross_entropy",
        "default_loss_for",
        "dpo",
        "dpo_loss_errors",
        "label_smoothed",
        "logits_of",
        "mse",
        "refuse_unlabelled",
        "sequence_classification",
    ],
    "observe": [
        "LOG_MARK",
        "LogMark",
        "LoggingPlan",
        "MetricWindow",
        "Observer",
        "TOKENS_SEEN",
        "counting_input_tokens",
        "eval_entry",
        "filtered_mean_loss",
        "initial_extras",
        "log_entry",
        "log_if_due",
        "log_mark",
        "logging_plan",
        "mark_logged",
        "notify",
        "observing",
        "should_log",
        "tap",
        "train_summary",
    ],
    "optim": [
        "AdamState",
        "GradientTransformation",
        "SgdState",
        "adamw",
        "apply_updates",
        "chain",
        "clip_by_global_norm",
        "decay_mask",
        "decay_mask_by_name",
        "sgd",
    ],
    "packing": ["PACKING_WINDOW", "check_packable", "pack", "packed_collate", "padding_free_collate"],
    "reducers": [
        "Reduced",
        "Reducer",
        "Transducer",
        "accuracy",
        "collecting",
        "combine",
        "compose",
        "concatenating",
        "counting",
        "filtering",
        "fold",
        "is_reduced",
        "mapping",
        "mean_loss",
        "merge_all",
        "offloading",
        "pad_concat",
        "summing",
        "taking",
        "transduce",
        "unreduced",
    ],
    "reporters": [
        "JsonlReporter",
        "Progress",
        "REPORTERS",
        "Reporter",
        "Reporters",
        "TensorBoardReporter",
        "TrackioReporter",
        "WandbReporter",
        "installed_reporters",
        "make_reporters",
        "progress",
        "tensorboard_dir",
        "tracker_key",
    ],
    "samplers": [
        "LENGTH_STRATEGIES",
        "STRATEGIES",
        "Sampler",
        "dataset_lengths",
        "make_sampler",
        "padded_cost",
        "preference_length",
    ],
    "schedules": [
        "SCHEDULE_NAMES",
        "Schedule",
        "as_schedule",
        "constant",
        "cosine",
        "cosine_with_restarts",
        "inverse_sqrt",
        "linear",
        "named",
        "polynomial",
        "schedule_kwargs_problems",
        "warmup_stable_decay",
        "warmup_steps_for",
    ],
    "tree": ["Tree", "add", "check_keys", "flatten", "global_norm", "scale", "tree_map", "unflatten", "zeros_like"],
}

# names that moved up to the layer they belong to (a lower layer cannot offer a higher one's names):
# (old module, old name) -> (the module name in ``__all__`` that offers it now, its name there)
MOVED = {
    ("data", "generation_batches"): ("grpo", "generation_batches"),
    ("distributed", "evaluate_sharded"): ("evaluation", "evaluate_sharded"),
    ("distributed", "predict_sharded"): ("evaluation", "predict_sharded"),
    ("distributed", "gather_rows"): ("evaluation", "gather_rows"),
    ("losses", "dpo"): ("dpo", "dpo_loss"),
    ("losses", "dpo_loss_errors"): ("dpo", "dpo_loss_errors"),
    ("losses", "DPO_LOSS_TYPES"): ("dpo", "LOSS_TYPES"),
    # one meaning per public name: ``trainfold.evaluate``/``predict`` are the run-level ones
    ("evaluation", "evaluate"): ("evaluation", "evaluate_batches"),
    ("evaluation", "predict"): ("evaluation", "predict_batches"),
}


def test_every_old_top_level_name_is_exported():
    assert [name for name in TOP if name not in trainfold.__all__ or not hasattr(trainfold, name)] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_an_old_module_name_offers_every_name_it_exported(module):
    missing = []
    for name in MODULES[module]:
        home, new = MOVED.get((module, name), (module, name))
        if not hasattr(getattr(trainfold, home), new):
            missing.append(f"{home}.{new}")
    assert missing == []


def test_a_moved_name_is_the_same_object_as_in_the_module_that_owns_it():
    from trainfold.recipes.dpo_loss import dpo_loss
    from trainfold.recipes.grpo_data import generation_batches

    assert trainfold.dpo.dpo_loss is dpo_loss
    assert trainfold.grpo.generation_batches is generation_batches


def test_no_subpackage_is_named_after_a_builtin_or_a_build_folder():
    import builtins
    import pkgutil

    names = {m.name for m in pkgutil.iter_modules(trainfold.__path__)}
    assert {"distributed", "evaluation"} <= names
    assert sorted(n for n in names if hasattr(builtins, n) or n in {"dist", "build", "eval"}) == []


# public names still bound to two objects, each with why it is left for now; fixing one fails the test below
# until it is taken off this list, and a new double meaning fails it too
TWO_MEANINGS = {
    "generate": "the module trainfold.generate and its function generate",
    "train": "trainfold.train and the runs dpo.train, grpo.train, sft.train, kto.train (a public API decision)",
}


def public_bindings() -> dict[str, dict[object, list[str]]]:
    """Every name in the ``__all__`` of trainfold and of each public module, with what each module binds it to."""
    import importlib
    import pkgutil
    import warnings

    names: dict[str, dict[object, list[str]]] = {}
    modules = ["trainfold"] + [
        m.name
        for m in pkgutil.walk_packages(trainfold.__path__, "trainfold.")
        if not any(part.startswith("_") for part in m.name.split("."))
    ]
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                value = getattr(module, name)
            key = value if isinstance(value, (str, int, float, tuple, frozenset)) else id(value)
            names.setdefault(name, {}).setdefault(key, []).append(module_name)
    return names


def test_one_meaning_per_public_name():
    bindings = public_bindings()
    doubles = {name: list(by.values()) for name, by in bindings.items() if len(by) > 1}
    assert sorted(set(doubles) - set(TWO_MEANINGS)) == [], {n: doubles[n] for n in set(doubles) - set(TWO_MEANINGS)}
    assert sorted(set(TWO_MEANINGS) - set(doubles)) == []  # fixed: take it off TWO_MEANINGS
    assert bindings["evaluate"] and len(bindings["evaluate"]) == 1  # the run-level evaluate alone


def test_a_renamed_name_still_resolves_with_a_warning_naming_its_new_home():
    from trainfold.evaluation import evaluation
    from trainfold.hf import dpo_run, plan, resume, run
    from trainfold.recipes import dpo_loss

    for module, old, new in [
        (evaluation, "evaluate", "evaluate_batches"),
        (evaluation, "predict", "predict_batches"),
        (trainfold.evaluation, "evaluate", "evaluate_batches"),
        (dpo_loss, "dpo", "dpo_loss"),
        (dpo_run, "prepare_dataset", "prepare_preference_dataset"),
        (trainfold.dpo, "prepare_dataset", "prepare_preference_dataset"),
        (run, "save", "save_checkpoint"),
        (resume, "start", "start_run"),
        (plan, "Schedule", "RunLength"),
    ]:
        with pytest.warns(DeprecationWarning, match=rf"\.{old} moved: use .*\.{new}$"):
            assert getattr(module, old) is getattr(module, new)
