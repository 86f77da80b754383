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
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from torch import Tensor, nn

from trainfold.grpo.args import GRPOArguments
from trainfold.grpo.objective import GRPOObjective, grpo_objective
from trainfold.grpo.rewards import RewardFunc
from trainfold.grpo.rollouts import BatchedEngine, Rollouts
from trainfold.grpo.schedule import BUFFER, Codec, GenerationBuffer, GRPORun
from trainfold.rollout import ProcessEngine, RolloutEngine
from trainfold.trainer.model_source import model_from, processing_class_for
from trainfold.trainer.train import TrainResult
from trainfold.trainer.train import train as train_run

__all__ = ["BUFFER", "Codec", "GenerationBuffer", "GRPORun", "grpo_stream", "train"]


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
    codec: Codec | None = None,
    processing_class: Any = None,
    prompt_key: str = "prompt",
    ref_params: Mapping[str, Tensor] | None = None,
    eval_prompts: Any = None,
    peft_config: Any = None,
    engine: RolloutEngine | None = None,
) -> GRPORun:
    """Return the run's :class:`GRPORun`, checked: its ``stream()`` is what ``train`` runs, and what a research
    loop runs with ``trainfold.loop.run(step, state, run.stream(), hooks=...)`` (``step`` trains ``run.objective``).

    >>> import torch
    >>> from trainfold import init_state, loop, make_step, sgd
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> def sevens(prompts, completions, **_): return [c.count("7") / 3 for c in completions]
    >>> args = GRPOArguments(per_device_train_batch_size=4, num_generations=2, max_completion_length=3)
    >>> codec = Codec(lambda s: [1 + int(c) for c in s], lambda ids: "".join(str(i % 10) for i in ids))
    >>> run = grpo_stream(model, args, [{"prompt": "12"}, {"prompt": "3"}], sevens, codec=codec)
    >>> step = make_step(model, optimizer=sgd(0.1), objective=run.objective)
    >>> state, log = loop.run(step, init_state(model, sgd(0.1), seed=args.seed), run.stream(),
    ...                       stop=lambda s: int(s.step) >= 2, hooks=[loop.log(every=1)])
    >>> int(state.step), len(log.history), {"loss", "reward", "rewards/sevens/mean"} <= set(state.metrics)
    (2, 2, True)

    Generation runs on ``args.rollout_engine`` (``trainfold.grpo.rollouts``), built at the first step; ``engine``
    is a built one instead (``rollout_engine="vllm"`` needs it: ``trainfold.rollout.VLLMEngine(base_url,
    model_name)``). ``run.rollouts.close()`` frees it (``train`` does).
    """
    if not isinstance(args, GRPOArguments):
        raise TypeError(
            f"grpo train takes GRPOArguments (TrainingArguments + TRL's GRPOConfig names), not "
            f"{type(args).__name__}; convert a trl.GRPOConfig with GRPOArguments.from_hf(config)"
        )
    module = _policy(model, args, peft_config)
    if codec is None:  # as TRL: the tokenizer saved with the model when none is given
        processing_class = processing_class_for(module, processing_class)
    funcs = _reward_funcs(reward_funcs)
    problems = _run_problems(args, prompts, funcs)
    if problems:
        raise ValueError("cannot run GRPO: " + "; ".join(problems))
    if codec is None and processing_class is None:
        raise TypeError(
            "grpo train needs codec=trainfold.grpo.Codec(encode, decode) (prompt -> token ids, ids -> completion), "
            "or processing_class= (a transformers tokenizer)"
        )
    if ref_params is None and args.beta != 0:  # TRL's reference: the model as it was given
        ref_params = {k: v for k, v in module.named_parameters() if v.requires_grad}
    codec = codec or Codec.of(processing_class)  # its own copy of the reference: train trains the module in place
    ref = None if args.beta == 0 or ref_params is None else {k: v.detach().clone() for k, v in ref_params.items()}
    parts = (module, args, prompts, funcs, codec, args.sampling, _objective(args), prompt_key, ref, eval_prompts)
    rollouts = _rollouts(module, args, codec, engine)
    return GRPORun(*parts, processing_class=processing_class, rollouts=rollouts)


def _rollouts(module: nn.Module, args: GRPOArguments, codec: Codec, engine: RolloutEngine | None) -> Rollouts:
    """Return the run's rollouts: the engine ``args.rollout_engine`` names (built at the first step), or ``engine``."""
    kind = args.rollout_engine
    if engine is not None and not isinstance(engine, RolloutEngine):
        raise TypeError(f"engine={type(engine).__name__} is not a trainfold.rollout.RolloutEngine")
    if engine is None and kind == "vllm":
        raise ValueError(
            "rollout_engine='vllm' needs a served model: pass engine=trainfold.rollout.VLLMEngine(base_url, "
            "model_name) to grpo train / grpo_stream (vllm serve with the weight-transfer API)"
        )

    def make(state: Any) -> RolloutEngine:
        if engine is not None:
            return engine
        if kind == "process":
            return ProcessEngine(module, eos_token_id=codec.eos_token_id, pad_token_id=codec.pad)
        return BatchedEngine(module, state.buffers, eos_token_id=codec.eos_token_id, pad_token_id=codec.pad)

    return Rollouts(args.rollout, args.sampling, make)


def _policy(model: nn.Module | str, args: GRPOArguments, peft_config: Any) -> nn.Module:
    """Return the policy module: loaded when ``model`` is a name, wrapped by TRL's adapter, without dropout if asked."""
    module: nn.Module = model_from(model, args.model_init_kwargs, peft_config, seed=args.seed)
    if args.disable_dropout:  # as TRL: no dropout in the policy
        for m in module.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    return module


def _objective(args: GRPOArguments) -> GRPOObjective:
    """Return the run's objective from its policy-loss settings."""
    policy = attrs.asdict(args.policy_loss)
    return grpo_objective(
        policy.pop("loss_type"),
        policy.pop("epsilon"),
        policy.pop("epsilon_high"),
        args.beta,
        args.temperature,
        args.max_completion_length,
        args.use_bias_correction_kl,
        **policy,
    )


def train(
    model: nn.Module | str,
    args: GRPOArguments,
    prompts: Any = None,
    reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
    *,
    eval_prompts: Any = None,
    codec: Codec | None = None,
    processing_class: Any = None,
    prompt_key: str = "prompt",
    ref_params: Mapping[str, Tensor] | None = None,
    peft_config: Any = None,
    engine: RolloutEngine | None = None,
    **run: Any,
) -> TrainResult:
    """Train ``model`` with GRPO on ``prompts`` scored by ``reward_funcs``, as TRL's ``GRPOTrainer`` does.

    ``prompts`` (TRL's ``train_dataset``) has a ``prompt_key`` column; its others reach each reward function
    ``fn(prompts, completions, completion_ids=..., **columns) -> list[float | None]`` by keyword. Prompts are
    tokenized by ``codec`` (a :class:`Codec`: ``encode``, ``decode``, the eos and pad ids) or by the tokenizer
    ``processing_class`` (default: the one saved with the model). ``eval_prompts`` (``eval_dataset``) are
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
    >>> codec = Codec(lambda s: [1 + int(c) for c in s], lambda ids: "".join(str(i % 10) for i in ids))
    >>> result = train(model, args, [{"prompt": "12"}, {"prompt": "3"}], sevens, codec=codec)
    >>> result.global_step, {"reward", "rewards/sevens/mean", "entropy"} <= set(result.log_history[0])
    (2, True)
    """
    prompts, eval_prompts = _datasets(prompts, eval_prompts, run)  # TRL's train_dataset=, eval_dataset= too
    plan = grpo_stream(
        model,
        args,
        prompts,
        reward_funcs,
        codec=codec,
        processing_class=processing_class,
        prompt_key=prompt_key,
        ref_params=ref_params,
        eval_prompts=eval_prompts,
        peft_config=peft_config,
        engine=engine,
    )
    stream = plan.stream()  # a processing_class is saved into every checkpoint, as the Trainer's
    given = dict(eval_dataset=eval_prompts, objective=plan.objective, processing_class=plan.processing_class)
    try:
        return train_run(plan.model, args, prompts, train_stream=stream, **given, **run)
    finally:
        if plan.rollouts is not None:
            plan.rollouts.close()
