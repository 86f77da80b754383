"""GRPO's hand-written loop for research code: ``make_rollout`` and ``grpo_trajectory``.

``grpo_trajectory(step, state, prompt_stream, rollout)`` is a plain fold: ``data.generation_batches``
draws the prompts of ``optimizer_steps_per_generation`` optimizer steps (counted in optimizer
steps, unlike TRL's micro-step ``steps_per_generation``), calls ``rollout`` once with the latest
state, and feeds the step one slice of that buffer per optimizer step. The run with TRL's
semantics, checkpoints and resume inside a generation block is ``trainfold.grpo.train_grpo``
(``trainfold.hf.grpo_run``). These names are also importable from ``trainfold.recipes.grpo``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.chunked_loss import OutputHead
from trainfold.core.fold import never, trajectory
from trainfold.core.forward import train_mode
from trainfold.core.rng import derive_seed
from trainfold.core.state import TrainState
from trainfold.recipes.generate import functional_forward, generate
from trainfold.recipes.grpo_data import generation_batches
from trainfold.recipes.grpo_metrics import nanstd
from trainfold.recipes.grpo_objective import chunk_head, next_token_logps
from trainfold.recipes.grpo_rewards import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    RewardFunc,
    combine_rewards,
    reward_advantages,
    reward_name,
)
from trainfold.recipes.grpo_rows import before_eos, completion_rows

__all__ = ["Rollout", "grpo_trajectory", "make_rollout", "rollout_metrics"]

_GENERATION_TAG = 0x6E6E


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
    optimizer_steps_per_generation: int
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

    @property
    def records_old_logps(self) -> bool:
        """Whether the buffer outlives one optimizer step, so the sampling policy's log-probs are kept."""
        return self.optimizer_steps_per_generation * self.num_iterations > 1

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

    def __call__(self, state: TrainState, micro_batches: Sequence[Mapping[str, Any]]) -> list[dict[str, Tensor]]:
        sizes = [len(mb[self.prompt_key]) for mb in micro_batches]
        prompts = [p for mb in micro_batches for p in mb[self.prompt_key]]
        columns = {
            k: [x for mb in micro_batches for x in (mb[k].tolist() if isinstance(mb[k], Tensor) else mb[k])]
            for k in micro_batches[0]
            if k != self.prompt_key
        }
        prompt_ids = [list(self.encode(p)) for p in prompts]
        key = torch.Generator().manual_seed(derive_seed(int(state.seed), int(state.step), _GENERATION_TAG))
        completion_ids = generate(
            self.model,
            state.params,
            prompt_ids,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            eos_token_id=self.eos_token_id,
            generator=key,
            pad_token_id=self.pad_token_id,
            buffers=state.buffers,
        )
        completions = [self.decode(before_eos(c, self.eos_token_id)) for c in completion_ids]
        total, each = combine_rewards(self.reward_funcs, prompts, completions, columns, self.reward_weights)
        advantages = reward_advantages(
            each, self.num_generations, self.reward_weights, self.scale_rewards, self.multi_objective_aggregation
        )
        rows: dict[str, Tensor] = completion_rows(prompt_ids, completion_ids, self.pad_token_id)
        ids, attention, completion_mask = rows["input_ids"], rows["attention_mask"], rows["completion_mask"]
        rows |= {
            "advantages": advantages,
            "rewards": total,
            **{f"rewards/{reward_name(fn)}": each[:, k] for k, fn in enumerate(self.reward_funcs)},
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
    optimizer_steps_per_generation, num_iterations = r.optimizer_steps_per_generation, r.num_iterations
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
    if optimizer_steps_per_generation < 1:
        problems.append(f"optimizer_steps_per_generation={optimizer_steps_per_generation} must be >= 1")
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
    optimizer_steps_per_generation: int = 1,
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
    ``generation_micro_batches`` (on every row; ``dapo`` reads them), and ``old_logps`` when the buffer outlives the
    step that generated it (``optimizer_steps_per_generation`` or ``num_iterations`` above 1) and ``ref_logps`` when
    ``ref_params`` is given. ``num_iterations`` (TRL's μ) trains on each block that many times, in the same order.
    ``chunk_size`` (a causal LM) scores the old and reference log-probs chunk by chunk from the final hidden states.
    ``multi_objective_aggregation="normalize_then_sum"`` is GDPO (``grpo_rewards.reward_advantages``).
    ``steps_per_generation``: the old name of ``optimizer_steps_per_generation`` (a DeprecationWarning).
    """
    rollout = Rollout(
        model=model,
        reward_funcs=(reward_funcs,) if callable(reward_funcs) else tuple(reward_funcs),
        encode=encode,
        decode=decode,
        num_generations=num_generations,
        optimizer_steps_per_generation=_renamed_steps(steps_per_generation, optimizer_steps_per_generation),
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
    )
    problems = _rollout_problems(rollout)
    if problems:
        raise ValueError("invalid rollout settings: " + "; ".join(problems))
    return attrs.evolve(rollout, head=chunk_head(model, chunk_size, "make_rollout"))


def _renamed_steps(old: int | None, new: int) -> int:
    """Return ``optimizer_steps_per_generation`` given under its old name ``steps_per_generation`` (warning)."""
    if old is None:
        return new
    if new != 1 and new != old:
        raise TypeError(
            f"make_rollout got steps_per_generation={old} and optimizer_steps_per_generation={new}; "
            "pass only optimizer_steps_per_generation (the new name)"
        )
    warnings.warn(
        "make_rollout(steps_per_generation=) is renamed optimizer_steps_per_generation= (optimizer steps per "
        "generation, not TRL's micro-steps); pass that name",
        DeprecationWarning,
        stacklevel=3,
    )
    return old


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
    ``data.stream``); ``data.generation_batches`` groups ``rollout.optimizer_steps_per_generation``
    steps, calls ``rollout`` once on the block with the state reached so far, and feeds the step one
    slice per optimizer step (``rollout.num_iterations`` passes over the block). Each yielded
    state's metrics add :func:`rollout_metrics` of the slice it trained on.

    Resuming from a state saved at a generation boundary (``state.step`` a multiple of
    ``optimizer_steps_per_generation × num_iterations``), with the prompt stream rebuilt from its
    cursor, is bitwise equal to not stopping. From inside a block, the rest of the block is
    generated anew with the resumed state (and passes not yet run are skipped), so save
    checkpoints at those multiples, or use ``trainfold.hf.grpo_run.train_grpo``, which keeps the block in
    the state.

    >>> import torch
    >>> from trainfold import make_step
    >>> from trainfold.recipes.grpo_objective import grpo_objective
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

    batches = generation_batches(
        prompt_stream,
        generate_block,
        rollout.optimizer_steps_per_generation,
        rollout.num_generations,
        getattr(rollout, "num_iterations", 1),
    )
    yield from trajectory(observed, state, batches, stop)
