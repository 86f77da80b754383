"""GRPO's hand-written loop for research code: ``make_rollout`` and ``grpo_trajectory``.

``grpo_trajectory(step, state, prompt_stream, rollout)`` is a plain fold over the schedule the GRPO run
uses too (``grpo_data``, TRL's units): a generation holds ``steps_per_generation`` micro-batches
(micro-steps; or ``optimizer_steps_per_generation`` optimizer steps), is made by one ``rollout`` call
with the latest state, and micro-step ``k`` trains on its slice ``k % steps_per_generation``,
``num_iterations`` passes over it. The run with TRL's prompt order, checkpoints and resume inside a
generation block is ``trainfold.grpo.train`` (``trainfold.grpo.run``). These names are also
importable from ``trainfold.grpo``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.chunked_loss import OutputHead
from trainfold.core.fold import never, trajectory
from trainfold.core.forward import train_mode
from trainfold.core.generate import functional_forward, generate
from trainfold.core.rng import derive_seed
from trainfold.core.state import TrainState
from trainfold.grpo.data import generation_batches
from trainfold.grpo.metrics import nanstd
from trainfold.grpo.objective import chunk_head, next_token_logps
from trainfold.grpo.rewards import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    RewardFunc,
    combine_rewards,
    reward_advantages,
    reward_name,
)
from trainfold.grpo.rows import before_eos, completion_rows

__all__ = ["Rollout", "Sampled", "grpo_trajectory", "make_rollout", "rollout_metrics"]

_GENERATION_TAG = 0x6E6E


@attrs.frozen(eq=False)
class Sampled:
    """One generation, sampled and scored: each row's completion ids, total reward, reward per function
    (``(rows, functions)``, NaN where a function gave None) and advantage."""

    completion_ids: list[list[int]]
    rewards: Tensor
    each: Tensor
    advantages: Tensor


@attrs.frozen(eq=False)
class Rollout:
    """Turn prompt micro-batches into training micro-batches with the latest state; see :func:`make_rollout`.

    >>> import torch
    >>> from trainfold import init_state, sgd
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> def length(prompts, completions, **_): return [float(len(c)) for c in completions]
    >>> rollout = make_rollout(model, length, encode=lambda s: [1 + int(c) for c in s],
    ...                        decode=lambda ids: "".join(str(i % 10) for i in ids), num_generations=2,
    ...                        max_new_tokens=3)
    >>> rollout.num_generations, rollout.records_old_logps
    (2, False)
    >>> state = init_state(model, sgd(0.1))
    >>> prompts = [{"prompt": ["12", "12"]}, {"prompt": ["3", "3"]}]  # 2 micro-batches, 2 generations each
    >>> out = rollout(state, prompts)
    >>> len(out), list(out[0]["input_ids"].shape), sorted(out[0])[:5]
    (2, [2, 5], ['advantages', 'attention_mask', 'completion_mask', 'generation_micro_batches', 'generation_tokens'])
    >>> again = rollout(state, prompts)  # sampled with a generator seeded from the state
    >>> all(torch.equal(a[k], b[k]) for a, b in zip(out, again) for k in a)
    True
    >>> try:
    ...     make_rollout(model, length, encode=list, decode=str, num_generations=1, max_new_tokens=3)
    ... except ValueError as e:
    ...     print(e)
    invalid rollout settings: num_generations=1 must be >= 2 (advantages compare completions of one prompt)
    """

    model: nn.Module
    reward_funcs: tuple[RewardFunc, ...]
    encode: Callable[[Any], list[int]]
    decode: Callable[[list[int]], Any]
    num_generations: int
    optimizer_steps_per_generation: int | None  # a generation's size in optimizer steps (None: the next field's)
    num_iterations: int
    max_new_tokens: int
    temperature: float
    eos_token_id: int | None
    pad_token_id: int
    reward_weights: tuple[float, ...] | None
    scale_rewards: str
    ref_params: Mapping[str, Tensor] | None
    prompt_key: str
    head: OutputHead | None = None  # set: old/ref log-probs chunk by chunk from the hidden states
    chunk_size: int = 0
    multi_objective_aggregation: str = "sum_then_normalize"  # or "normalize_then_sum" (GDPO)
    steps_per_generation: int | None = None  # or its size in micro-steps (TRL's unit)

    @property
    def records_old_logps(self) -> bool:
        """Whether a generation may outlive one optimizer step, so the sampling policy's log-probs are kept.

        With ``steps_per_generation`` (micro-steps) whenever it feeds more than one micro-step: the
        rollout does not know the accumulation that TRL's sharper rule (``GRPOArguments.records_old_logps``) reads.
        """
        size = self.steps_per_generation or self.optimizer_steps_per_generation or 1
        return size * self.num_iterations > 1

    def _logps(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], ids: Tensor, mask: Tensor) -> Tensor:
        with torch.no_grad(), train_mode(self.model, False):
            return next_token_logps(
                functional_forward(self.model, buffers),
                params,
                {"input_ids": ids, "attention_mask": mask},
                self.head,
                self.chunk_size,
                self.temperature,
            )

    def sample(
        self,
        state: TrainState,
        prompt_ids: Sequence[list[int]],
        prompts: Sequence[Any],
        columns: Mapping[str, list],
        seed: int | None = None,
    ) -> Sampled:
        """Sample a completion of each prompt with ``state.params``, score it and return the advantages over the
        rows' groups of ``num_generations`` (``completion_ids`` join the reward functions' columns, as TRL's).

        The generator is seeded from ``seed``, by default from ``(state.seed, state.step)``; the GRPO run
        (``trainfold.grpo.schedule``) samples through this method too, seeded per generation.
        """
        seed = derive_seed(int(state.seed), int(state.step), _GENERATION_TAG) if seed is None else seed
        completion_ids = generate(
            self.model,
            state.params,
            prompt_ids,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            eos_token_id=self.eos_token_id,
            generator=torch.Generator().manual_seed(seed),
            pad_token_id=self.pad_token_id,
            buffers=state.buffers,
        )
        completions = [self.decode(before_eos(c, self.eos_token_id)) for c in completion_ids]
        columns = {**columns, "completion_ids": [list(c) for c in completion_ids]}
        total, each = combine_rewards(self.reward_funcs, prompts, completions, columns, self.reward_weights)
        advantages = reward_advantages(
            each, self.num_generations, self.reward_weights, self.scale_rewards, self.multi_objective_aggregation
        )
        return Sampled(completion_ids, total, each, advantages)

    def __call__(self, state: TrainState, micro_batches: Sequence[Mapping[str, Any]]) -> list[dict[str, Tensor]]:
        sizes = [len(mb[self.prompt_key]) for mb in micro_batches]
        prompts = [p for mb in micro_batches for p in mb[self.prompt_key]]
        columns = {
            k: [x for mb in micro_batches for x in (mb[k].tolist() if isinstance(mb[k], Tensor) else mb[k])]
            for k in micro_batches[0]
            if k != self.prompt_key
        }
        prompt_ids = [list(self.encode(p)) for p in prompts]
        out = self.sample(state, prompt_ids, prompts, columns)
        rows: dict[str, Tensor] = completion_rows(prompt_ids, out.completion_ids, self.pad_token_id)
        ids, attention, completion_mask = rows["input_ids"], rows["attention_mask"], rows["completion_mask"]
        rows |= {
            "advantages": out.advantages,
            "rewards": out.rewards,
            **{f"rewards/{reward_name(fn)}": out.each[:, k] for k, fn in enumerate(self.reward_funcs)},
            # the block's size, on every row: dapo normalises by its completion tokens per micro-batch
            "generation_tokens": torch.full((len(prompts),), int(completion_mask.sum())),
            "generation_micro_batches": torch.full((len(prompts),), len(micro_batches)),
        }
        device = next(iter(state.params.values())).device
        if self.records_old_logps:
            rows["old_logps"] = self._logps(state.params, state.buffers, ids.to(device), attention.to(device)).cpu()
        if self.ref_params is not None:
            rows["ref_logps"] = self._logps(self.ref_params, state.buffers, ids.to(device), attention.to(device)).cpu()
        return _split_rows(rows, sizes)


def _split_rows(rows: Mapping[str, Tensor], sizes: Sequence[int]) -> list[dict[str, Tensor]]:
    out, start = [], 0
    for n in sizes:
        micro = {k: v[start : start + n] for k, v in rows.items()}
        width = int(micro["attention_mask"].sum(1).max())  # trim the block's padding to this micro-batch
        trimmed = {}
        for k, v in micro.items():
            if v.dim() == 2:  # per-position tensors: (rows, seq), or (rows, seq - 1) for log-probs
                v = v[:, : width - 1] if k.endswith("logps") else v[:, :width]
            trimmed[k] = v
        out.append(trimmed)
        start += n
    return out


def _rollout_problems(r: Rollout) -> list[str]:
    funcs, reward_weights, num_generations = r.reward_funcs, r.reward_weights, r.num_generations
    num_iterations = r.num_iterations
    scale_rewards, temperature, max_new_tokens = r.scale_rewards, r.temperature, r.max_new_tokens
    problems = []
    if not funcs:
        problems.append("give at least one reward function")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        problems.append(f"got {len(reward_weights)} reward_weights for {len(funcs)} reward functions")
    if num_generations < 2:
        problems.append(
            f"num_generations={num_generations} must be >= 2 (advantages compare completions of one prompt)"
        )
    for name in ("steps_per_generation", "optimizer_steps_per_generation"):
        if getattr(r, name) is not None and getattr(r, name) < 1:
            problems.append(f"{name}={getattr(r, name)} must be >= 1")
    if num_iterations < 1:
        problems.append(f"num_iterations={num_iterations} must be >= 1")
    if scale_rewards not in SCALE_REWARDS:
        problems.append(f"scale_rewards={scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
    if r.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        problems.append(
            f"multi_objective_aggregation={r.multi_objective_aggregation!r} is not one of "
            f"{list(MULTI_OBJECTIVE_AGGREGATIONS)}"
        )
    if not temperature > 0:
        problems.append(f"temperature={temperature} must be > 0 (log-probs are computed at this temperature)")
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
    return problems


def make_rollout(
    model: nn.Module,
    reward_funcs: RewardFunc | Sequence[RewardFunc],
    *,
    encode: Callable[[Any], list[int]],
    decode: Callable[[list[int]], Any],
    num_generations: int,
    max_new_tokens: int,
    optimizer_steps_per_generation: int | None = None,
    num_iterations: int = 1,
    temperature: float = 1.0,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    reward_weights: Sequence[float] | None = None,
    scale_rewards: str = "group",
    ref_params: Mapping[str, Tensor] | None = None,
    prompt_key: str = "prompt",
    chunk_size: int | None = None,
    steps_per_generation: int | None = None,
    multi_objective_aggregation: str = "sum_then_normalize",
) -> Rollout:
    """Return ``rollout(state, prompt_micro_batches) -> micro_batches`` for :func:`grpo_trajectory`.

    Each prompt micro-batch maps ``prompt_key`` to a list of prompts (each repeated ``num_generations`` times in a
    row, as ``generation_batches`` does) and any other column to a list or tensor; those columns reach the reward
    functions as keyword arguments. One call samples every completion of the block with ``state.params`` (generator
    seeded from ``(state.seed, state.step)``), scores them, computes advantages over the whole block, and returns
    one micro-batch per prompt micro-batch with ``input_ids``, ``attention_mask``, ``completion_mask``,
    ``advantages``, ``rewards``, ``rewards/<function name>``, the block's ``generation_tokens`` and
    ``generation_micro_batches`` (on every row; ``dapo`` reads them), and ``old_logps`` when a generation may outlive
    the step that made it (``Rollout.records_old_logps``) and ``ref_logps`` when ``ref_params`` is given.
    :func:`grpo_trajectory` calls it once per generation of ``steps_per_generation`` micro-batches (TRL's micro-steps)
    or ``optimizer_steps_per_generation`` optimizer steps (one of them; default 1 optimizer step), ``num_iterations``
    passes (TRL's μ). ``chunk_size`` (a causal LM) scores the old and reference log-probs chunk by chunk.
    ``multi_objective_aggregation="normalize_then_sum"`` is GDPO (``grpo_rewards.reward_advantages``).
    """
    rollout = Rollout(
        model=model,
        reward_funcs=(reward_funcs,) if callable(reward_funcs) else tuple(reward_funcs),
        encode=encode,
        decode=decode,
        num_generations=num_generations,
        optimizer_steps_per_generation=_one_size(steps_per_generation, optimizer_steps_per_generation),
        num_iterations=num_iterations,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        reward_weights=None if reward_weights is None else tuple(float(w) for w in reward_weights),
        scale_rewards=scale_rewards,
        ref_params=None if ref_params is None else {k: v.detach().clone() for k, v in ref_params.items()},
        prompt_key=prompt_key,
        chunk_size=chunk_size or 0,
        multi_objective_aggregation=multi_objective_aggregation,
        steps_per_generation=steps_per_generation,
    )
    problems = _rollout_problems(rollout)
    if problems:
        raise ValueError("invalid rollout settings: " + "; ".join(problems))
    return attrs.evolve(rollout, head=chunk_head(model, chunk_size, "make_rollout"))


def _one_size(steps_per_generation: int | None, optimizer_steps_per_generation: int | None) -> int | None:
    """Return ``optimizer_steps_per_generation`` (1 when neither size is given); refuse both sizes at once."""
    if steps_per_generation is None:
        return 1 if optimizer_steps_per_generation is None else optimizer_steps_per_generation
    if optimizer_steps_per_generation is not None:
        raise TypeError(
            f"make_rollout got steps_per_generation={steps_per_generation} (micro-steps, TRL's unit) and "
            f"optimizer_steps_per_generation={optimizer_steps_per_generation}; pass one"
        )
    return None


# -- the loop ------------------------------------------------------------------------------


def rollout_metrics(batch: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Return the step's reward metrics: ``reward`` and ``reward_std``, ``rewards/<name>/mean`` and ``/std``,
    ``completions/mean_length``.

    As the run's (TRL's) but over the rows the step trained on; stds are unbiased; the values are
    NaN-free: a mean with no scored row, or a std with fewer than two, is 0.

    >>> import torch
    >>> mb = {"rewards": torch.tensor([1.0, 3.0]), "completion_mask": torch.tensor([[0, 1], [1, 1]])}
    >>> {k: round(v.item(), 4) for k, v in rollout_metrics([mb]).items()}
    {'reward': 2.0, 'reward_std': 1.4142, 'completions/mean_length': 1.5}
    """
    micro = list(batch)
    out: dict[str, Tensor] = {}
    for k in micro[0]:
        if k == "rewards" or k.startswith("rewards/"):
            values = torch.cat([mb[k] for mb in micro]).float()
            mean, std = ("reward", "reward_std") if k == "rewards" else (f"{k}/mean", f"{k}/std")
            out[mean] = values.nanmean().nan_to_num(0.0)
            out[std] = nanstd(values).nan_to_num(0.0)
    lengths = torch.cat([mb["completion_mask"].sum(1) for mb in micro]).float()
    out["completions/mean_length"] = lengths.mean()
    return out


def grpo_trajectory(
    step: Callable[[TrainState, Any], TrainState],
    state: TrainState,
    prompt_stream: Iterable[Sequence[Any]],
    rollout: Rollout,
    stop: Callable[[TrainState], bool] = never,
) -> Iterator[TrainState]:
    """Yield the state after each optimizer step of GRPO training (lazily; see ``fold.trajectory``).

    ``prompt_stream`` yields one optimizer step of prompt micro-batches at a time (e.g.
    ``data.stream``; its steps' length is the accumulation). ``grpo_data.generation_batches`` runs
    TRL's schedule (the GRPO run's): each generation takes the next ``rollout.steps_per_generation``
    prompt micro-batches (micro-steps; or ``rollout.optimizer_steps_per_generation`` optimizer
    steps), calls ``rollout`` once on them with the state reached so far, and micro-step ``k``
    trains on slice ``k % steps_per_generation`` (``rollout.num_iterations`` passes). Each yielded
    state's metrics add :func:`rollout_metrics` of the micro-batches it trained on.

    Resuming from the end of a generation's last pass (one that ends a prompt step), with the prompt
    stream rebuilt from its cursor, is bitwise equal to not stopping; from inside a generation the
    rest of it is generated anew (``trainfold.grpo.train`` keeps the generation in the state).

    >>> import torch
    >>> from trainfold import make_step
    >>> from trainfold.grpo.objective import grpo_objective
    >>> from trainfold import init_state, sgd
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> def length(prompts, completions, **_): return [float(len(c)) for c in completions]
    >>> rollout = make_rollout(model, length, encode=lambda s: [1 + int(c) for c in s],
    ...                        decode=lambda ids: "".join(str(i % 10) for i in ids), num_generations=2,
    ...                        max_new_tokens=3)
    >>> opt = sgd(0.1)
    >>> step = make_step(model, optimizer=opt, objective=grpo_objective())
    >>> prompts = [[{"prompt": ["12", "12"]}] for _ in range(2)]  # 2 optimizer steps of 1 micro-batch
    >>> states = list(grpo_trajectory(step, init_state(model, opt), prompts, rollout))
    >>> [int(s.step) for s in states], {"loss", "reward", "completions/mean_length"} <= set(states[-1].metrics)
    ([1, 2], True)
    """
    latest = [state]  # the newest state, read when the next block is generated

    def generate_block(micro_batches: list[Any]) -> list[dict[str, Tensor]]:
        return rollout(latest[0], micro_batches)

    def observed(s: TrainState, batch: Any) -> TrainState:
        new = step(s, batch)
        new = attrs.evolve(new, metrics={**new.metrics, **rollout_metrics(batch)})
        latest[0] = new
        return new

    micro_steps = getattr(rollout, "steps_per_generation", None)
    batches = generation_batches(
        prompt_stream,
        generate_block,
        None if micro_steps is not None else rollout.optimizer_steps_per_generation,
        rollout.num_generations,
        getattr(rollout, "num_iterations", 1),
        steps_per_generation=micro_steps,
    )
    yield from trajectory(observed, state, batches, stop)
