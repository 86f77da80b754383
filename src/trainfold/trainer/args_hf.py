"""The ``transformers.TrainingArguments`` names that trainfold does not take: why, and what to use instead.

A name here is never answered with "did you mean": ``TrainingArguments`` says that it is an HF
setting, why trainfold does not take it, and what to write instead. A value that asks for what
trainfold does anyway (``push_to_hub=False``, ``save_safetensors=True``) is taken and has no effect.
The table covers every field of the installed ``transformers.TrainingArguments`` (a test checks
it) and the older names that earlier releases had.

>>> setting, why = hf_only_problem("group_by_length", True).split(": ", 1)
>>> setting
'group_by_length=True is a transformers.TrainingArguments setting that trainfold does not take'
>>> why
"the older name; write train_sampling_strategy='group_by_length'"
>>> hf_only_problem("evaluation_strategy", "steps").split("; ")[-1]
"write eval_strategy='steps'"
>>> hf_only_problem("push_to_hub", False) is None, hf_only_problem("learnig_rate", 1) is None
(True, True)
"""

from __future__ import annotations

from typing import Any

__all__ = ["HF_ONLY", "REMOVED", "TAKEN_AS_IS", "hf_only_problem"]

_HUB = (
    "trainfold never uploads; after training copy the weights into the model (result.apply_to(model)) and "
    "call model.push_to_hub(...) yourself"
)
_FSDP = (
    "trainfold applies torch's fully_shard per transformer block with fsdp='full_shard'; name the block "
    "classes with fsdp_config={'transformer_layer_cls_to_wrap': [...]} (default: the model's _no_split_modules)"
)
_DDP = (
    "trainfold wraps the module in torch's DistributedDataParallel itself (trainfold.step.data_parallel: a hook "
    "sums the buckets, no_sync on all but a step's last micro-batch) and does not expose DDP's options; run under "
    "torchrun"
)
_ACCELERATE = "trainfold does not run on accelerate; the device and torchrun's environment decide placement"
_TRACKIO = "set the project with the TRACKIO_PROJECT environment variable (report_to='trackio' logs locally)"
_LOG_LEVEL = "only the main process logs (log_level sets its level); configure other ranks' logging yourself"
_EVAL_LOOP = "evaluation is one reducer pipeline (compute_metrics gets predictions and label_ids); not settable"
_SCRIPT = "transformers' Trainer ignores it too (it is for your script); call train, evaluate or predict"
_GONE = "removed from transformers; "

# name -> why trainfold does not take it, and what to use instead
HF_ONLY: dict[str, str] = {
    **dict.fromkeys(
        (
            "push_to_hub",
            "hub_token",
            "hub_private_repo",
            "hub_model_id",
            "hub_strategy",
            "hub_always_push",
            "hub_revision",
            "push_to_hub_model_id",
            "push_to_hub_organization",
            "push_to_hub_token",
        ),
        _HUB,
    ),
    "deepspeed": "DeepSpeed is not supported; trainfold trains data parallel under torchrun",
    **dict.fromkeys(("fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap"), _FSDP),
    **dict.fromkeys(
        (
            "ddp_find_unused_parameters",
            "ddp_bucket_cap_mb",
            "ddp_broadcast_buffers",
            "ddp_static_graph",
            "ddp_backend",
            "ddp_timeout",
            "sharded_ddp",
            "xpu_backend",
        ),
        _DDP,
    ),
    **dict.fromkeys(("accelerator_config", "parallelism_config", "split_batches", "dispatch_batches"), _ACCELERATE),
    "auto_find_batch_size": (
        "trainfold does not retry with a smaller batch: the batch size fixes which samples form "
        "each step; set per_device_train_batch_size (and gradient_accumulation_steps to keep "
        "the global batch)"
    ),
    **dict.fromkeys(("log_level_replica", "log_on_each_node"), _LOG_LEVEL),
    "save_safetensors": "checkpoints are always safetensors (nothing is pickled); drop the setting",
    "save_on_each_node": "rank 0 writes the checkpoints, to output_dir; use a shared output_dir",
    "include_inputs_for_metrics": _GONE + "write include_for_metrics=['inputs']",
    **dict.fromkeys(("eval_do_concat_batches", "eval_use_gather_object", "batch_eval_metrics"), _EVAL_LOOP),
    "group_by_length": "the older name; write train_sampling_strategy='group_by_length'",
    "evaluation_strategy": _GONE + "the older name of eval_strategy; write eval_strategy={value}",
    "per_gpu_train_batch_size": _GONE + "write per_device_train_batch_size={value}",
    "per_gpu_eval_batch_size": _GONE + "write per_device_eval_batch_size={value}",
    "no_cuda": _GONE + "write use_cpu={value}",
    "use_mps_device": _GONE + "the device is chosen from what is available; use_cpu=True forces the CPU",
    "warmup_ratio": _GONE + "write warmup_steps={value} (a float < 1 is a share of the total steps)",
    "include_tokens_per_second": "not reported; include_num_input_tokens_seen counts the tokens",
    **dict.fromkeys(
        ("fp16_backend", "half_precision_backend", "fp16_opt_level"),
        "fp16 is torch autocast with trainfold's own loss scaling; nothing to choose",
    ),
    **dict.fromkeys(
        ("fp16_full_eval", "bf16_full_eval"),
        "evaluation runs in the parameters' dtype; cast the model for a half-precision evaluation",
    ),
    "torchdynamo": _GONE + "write torch_compile_backend={value}",
    "tf32": "set torch.backends.cuda.matmul.allow_tf32 (and cudnn.allow_tf32) yourself before training",
    **dict.fromkeys(("use_liger_kernel", "liger_kernel_config"), "Liger kernels are not supported"),
    "use_cache": "set model.config.use_cache yourself (activation checkpointing turns it off where it must)",
    "torch_empty_cache_steps": "not supported; call torch.cuda.empty_cache() from an observer if you need it",
    "optim_target_modules": "for GaLore/APOLLO optimizers, which trainfold does not have (optim: adamw_torch_fused, "
    "adamw_torch, sgd, adagrad, rmsprop, adafactor)",
    "adafactor": _GONE + "write optim='adafactor'",
    "dataloader_multiprocessing_context": "not supported; the workers start with the platform's default context",
    "dataloader_in_order": "not supported; data order never depends on dataloader_num_workers anyway",
    "ignore_data_skip": "a resume always continues at the exact data position, without reading the skipped batches",
    "full_determinism": (
        "a step's random draws come from generators seeded by (seed, step); for deterministic "
        "kernels call torch.use_deterministic_algorithms(True) yourself"
    ),
    "debug": "not supported",
    "skip_memory_metrics": "trainfold reports no memory metrics",
    **dict.fromkeys(("do_train", "do_eval", "do_predict"), _SCRIPT),
    "resume_from_checkpoint": "pass it to train(..., resume_from_checkpoint=True or a path)",
    "local_rank": "torchrun sets LOCAL_RANK in the environment, which train reads",
    **dict.fromkeys(("project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"), _TRACKIO),
    **dict.fromkeys(
        (
            "jit_mode_eval",
            "use_ipex",
            "ray_scope",
            "tpu_num_cores",
            "tpu_metrics_debug",
            "mp_parameters",
            "past_index",
            "use_legacy_prediction_loop",
        ),
        _GONE + "not supported",
    ),
    "average_tokens_across_devices": (
        "always on: num_items_in_batch is summed over every rank, so the loss is the global token mean"
    ),
}

# trainfold's own settings that are gone -> why, and what to do instead
REMOVED: dict[str, str] = {
    "save_fsync": "checkpoints are now always fsynced before they are renamed into place; drop the argument",
}

# name -> the values that ask for what trainfold does anyway (mostly HF's defaults): taken, with no effect
TAKEN_AS_IS: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(
        (
            "hub_token",
            "hub_private_repo",
            "hub_model_id",
            "hub_revision",
            "deepspeed",
            "optim_target_modules",
            "tf32",
            "liger_kernel_config",
            "torch_empty_cache_steps",
            "trackio_space_id",
            "trackio_bucket_id",
            "trackio_static_space_id",
            "accelerator_config",
            "parallelism_config",
            "dataloader_multiprocessing_context",
            "ddp_find_unused_parameters",
            "ddp_bucket_cap_mb",
            "ddp_broadcast_buffers",
            "ddp_static_graph",
            "ddp_backend",
            "resume_from_checkpoint",
        ),
        (None,),
    ),
    **dict.fromkeys(
        (
            "push_to_hub",
            "hub_always_push",
            "auto_find_batch_size",
            "bf16_full_eval",
            "fp16_full_eval",
            "use_liger_kernel",
            "eval_use_gather_object",
            "batch_eval_metrics",
            "save_on_each_node",
            "ignore_data_skip",
            "full_determinism",
            "group_by_length",
            "include_inputs_for_metrics",
        ),
        (False,),
    ),
    **dict.fromkeys(
        (
            "average_tokens_across_devices",
            "eval_do_concat_batches",
            "dataloader_in_order",
            "skip_memory_metrics",
            "save_safetensors",
            "log_on_each_node",
        ),
        (True,),
    ),
    **dict.fromkeys(("do_train", "do_eval", "do_predict"), (False, True)),
    "hub_strategy": ("every_save",),
    "debug": ("", []),
    "local_rank": (-1,),
    "log_level_replica": ("warning",),
}


def _taken(name: str, value: Any) -> bool:
    return any(type(value) is type(v) and value == v for v in TAKEN_AS_IS.get(name, ()))


def hf_only_problem(name: str, value: Any) -> str | None:
    """Return why trainfold refuses ``name=value`` (an HF setting or a removed one), or ``None`` (a no-op value).

    >>> hf_only_problem("deepspeed", "ds.json").split(": ", 1)[1]
    'DeepSpeed is not supported; trainfold trains data parallel under torchrun'
    """
    if name in REMOVED:
        return f"{name}={value!r} was removed from trainfold: {REMOVED[name]}"
    if name not in HF_ONLY or _taken(name, value):
        return None
    why = HF_ONLY[name].replace("{value}", repr(value))
    return f"{name}={value!r} is a transformers.TrainingArguments setting that trainfold does not take: {why}"
