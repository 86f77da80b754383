"""``GRPOArguments``: ``TrainingArguments`` plus TRL's ``GRPOConfig`` names, and TRL's prompt order.

The GRPO settings keep TRL 1.16's names, meanings and defaults: ``per_device_train_batch_size``
counts completions; ``steps_per_generation`` counts **micro-steps** (micro-batches) and defaults to
``gradient_accumulation_steps``, so one generation of ``per_device_train_batch_size ×
steps_per_generation`` completions feeds that many micro-batches, and is trained on
``num_iterations`` times before the next one. A TRL setting trainfold cannot honour exactly is
refused by name, with the reason (``TRL_ONLY``); a value that asks for what trainfold does anyway
is taken.

>>> args = GRPOArguments(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
>>> args.generation_steps, args.generation_batch, args.prompts_per_generation
(2, 8, 2)
>>> try:
...     GRPOArguments(use_vllm=True)
... except TypeError as e:
...     print(str(e).replace("a trl.GRPOConfig setting that trainfold does not take", "not taken").split(";")[0])
use_vllm=True is not taken: generation runs on the rollout engine GRPOArguments.rollout_engine names
>>> generation_order(6, 2, seed=0, epoch=0)  # TRL's RepeatSampler: a seeded permutation, whole chunks
[[2, 5], [3, 0], [1, 4]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from trainfold.grpo.data import GenerationSchedule, Sampling
from trainfold.grpo.global_rng import GENERATION_RNGS, global_problems
from trainfold.grpo.loss import PolicyLoss, policy_loss_errors
from trainfold.grpo.rewards import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS
from trainfold.rollout.staleness import IMPORTANCE_SAMPLING_MODES
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.setting import redeclared, setting

__all__ = ["GRPOArguments", "ROLLOUT_ENGINES", "RolloutPlan", "TRL_ONLY", "generation_order"]

ROLLOUT_ENGINES = ("local", "process", "vllm")


@attrs.frozen
class RolloutPlan:
    """Where a GRPO run generates and how off-policy samples are corrected (``GRPOArguments.rollout``).

    ``engine``: ``"local"`` (in process, ``core.generate`` as before), ``"process"`` (a generation server
    process, ``trainfold.rollout.ProcessEngine``), ``"vllm"``; ``max_staleness``: weight versions a generation
    may lag the step that trains on it (0: on-policy); ``correction``: TRL's importance-sampling correction as
    ``(mode, clip_min, clip_max)``, ``None`` where it does not apply (see ``GRPOArguments.rollout``).
    """

    engine: str = "local"
    max_staleness: int = 0
    correction: tuple[str, float | None, float | None] | None = None


_BASE = attrs.fields(TrainingArguments)
# max_length: max_completion_length bounds what is generated
_NOT_GRPOS = (
    (_BASE.packing, False),
    (_BASE.padding_free, False),
    (_BASE.loss_chunk_size, 0),
    (_BASE.label_smoothing_factor, 0.0),
    (_BASE.neftune_noise_alpha, None),
    (_BASE.max_length, None),
)

_VLLM = (
    "generation runs on the rollout engine GRPOArguments.rollout_engine names; set use_vllm=False "
    "(rollout_engine='vllm' with train(..., engine=trainfold.rollout.VLLMEngine(...)) for a vLLM server)"
)
_SAMPLING = "trainfold.core.generate samples from softmax(logits / temperature) only"
_NOT_YET = "not supported by trainfold's GRPO run yet"

# name -> (the value that asks for nothing trainfold does not do, why other values are refused)
TRL_ONLY: dict[str, tuple[Any, str]] = {
    "use_vllm": (False, _VLLM),
    **{
        name: (None, _VLLM)
        for name in (
            "vllm_mode",
            "vllm_server_base_url",
            "vllm_model_impl",
            "vllm_gpu_memory_utilization",
        )
    },
    "top_k": (0, _SAMPLING),
    "min_p": (None, _SAMPLING),
    "repetition_penalty": (1.0, _SAMPLING),
    "generation_kwargs": (None, _SAMPLING),
    "cache_implementation": (None, _SAMPLING),
    "mask_truncated_completions": (False, _NOT_YET),
    "top_entropy_quantile": (1.0, _NOT_YET),
    "entropy_coef": (0.0, "the entropy bonus is " + _NOT_YET),
    "use_adaptive_entropy": (False, _NOT_YET),
    "sync_ref_model": (False, "TR-DPO style reference syncing is " + _NOT_YET),
    "off_policy_mask_threshold": (None, _NOT_YET),
    "num_generations_eval": (None, "evaluation samples num_generations completions per prompt"),
    "max_tool_calling_iterations": (None, "tool calling is " + _NOT_YET),
    "log_completions": (False, "completions are not logged as tables; pass an observer"),
}


def _trl_problem(name: str, value: Any) -> str | None:
    taken, why = TRL_ONLY[name]
    if value == taken or (taken is None and value is None):
        return None
    return f"{name}={value!r} is a trl.GRPOConfig setting that trainfold does not take: {why}"


def _check_grpo(args: GRPOArguments) -> list[str]:
    out = []
    b, g = args.per_device_train_batch_size, args.num_generations
    if args.steps_per_generation is not None and args.generation_batch_size is not None:
        out.append("set steps_per_generation or generation_batch_size, not both (as in TRL)")
    elif args.generation_batch_size is not None and (args.generation_batch_size < 1 or args.generation_batch_size % b):
        out.append(
            f"generation_batch_size={args.generation_batch_size} must be a positive multiple of "
            f"per_device_train_batch_size={b}"
        )
    if args.steps_per_generation is not None and args.steps_per_generation < 1:
        out.append(f"steps_per_generation={args.steps_per_generation} must be >= 1 (micro-steps per generation)")
    if g < 2:
        out.append(f"num_generations={g} must be >= 2 (advantages compare completions of one prompt)")
    elif not out and args.generation_batch % g:
        out.append(
            f"the generation batch per_device_train_batch_size x steps_per_generation = {b} x "
            f"{args.generation_steps} = {args.generation_batch} is not divisible by num_generations={g}: "
            "a generation must hold whole prompt groups"
        )
    for name in ("num_iterations", "max_completion_length"):
        if getattr(args, name) < 1:
            out.append(f"{name}={getattr(args, name)} must be >= 1")
    out += policy_loss_errors(args.policy_loss)
    if args.beta < 0:
        out.append(f"beta={args.beta} must be >= 0")
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if not (0 <= args.epsilon < 1 and high >= 0):
        out.append(f"epsilon={args.epsilon} must be in [0, 1) and epsilon_high={high} >= 0")
    if not args.temperature > 0:
        out.append(f"temperature={args.temperature} must be > 0 (log-probs are computed at this temperature)")
    if args.top_p != 1.0:
        out.append(f"top_p={args.top_p} is not supported: {_SAMPLING}; set top_p=1.0")
    if args.reward_weights is not None and not args.reward_weights:
        out.append("reward_weights=() gives no weight; pass one per reward function, or None for all 1.0")
    out += _rollout_problems(args)
    for field, fix in _NOT_GRPOS:  # settings of a token-level causal-LM loss that GRPO's objective does not have
        value = getattr(args, field.name)
        if value not in (False, 0, None):
            out.append(f"{field.name}={value!r} does not apply to GRPO's objective; set {field.name}={fix!r}")
    if args.train_sampling_strategy != "random":
        out.append(
            f"train_sampling_strategy={args.train_sampling_strategy!r}: GRPO draws prompts in TRL's "
            "RepeatSampler order; use shuffle_dataset=False for dataset order"
        )
    return out


def _rollout_problems(args: GRPOArguments) -> list[str]:
    out = []
    cap, high = args.vllm_importance_sampling_cap, args.vllm_importance_sampling_clip_max
    if cap is not None and high not in (cap, 3.0):
        out.append(
            f"vllm_importance_sampling_cap={cap} (TRL's deprecated name of vllm_importance_sampling_clip_max) and "
            f"vllm_importance_sampling_clip_max={high} disagree; set vllm_importance_sampling_clip_max only"
        )
    plan = args.rollout
    out += global_problems(args.sampling.rng, plan.engine, plan.max_staleness)
    if plan.correction is not None:
        mode, low, high = plan.correction
        if low is not None and high is not None and low >= high:
            out.append(f"vllm_importance_sampling_clip_min={low} must be < vllm_importance_sampling_clip_max={high}")
        if mode.endswith("truncate") and low is None and high is None:
            out.append(
                f"vllm_importance_sampling_mode={mode!r} needs vllm_importance_sampling_clip_min or _clip_max "
                "(both are None)"
            )
        if args.loss_type == "vespo":
            out.append(
                "loss_type='vespo' with the importance-sampling correction (rollout_engine != 'local' or "
                "max_staleness > 0): TRL feeds the ratio into vespo's weights, trainfold does not yet; set "
                "vllm_importance_sampling_correction=False"
            )
    return out


@attrs.frozen(init=False)
class GRPOArguments(TrainingArguments):
    """``TrainingArguments`` plus TRL ``GRPOConfig``'s GRPO settings (TRL 1.16's defaults).

    ``per_device_train_batch_size`` counts completions. ``steps_per_generation`` (micro-steps;
    default ``gradient_accumulation_steps``) or ``generation_batch_size`` (completions) sizes one
    generation. ``scale_rewards`` takes ``"group"``, ``"batch"``, ``"none"`` (``True``/``False`` as
    TRL). ``top_p`` must stay 1.0.

    >>> GRPOArguments(scale_rewards=False, reward_weights=[1, 0.5]).scale_rewards
    'none'
    >>> try:
    ...     GRPOArguments(per_device_train_batch_size=3, num_generations=2)
    ... except ValueError as e:
    ...     print(str(e).split(" = ")[-1])
    3 is not divisible by num_generations=2: a generation must hold whole prompt groups
    """

    # TRL's GRPOConfig defaults where they differ from TrainingArguments' (bf16 stays False: TRL resolves its
    # None to not fp16, True on every device; from_hf takes the resolved value; docs/rl.md says so)
    learning_rate: float = redeclared(_BASE.learning_rate, 1e-6)
    logging_steps: float = redeclared(_BASE.logging_steps, 10)
    gradient_checkpointing: bool | None = redeclared(_BASE.gradient_checkpointing, True)
    remove_unused_columns: bool = redeclared(_BASE.remove_unused_columns, False)
    num_generations: int = 8
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    num_iterations: int = 1
    max_completion_length: int = 512
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = setting(
        "group", choices=SCALE_REWARDS, converter=lambda v: ("group" if v else "none") if isinstance(v, bool) else v
    )
    reward_weights: tuple[float, ...] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    shuffle_dataset: bool = True
    use_bias_correction_kl: bool = True
    # the policy loss's other settings (trainfold.grpo.loss.PolicyLoss) and GDPO's reward aggregation
    importance_sampling_level: str = "token"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    multi_objective_aggregation: str = setting("sum_then_normalize", choices=MULTI_OBJECTIVE_AGGREGATIONS)
    disable_dropout: bool = False  # TRL's: every nn.Dropout of the policy at p=0
    model_init_kwargs: dict[str, Any] | None = None  # from_pretrained's keywords when the model is a name or path
    # the rollout engine (trainfold.rollout) and TRL's importance-sampling correction of off-policy samples
    rollout_engine: str = setting("local", choices=ROLLOUT_ENGINES, hf=None)
    max_staleness: int = setting(0, range="[0, inf)", hf=None)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = setting("sequence_mask", choices=IMPORTANCE_SAMPLING_MODES)
    vllm_importance_sampling_clip_max: float | None = setting(3.0, range="(0, inf)")
    vllm_importance_sampling_clip_min: float | None = setting(None, range="[0, inf)")
    vllm_importance_sampling_cap: float | None = setting(None, range="(0, inf)")
    # where completions draw their randomness (trainfold.grpo.global_rng): None is the entry point's, "keyed" for
    # trainfold.grpo.train, "global" (TRL's order) for the GRPOTrainer facade
    generation_rng: str | None = setting(None, choices=(None, *GENERATION_RNGS), hf=None)

    def __init__(self, **kwargs: Any) -> None:
        trl = [p for p in (_trl_problem(k, v) for k, v in kwargs.items() if k in TRL_ONLY) if p is not None]
        if trl:
            raise TypeError("\n".join(trl))
        super().__init__(**{k: v for k, v in kwargs.items() if k not in TRL_ONLY})

    @classmethod
    def combined_checks(cls) -> tuple[Callable[[Any], list[str]], ...]:
        """Return ``TrainingArguments``' checks of settings together, and GRPO's."""
        return (*super().combined_checks(), _check_grpo)

    @classmethod
    def checked_from_hf(cls) -> dict[str, Callable[[Any], str | None]]:
        """Return the judges of TRL's settings that ``GRPOArguments`` does not take (``TRL_ONLY``)."""
        return {name: functools.partial(_trl_problem, name) for name in TRL_ONLY}

    @classmethod
    def resolved_from_hf(cls, settings: dict[str, Any], config: Any) -> dict[str, Any]:
        """Keep ``steps_per_generation`` of a ``GRPOConfig`` that filled in both it and ``generation_batch_size``.

        TRL's ``generation_batch_size`` counts the completions of all processes (``per_device_train_batch_size
        × world_size × steps_per_generation``); a pair that disagrees (one changed after parsing) is refused.
        """
        fields = attrs.fields(cls)
        steps, size = settings.get(fields.steps_per_generation.name), settings.get(fields.generation_batch_size.name)
        if steps is None or size is None:
            return settings
        world = int(getattr(config, "world_size", 1) or 1)
        expected = settings.get(fields.per_device_train_batch_size.name, 8) * world * steps
        if size != expected:
            raise ValueError(
                f"{type(config).__name__} has generation_batch_size={size} and steps_per_generation={steps}, which "
                f"disagree (per_device_train_batch_size x world_size x steps_per_generation = {expected}); set one"
            )
        return {k: v for k, v in settings.items() if k != fields.generation_batch_size.name}

    @property
    def policy_loss(self) -> PolicyLoss:
        """Return the policy loss's settings (``epsilon_high`` defaults to ``epsilon``)."""
        names = attrs.fields_dict(PolicyLoss)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return PolicyLoss(**{**{k: getattr(self, k) for k in names}, "epsilon_high": high})

    @property
    def generation_steps(self) -> int:
        """Return TRL's resolved ``steps_per_generation``: micro-steps that one generation feeds."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size // self.per_device_train_batch_size
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def generation_batch(self) -> int:
        """Return the completions of one generation (``per_device_train_batch_size × steps_per_generation``)."""
        return self.per_device_train_batch_size * self.generation_steps

    @property
    def prompts_per_generation(self) -> int:
        """Return the distinct prompts of one generation."""
        return self.generation_batch // self.num_generations

    @property
    def generation_schedule(self) -> GenerationSchedule:
        """Return the run's schedule (``trainfold.grpo.data``): TRL's, in micro-steps."""
        return GenerationSchedule(self.generation_steps, self.num_iterations, self.gradient_accumulation_steps)

    @property
    def sampling(self) -> Sampling:
        """Return what one generation is: completions per prompt, their length and temperature, reward scaling."""
        weights = None if self.reward_weights is None else tuple(float(w) for w in self.reward_weights)
        return Sampling(
            self.num_generations,
            self.max_completion_length,
            self.temperature,
            weights,
            self.scale_rewards,
            self.multi_objective_aggregation,
            self.generation_rng or "keyed",
        )

    @property
    def rollout(self) -> RolloutPlan:
        """Return the run's rollout plan: engine, staleness bound and the importance-sampling correction.

        As TRL applies ``vllm_importance_sampling_correction`` only where the sampler is not the trainer (vLLM),
        trainfold applies it where the engine's weights or code differ from the step's: ``rollout_engine``
        other than ``"local"``, or ``max_staleness > 0``. The local engine at staleness 0 samples with the
        step's own weights and code (ratio 1), the run of earlier versions bitwise.

        >>> GRPOArguments(max_staleness=1).rollout.correction
        ('sequence_mask', None, 3.0)
        >>> GRPOArguments().rollout.correction is None
        True
        """
        applies = self.vllm_importance_sampling_correction and (
            self.rollout_engine != "local" or self.max_staleness > 0
        )
        high = self.vllm_importance_sampling_clip_max
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name of clip_max
            high = self.vllm_importance_sampling_cap
        correction = (self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min, high)
        return RolloutPlan(self.rollout_engine, self.max_staleness, correction if applies else None)

    @property
    def records_old_logps(self) -> bool:
        """Whether the trainer's log-probs of each generation are kept: a generation outlives an optimizer step
        (TRL's rule), or the importance-sampling correction needs them (``rollout``)."""
        return self.generation_schedule.records_old_logps or self.rollout.correction is not None


@functools.lru_cache(maxsize=8)
def _permutations(num_prompts: int, seed: int, epochs: int) -> tuple[tuple[int, ...], ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randperm(num_prompts, generator=g).tolist()) for _ in range(epochs))


def generation_order(
    num_prompts: int, prompts_per_generation: int, *, seed: int, epoch: int, shuffle: bool = True
) -> list[list[int]]:
    """Return epoch ``epoch``'s generations as lists of prompt indices, in TRL's ``RepeatSampler`` order.

    TRL's sampler draws one ``torch.randperm`` per epoch from one generator seeded with ``seed``,
    cuts it into chunks of ``prompts_per_generation`` and drops an incomplete last chunk; the
    repeats (``num_generations`` per prompt, ``num_iterations × steps_per_generation`` per chunk)
    are the run's, not the order's.

    >>> generation_order(5, 2, seed=0, epoch=0, shuffle=False)
    [[0, 1], [2, 3]]
    """
    order = list(range(num_prompts)) if not shuffle else list(_permutations(num_prompts, seed, epoch + 1)[epoch])
    chunks = [order[i : i + prompts_per_generation] for i in range(0, num_prompts, prompts_per_generation)]
    return [c for c in chunks if len(c) == prompts_per_generation]
