"""``train(model, args, prompts, reward_funcs)``: GRPO as a run of ``trainfold.train``, with TRL 1.16's semantics.

The run is ``trainfold.train`` fed by the :class:`~trainfold.grpo.schedule.GRPORun`'s
:class:`~trainfold.data.StateStream`, so it has every piece of a run: checkpoints (periodic,
best, JIT on SIGTERM), bitwise resume, reporters, the console, evaluation. What GRPO adds is the
generation schedule of TRL's ``GRPOTrainer`` (``trainfold.grpo.schedule``); each step that
generated logs TRL's metrics of its generations (``grpo_metrics``), every step logs the
objective's ``kl`` (``beta > 0``), ``entropy`` and ``clip_ratio/*``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from torch import Tensor, nn

from trainfold.grpo.args import GRPOArguments
from trainfold.grpo.loop import make_rollout
from trainfold.grpo.objective import grpo_objective
from trainfold.grpo.rewards import RewardFunc
from trainfold.grpo.schedule import BUFFER, GenerationBuffer, GRPORun
from trainfold.trainer.model_source import model_from, processing_class_for
from trainfold.trainer.train import TrainResult
from trainfold.trainer.train import train as train_run

__all__ = ["BUFFER", "GenerationBuffer", "GRPORun", "grpo_stream", "train"]


def _codec(processing_class: Any, encode: Any, decode: Any) -> tuple[Callable[..., list[int]], Callable[..., Any]]:
    if processing_class is None:
        if encode is None or decode is None:
            raise TypeError(
                "grpo train needs encode= and decode= (prompt -> token ids, ids -> completion), "
                "or processing_class= (a transformers tokenizer)"
            )
        return encode, decode
    tok = processing_class

    def tok_encode(prompt: Any) -> list[int]:
        if not isinstance(prompt, str):  # conversational: the chat template with the generation prompt
            prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return list(tok(prompt, add_special_tokens=False)["input_ids"])

    return encode or tok_encode, decode or (lambda ids: tok.decode(ids, skip_special_tokens=True))


def _run_problems(args: GRPOArguments, prompts: Any, funcs: tuple[RewardFunc, ...]) -> list[str]:
    problems = []
    if not funcs:
        problems.append("give at least one reward function")
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
        problems.append(f"got {len(args.reward_weights)} reward_weights for {len(funcs)} reward functions")
    if not hasattr(prompts, "__len__") or not hasattr(prompts, "__getitem__"):
        problems.append(f"prompts must be a map-style dataset (len and indexing), not {type(prompts).__name__}")
    elif len(prompts) < args.prompts_per_generation:
        problems.append(
            f"{len(prompts)} prompts fill no generation of {args.prompts_per_generation} prompts "
            f"(per_device_train_batch_size x steps_per_generation / num_generations); use smaller batches"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        problems.append("the GRPO run is single-process for now; run it without torchrun")
    return problems


def _rollout(
    model: nn.Module, args: GRPOArguments, funcs: tuple[RewardFunc, ...], codec: tuple, eos: Any, pad: int, key: str
) -> Any:
    """Return the hand loop's sampling and scoring with the run's settings (the run keeps its own buffer)."""
    return make_rollout(
        model,
        funcs,
        encode=codec[0],
        decode=codec[1],
        num_generations=args.num_generations,
        max_new_tokens=args.max_completion_length,
        steps_per_generation=args.generation_steps,
        num_iterations=args.num_iterations,
        temperature=args.temperature,
        eos_token_id=eos,
        pad_token_id=pad,
        reward_weights=args.reward_weights,
        scale_rewards=args.scale_rewards,
        prompt_key=key,
        multi_objective_aggregation=args.multi_objective_aggregation,
    )


def _datasets(prompts: Any, eval_prompts: Any, run: dict[str, Any]) -> tuple[Any, Any]:
    """Return the prompts and eval prompts, given by trainfold's names or TRL's (taken out of ``run``)."""
    refused = sorted({"objective", "train_stream", "compute_loss_func"} & set(run))
    if refused:
        raise TypeError(f"grpo train sets {refused} itself; pass prompts, eval_prompts and reward_funcs instead")
    for trl_name, ours, given in (
        ("train_dataset", "prompts", prompts),
        ("eval_dataset", "eval_prompts", eval_prompts),
    ):
        if trl_name in run and given is not None:
            raise TypeError(f"grpo train got {ours} and {trl_name} (TRL's name for it); give one of them")
    prompts, eval_prompts = run.pop("train_dataset", prompts), run.pop("eval_dataset", eval_prompts)
    if prompts is None:
        raise TypeError("grpo train needs the prompts: train(model, args, prompts, reward_funcs)")
    return prompts, eval_prompts


def _reward_funcs(reward_funcs: Any) -> tuple[RewardFunc, ...]:
    """Return the reward functions as a tuple; refuse TRL's reward models (a name or a module) by name."""
    funcs = (reward_funcs,) if callable(reward_funcs) or isinstance(reward_funcs, str) else tuple(reward_funcs or ())
    models = [f if isinstance(f, str) else type(f).__name__ for f in funcs if isinstance(f, (str, nn.Module))]
    if models:
        raise TypeError(
            f"reward models ({models}) are not supported: trainfold calls reward functions only; wrap the model "
            "in a function reward(prompts, completions, **kwargs) -> list[float] that scores with it"
        )
    return funcs


def grpo_stream(
    model: nn.Module | str,
    args: GRPOArguments,
    prompts: Any,
    reward_funcs: RewardFunc | Sequence[RewardFunc] | None,
    *,
    encode: Any = None,
    decode: Any = None,
    processing_class: Any = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    prompt_key: str = "prompt",
    ref_params: Any = None,
    eval_prompts: Any = None,
    peft_config: Any = None,
) -> GRPORun:
    """Return the run's :class:`GRPORun`, checked (its ``stream()`` is what ``train`` feeds ``trainfold.train``)."""
    if not isinstance(args, GRPOArguments):
        raise TypeError(
            f"grpo train takes GRPOArguments (TrainingArguments + TRL's GRPOConfig names), not "
            f"{type(args).__name__}; convert a trl.GRPOConfig with GRPOArguments.from_hf(config)"
        )
    module: nn.Module = model_from(model, args.model_init_kwargs, peft_config, seed=args.seed)  # TRL's adapter too
    if args.disable_dropout:  # as TRL: no dropout in the policy
        for m in module.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    if encode is None and decode is None:  # as TRL: the tokenizer saved with the model when none is given
        processing_class = processing_class_for(module, processing_class)
    funcs = _reward_funcs(reward_funcs)
    problems = _run_problems(args, prompts, funcs)
    if problems:
        raise ValueError("cannot run GRPO: " + "; ".join(problems))
    enc, dec = _codec(processing_class, encode, decode)
    tok = processing_class
    eos = eos_token_id if eos_token_id is not None else getattr(tok, "eos_token_id", None)
    pad = pad_token_id if pad_token_id is not None else getattr(tok, "pad_token_id", None)
    if ref_params is None and args.beta != 0:  # TRL's reference: the model as it was given
        ref_params = {k: v for k, v in module.named_parameters() if v.requires_grad}
    if ref_params is not None:  # its own copy: train trains the module's storage in place
        ref_params = {k: v.detach().clone() for k, v in ref_params.items()}
    policy = attrs.asdict(args.policy_loss)
    objective = grpo_objective(
        policy.pop("loss_type"),
        policy.pop("epsilon"),
        policy.pop("epsilon_high"),
        args.beta,
        args.temperature,
        args.max_completion_length,
        args.use_bias_correction_kl,
        **policy,
    )
    pad = pad if pad is not None else (eos or 0)
    rollout = _rollout(module, args, funcs, (enc, dec), eos, pad, prompt_key)
    ref = ref_params if args.beta != 0 else None
    parts = (module, args, prompts, funcs, enc, dec, eos, pad, prompt_key, ref, eval_prompts, objective, rollout)
    return GRPORun(*parts, processing_class=processing_class)


def train(
    model: nn.Module | str,
    args: GRPOArguments,
    prompts: Any = None,
    reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
    *,
    eval_prompts: Any = None,
    encode: Callable[[Any], list[int]] | None = None,
    decode: Callable[[list[int]], Any] | None = None,
    processing_class: Any = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    prompt_key: str = "prompt",
    ref_params: Mapping[str, Tensor] | None = None,
    peft_config: Any = None,
    **run: Any,
) -> TrainResult:
    """Train ``model`` with GRPO on ``prompts`` scored by ``reward_funcs``, as TRL's ``GRPOTrainer`` does.

    ``prompts`` (TRL's ``train_dataset``) has a ``prompt_key`` column; its others reach each reward function
    ``fn(prompts, completions, completion_ids=..., **columns) -> list[float | None]`` by keyword. Prompts are
    tokenized with ``encode`` (read back with ``decode``) or a tokenizer. ``eval_prompts`` (``eval_dataset``) are
    scored at each evaluation (``eval_reward``...). With ``beta > 0`` the KL is taken to ``ref_params`` (default:
    the weights as given). ``model`` may be a name or path; ``peft_config`` wraps it (the adapter drawn from
    ``args.seed``, as TRL's). Other keywords go to ``trainfold.train``.

    >>> import tempfile, torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> def sevens(prompts, completions, **_): return [c.count("7") / 3 for c in completions]
    >>> args = GRPOArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4,
    ...                      num_generations=2, max_completion_length=3, report_to="none", disable_tqdm=True,
    ...                      save_strategy="no", logging_steps=1)
    >>> result = train(model, args, [{"prompt": "12"}, {"prompt": "3"}], sevens,
    ...                encode=lambda s: [1 + int(c) for c in s], decode=lambda ids: "".join(str(i % 10) for i in ids))
    >>> result.global_step, {"reward", "rewards/sevens/mean", "entropy"} <= set(result.log_history[0])
    (2, True)
    """
    prompts, eval_prompts = _datasets(prompts, eval_prompts, run)  # TRL's train_dataset=, eval_dataset= too
    plan = grpo_stream(
        model,
        args,
        prompts,
        reward_funcs,
        encode=encode,
        decode=decode,
        processing_class=processing_class,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        prompt_key=prompt_key,
        ref_params=ref_params,
        eval_prompts=eval_prompts,
        peft_config=peft_config,
    )
    stream = plan.stream()  # a processing_class is saved into every checkpoint, as the Trainer's
    given = dict(eval_dataset=eval_prompts, objective=plan.objective, processing_class=plan.processing_class)
    return train_run(plan.model, args, prompts, train_stream=stream, **given, **run)
