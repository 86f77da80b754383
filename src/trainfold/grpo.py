"""GRPO-style online RL as plain functions: rewards, group-relative advantages, the clipped loss, the loop.

The pieces:

* reward functions ``reward(prompts, completions, **columns) -> list[float]`` (``None`` or NaN
  for "no score"), several combined with weights;
* :func:`group_advantages`: per group of ``num_generations`` completions of one prompt,
  ``(r − mean) / (std + 1e-4)`` (unbiased std; ``scale_rewards`` picks the group's std, the whole
  batch's std, or none);
* :func:`make_rollout`: ``rollout(state, prompt_micro_batches) -> micro-batches``: samples the
  completions with the state's params (seeded from the state), scores them, and stores
  advantages, and the old policy's and reference's per-token log-probs when they are needed;
* :func:`grpo_objective`: the clipped surrogate (``epsilon`` per token) plus ``beta``·KL(k3) to
  the reference, normalised as ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo``; plugs into ``make_step``;
* :func:`grpo_trajectory`: the training loop: ``data.generation_batches`` draws the prompts of
  ``steps_per_generation`` optimizer steps, generates once with the latest state, and feeds the
  step one slice of that buffer per optimizer step.

Per-token tensors are laid out like the rows: ``input_ids`` is ``prompt + completion`` per row,
right-padded, and per-token log-probs have shape ``(rows, seq - 1)`` (position t scores token
t+1), masked by ``completion_mask[:, 1:]``.

>>> import torch
>>> [round(a, 4) for a in group_advantages(torch.tensor([5.0, 2.0, 4.0, 4.0]), 4).tolist()]
[0.9933, -1.3906, 0.1987, 0.1987]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.chunked_loss import OutputHead, check_chunk_size, chunked_token_logps, output_head
from trainfold.data import generation_batches
from trainfold.fold import never, trajectory
from trainfold.generate import functional_forward, generate, pad_right, token_logps
from trainfold.losses import logits_of
from trainfold.state import TrainState
from trainfold.step import derive_seed, train_mode

__all__ = [
    "GRPO_LOSS_TYPES",
    "SCALE_REWARDS",
    "GRPOObjective",
    "RewardFunc",
    "Rollout",
    "combine_rewards",
    "group_advantages",
    "grpo_objective",
    "grpo_trajectory",
    "make_rollout",
    "rollout_metrics",
]

RewardFunc = Callable[..., Sequence[float | None]]
SCALE_REWARDS = ("group", "batch", "none")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_MODEL_KEYS = ("input_ids", "attention_mask")
_GENERATION_TAG = 0x6E6E


# -- rewards and advantages ----------------------------------------------------------------


def _reward_name(fn: RewardFunc) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def combine_rewards(
    reward_funcs: Sequence[RewardFunc],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Return ``(total, each)``: the weighted sum of the rewards, and each function's rewards.

    ``each`` has shape ``(rows, functions)``; ``None`` becomes NaN. ``total`` ignores NaN entries
    (a sum over the scored functions) and is NaN only where no function scored the row.

    >>> def length(prompts, completions, **_): return [float(len(c)) for c in completions]
    >>> def none_for_b(prompts, completions, **_): return [None if c == "b" else 1.0 for c in completions]
    >>> total, each = combine_rewards([length, none_for_b], ["p", "p"], ["aa", "b"], weights=[1.0, 2.0])
    >>> total.tolist()
    [4.0, 1.0]
    """
    if not reward_funcs:
        raise ValueError("combine_rewards needs at least one reward function")
    if weights is not None and len(weights) != len(reward_funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(reward_funcs)} reward functions; give one weight per function")
    cols = dict(columns or {})
    scores = []
    for fn in reward_funcs:
        values = list(fn(list(prompts), list(completions), **cols))
        if len(values) != len(completions):
            raise ValueError(
                f"reward function {_reward_name(fn)} returned {len(values)} values for {len(completions)} completions; "
                "it must return one float (or None) per completion"
            )
        scores.append([math.nan if v is None else float(v) for v in values])
    each = torch.tensor(scores, dtype=torch.float32).T.reshape(len(completions), len(reward_funcs))
    w = torch.tensor(list(weights) if weights is not None else [1.0] * len(reward_funcs), dtype=torch.float32)
    total = torch.nansum(each * w, dim=1)
    total[torch.isnan(each).all(dim=1)] = math.nan
    return total, each


def _nan_mean_std(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    valid = ~torch.isnan(x)
    count = valid.sum(dim, keepdim=True)
    mean = torch.where(valid, x, 0.0).sum(dim, keepdim=True) / count.clamp(min=1)
    sq = torch.where(valid, (x - mean) ** 2, 0.0).sum(dim, keepdim=True)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.nan)
    return mean, std


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> Tensor:
    """Return each completion's advantage relative to its group of ``num_generations`` consecutive rows.

    ``A = r − mean_group``, divided by ``std + 1e-4`` where std is the group's unbiased std
    (``"group"``), the whole batch's (``"batch"``), or not divided (``"none"``). NaN rewards are
    left out of the means and stds and get advantage 0; no advantage is ever NaN.

    >>> import torch
    >>> [round(a, 4) for a in group_advantages(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2).tolist()]
    [0.0, 0.0, -0.7071, 0.7071]
    >>> group_advantages(torch.tensor([1.0, 3.0]), 2, "none").tolist()
    [-1.0, 1.0]
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations}: group-relative advantages need at least 2 completions per prompt")
    if rewards.dim() != 1 or rewards.shape[0] % num_generations:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {num_generations}: pass one reward "
            "per completion, each prompt's completions consecutive"
        )
    groups = rewards.float().reshape(-1, num_generations)
    mean, group_std = _nan_mean_std(groups, dim=1)
    adv = groups - mean
    if scale_rewards == "group":
        adv = adv / (group_std + 1e-4)
    elif scale_rewards == "batch":
        adv = adv / (_nan_mean_std(groups.reshape(1, -1), dim=1)[1] + 1e-4)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)


# -- rollout: generate, score, record ------------------------------------------------------


def _next_token_logps(forward: Callable[..., Any], params: Mapping[str, Tensor], inputs: Mapping[str, Tensor],
                      head: OutputHead | None, chunk_size: int, temperature: float) -> Tensor:
    """Return each next token's log-prob ``(batch, seq - 1)``: from the logits, or chunk by chunk from the hidden states."""
    ids = inputs["input_ids"]
    if head is None:
        return token_logps(logits_of(forward(params, inputs)), ids, temperature)
    hidden = head.hidden(forward, params, inputs)
    return chunked_token_logps(hidden[:, :-1], head.weight(params), ids[:, 1:], bias=head.bias, chunk_size=chunk_size,
                               temperature=temperature)


def _head(model: nn.Module | None, chunk_size: int | None, what: str) -> OutputHead | None:
    if chunk_size is None:
        return None
    if model is None:
        raise ValueError(f"{what}(chunk_size=...) needs model= (the causal LM whose output embedding it applies)")
    check_chunk_size(chunk_size)
    return output_head(model)


@attrs.frozen(eq=False)
class Rollout:
    """Turn prompt micro-batches into training micro-batches with the latest state; see :func:`make_rollout`.

    >>> from trainfold import init_state, sgd
    >>> from trainfold.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> def length(prompts, completions, **_): return [float(len(c)) for c in completions]
    >>> rollout = make_rollout(model, length, encode=lambda s: [1 + int(c) for c in s],
    ...                        decode=lambda ids: "".join(str(i % 10) for i in ids), num_generations=2,
    ...                        max_new_tokens=3)
    >>> state = init_state(model, sgd(0.1))
    >>> prompts = [{"prompt": ["12", "12"]}, {"prompt": ["3", "3"]}]  # 2 micro-batches, 2 generations each
    >>> out = rollout(state, prompts)
    >>> len(out), list(out[0]["input_ids"].shape), sorted(out[0])[:5]
    (2, [2, 5], ['advantages', 'attention_mask', 'completion_mask', 'generation_micro_batches', 'generation_tokens'])
    >>> again = rollout(state, prompts)  # sampled with a generator seeded from the state
    >>> all(torch.equal(a[k], b[k]) for a, b in zip(out, again) for k in a)
    True
    """

    model: nn.Module
    reward_funcs: tuple[RewardFunc, ...]
    encode: Callable[[Any], list[int]]
    decode: Callable[[list[int]], Any]
    num_generations: int
    steps_per_generation: int
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

    @property
    def records_old_logps(self) -> bool:
        """Whether the buffer outlives one optimizer step, so the sampling policy's log-probs are kept."""
        return self.steps_per_generation * self.num_iterations > 1

    def _logps(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], ids: Tensor, mask: Tensor) -> Tensor:
        with torch.no_grad(), train_mode(self.model, False):
            return _next_token_logps(functional_forward(self.model, buffers), params,
                                     {"input_ids": ids, "attention_mask": mask}, self.head, self.chunk_size,
                                     self.temperature)

    def __call__(self, state: TrainState, micro_batches: Sequence[Mapping[str, Any]]) -> list[dict[str, Tensor]]:
        sizes = [len(mb[self.prompt_key]) for mb in micro_batches]
        prompts = [p for mb in micro_batches for p in mb[self.prompt_key]]
        columns = {
            k: [x for mb in micro_batches for x in (mb[k].tolist() if isinstance(mb[k], Tensor) else mb[k])]
            for k in micro_batches[0] if k != self.prompt_key
        }
        prompt_ids = [list(self.encode(p)) for p in prompts]
        key = torch.Generator().manual_seed(derive_seed(int(state.seed), int(state.step), _GENERATION_TAG))
        completion_ids = generate(
            self.model, state.params, prompt_ids, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            eos_token_id=self.eos_token_id, generator=key, pad_token_id=self.pad_token_id, buffers=state.buffers,
        )
        completions = [self.decode(_before_eos(c, self.eos_token_id)) for c in completion_ids]
        total, each = combine_rewards(self.reward_funcs, prompts, completions, columns, self.reward_weights)
        advantages = group_advantages(total, self.num_generations, self.scale_rewards)
        ids, attention = pad_right([p + c for p, c in zip(prompt_ids, completion_ids)], self.pad_token_id)
        completion_mask = attention.clone()
        for row, p in enumerate(prompt_ids):
            completion_mask[row, : len(p)] = 0
        rows: dict[str, Tensor] = {
            "input_ids": ids,
            "attention_mask": attention,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "rewards": total,
            **{f"rewards/{_reward_name(fn)}": each[:, k] for k, fn in enumerate(self.reward_funcs)},
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


def _before_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos)] if eos is not None and eos in tokens else tokens


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


def make_rollout(
    model: nn.Module,
    reward_funcs: RewardFunc | Sequence[RewardFunc],
    *,
    encode: Callable[[Any], list[int]],
    decode: Callable[[list[int]], Any],
    num_generations: int,
    max_new_tokens: int,
    steps_per_generation: int = 1,
    num_iterations: int = 1,
    temperature: float = 1.0,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    reward_weights: Sequence[float] | None = None,
    scale_rewards: str = "group",
    ref_params: Mapping[str, Tensor] | None = None,
    prompt_key: str = "prompt",
    chunk_size: int | None = None,
) -> Rollout:
    """Return ``rollout(state, prompt_micro_batches) -> micro_batches`` for :func:`grpo_trajectory`.

    Each prompt micro-batch maps ``prompt_key`` to a list of prompts (each repeated
    ``num_generations`` times in a row, as ``generation_batches`` does) and any other column to a
    list or tensor; those columns reach the reward functions as keyword arguments. One call
    samples every completion of the block with ``state.params`` (generator seeded from
    ``(state.seed, state.step)``), scores them, computes advantages over the whole block, and
    returns one micro-batch per prompt micro-batch with ``input_ids``, ``attention_mask``,
    ``completion_mask``, ``advantages``, ``rewards``, ``rewards/<function name>``, the block's
    ``generation_tokens`` and ``generation_micro_batches`` (on every row; ``dapo`` reads them), and
    ``old_logps`` when the buffer outlives the step that generated it (``steps_per_generation``
    or ``num_iterations`` above 1) and ``ref_logps`` when ``ref_params`` is given.
    ``num_iterations`` (TRL's μ) trains on each block that many times, in the same order.
    ``chunk_size`` (a transformers causal LM) scores the old and reference log-probs ``chunk_size``
    tokens at a time from the final hidden states, never materialising the full logits.

    >>> import torch
    >>> from trainfold import init_state, sgd
    >>> from trainfold.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> def length(prompts, completions, **_): return [float(len(c)) for c in completions]
    >>> rollout = make_rollout(model, length, encode=lambda s: [1 + int(c) for c in s],
    ...                        decode=lambda ids: "".join(str(i % 10) for i in ids), num_generations=2,
    ...                        max_new_tokens=3)
    >>> rollout.num_generations, rollout.records_old_logps
    (2, False)
    >>> try:
    ...     make_rollout(model, length, encode=list, decode=str, num_generations=1, max_new_tokens=3)
    ... except ValueError as e:
    ...     print(e)
    invalid rollout settings: num_generations=1 must be >= 2 (advantages compare completions of one prompt)
    """
    funcs = (reward_funcs,) if callable(reward_funcs) else tuple(reward_funcs)
    problems = []
    if not funcs:
        problems.append("give at least one reward function")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        problems.append(f"got {len(reward_weights)} reward_weights for {len(funcs)} reward functions")
    if num_generations < 2:
        problems.append(f"num_generations={num_generations} must be >= 2 (advantages compare completions of one prompt)")
    if steps_per_generation < 1:
        problems.append(f"steps_per_generation={steps_per_generation} must be >= 1")
    if num_iterations < 1:
        problems.append(f"num_iterations={num_iterations} must be >= 1")
    if scale_rewards not in SCALE_REWARDS:
        problems.append(f"scale_rewards={scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
    if not temperature > 0:
        problems.append(f"temperature={temperature} must be > 0 (log-probs are computed at this temperature)")
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
    if problems:
        raise ValueError("invalid rollout settings: " + "; ".join(problems))
    return Rollout(
        model=model, reward_funcs=funcs, encode=encode, decode=decode, num_generations=num_generations,
        steps_per_generation=steps_per_generation, num_iterations=num_iterations, max_new_tokens=max_new_tokens, temperature=temperature,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        reward_weights=None if reward_weights is None else tuple(float(w) for w in reward_weights),
        scale_rewards=scale_rewards,
        # its own copy: train trains the module's storage in place, and ref_params often are the module's tensors
        ref_params=None if ref_params is None else {k: v.detach().clone() for k, v in ref_params.items()},
        prompt_key=prompt_key, head=_head(model, chunk_size, "make_rollout"), chunk_size=chunk_size or 0,
    )


# -- the loss ------------------------------------------------------------------------------


@attrs.frozen
class GRPOObjective:
    """The clipped-surrogate objective for ``make_step(..., objective=...)``; see :func:`grpo_objective`.

    With no ``old_logps`` the ratio is 1, so the ``grpo`` loss is minus the mean advantage:

    >>> obj = grpo_objective("grpo")
    >>> batch = {"input_ids": torch.tensor([[1, 2, 3], [1, 4, 0]]),
    ...          "completion_mask": torch.tensor([[0, 1, 1], [0, 1, 0]]), "advantages": torch.tensor([1.0, 0.5])}
    >>> uniform = lambda params, inputs: torch.zeros(*inputs["input_ids"].shape, 16)
    >>> loss, aux = obj(uniform, {}, batch, obj.count_items(batch))
    >>> loss.item(), sorted(aux), aux["clip_ratio/region_mean"].item()
    (-0.75, ['clip_ratio/high_mean', 'clip_ratio/low_mean', 'clip_ratio/region_mean'], 0.0)
    """

    loss_type: str
    epsilon: float
    epsilon_high: float
    beta: float
    temperature: float
    max_completion_length: int | None
    kl_bias_correction: bool
    head: OutputHead | None = None  # set: log-probs chunk by chunk from the hidden states (loss_chunk_size)
    chunk_size: int = 0

    def count_items(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count what the loss averages over: completion tokens (``bnpo``), the generation block's
        completion tokens (``dapo``, once per micro-batch), or completions (otherwise)."""
        if self.loss_type == "bnpo":
            return micro_batch["completion_mask"][:, 1:].sum()
        if self.loss_type == "dapo":
            return _block_size(micro_batch, "generation_tokens")
        return torch.tensor(micro_batch["completion_mask"].shape[0])

    def _aggregate(self, per_token: Tensor, mask: Tensor, n: Tensor, block: Tensor | None) -> Tensor:
        masked = per_token * mask
        if self.loss_type == "grpo":
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n
        if self.loss_type == "bnpo":
            return masked.sum() / n
        if self.loss_type == "dapo":  # n = the block's tokens x the step's micro-batches (over ranks)
            assert block is not None
            return masked.sum() * block / n
        assert self.max_completion_length is not None
        return masked.sum() / (n * self.max_completion_length)

    def __call__(
        self,
        forward: Callable[..., Any],
        params: Mapping[str, Tensor],
        micro_batch: Mapping[str, Tensor],
        num_items_in_batch: Tensor,
        key: torch.Generator | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        inputs = {k: micro_batch[k] for k in _MODEL_KEYS if k in micro_batch}
        logps = _next_token_logps(forward, params, inputs, self.head, self.chunk_size, self.temperature)
        mask = micro_batch["completion_mask"][:, 1:].to(logps.dtype)
        old = micro_batch.get("old_logps")
        old = logps.detach() if old is None else old.to(logps)
        ratio = torch.exp(logps - old)
        adv = micro_batch["advantages"].to(logps)[:, None]
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        n = num_items_in_batch.to(logps.dtype)
        block = _block_size(micro_batch, "generation_micro_batches").to(logps) if self.loss_type == "dapo" else None
        aux: dict[str, Tensor] = {}
        if self.beta != 0:
            if "ref_logps" not in micro_batch:
                raise KeyError("grpo_objective has beta != 0 but the micro-batch has no 'ref_logps': pass ref_params to make_rollout")
            ref = micro_batch["ref_logps"].to(logps)
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.kl_bias_correction:
                kl = kl * ratio
            per_token = per_token + self.beta * kl
            aux["kl"] = self._aggregate(kl.detach(), mask, n, block)
        low = ((ratio < 1 - self.epsilon) & (adv < 0)).to(logps.dtype)
        high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).to(logps.dtype)
        aux["clip_ratio/low_mean"] = self._aggregate(low, mask, n, block)
        aux["clip_ratio/high_mean"] = self._aggregate(high, mask, n, block)
        aux["clip_ratio/region_mean"] = self._aggregate(low + high, mask, n, block)
        return self._aggregate(per_token, mask, n, block), aux


def _block_size(micro_batch: Mapping[str, Tensor], key: str) -> Tensor:
    if key not in micro_batch:
        raise KeyError(f"loss_type='dapo' needs the micro-batch's {key!r}, which make_rollout records; "
                       "build the micro-batches with make_rollout, or choose loss_type='bnpo'")
    return micro_batch[key][0]


def grpo_objective(
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    max_completion_length: int | None = None,
    kl_bias_correction: bool = True,
    *,
    model: nn.Module | None = None,
    chunk_size: int | None = None,
) -> GRPOObjective:
    """Return the GRPO objective: per token ``−min(r·A, clip(r, 1−ε, 1+ε_high)·A) + β·KL``.

    ``r = π_θ / π_old`` with ``π_old`` the micro-batch's ``old_logps`` (else the current
    log-probs without gradient, so ``r = 1`` but its gradient is ``∇ log π``). KL is the k3
    estimator ``exp(ref − logπ) − (ref − logπ) − 1`` against the micro-batch's ``ref_logps``,
    times ``r`` when ``kl_bias_correction`` (as TRL does by default). Token losses are summed over
    completion tokens, then normalised over the optimizer step:

    * ``grpo``: each completion's token mean, averaged over the step's completions;
    * ``bnpo``: the token mean over all the step's completion tokens (TRL divides per
      micro-batch instead; the two agree with one micro-batch per step);
    * ``dr_grpo``: the token sum over ``completions × max_completion_length``;
    * ``dapo`` (TRL's default): the token sum over the generation block's completion tokens per
      optimizer step (its total over all ranks divided by the optimizer steps it feeds). With one
      optimizer step per generation (``steps_per_generation=1``) this is ``bnpo``; with more, every
      step of a block has the same normaliser, as in TRL.

    Metrics ``clip_ratio/{low,high,region}_mean`` (and ``kl`` when ``beta != 0``) are aggregated
    the same way. ``temperature`` must be the sampling temperature. ``chunk_size`` (with ``model``, a
    transformers causal LM) computes the log-probs ``chunk_size`` tokens at a time from the final
    hidden states, never materialising the full logits.

    >>> obj = grpo_objective("bnpo")
    >>> import torch
    >>> obj.count_items({"completion_mask": torch.tensor([[0, 1, 1], [0, 1, 0]])}).item()
    3
    """
    high = epsilon if epsilon_high is None else epsilon_high
    problems = []
    if loss_type not in GRPO_LOSS_TYPES:
        problems.append(f"loss_type={loss_type!r} is not one of {list(GRPO_LOSS_TYPES)}")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length < 1):
        problems.append("loss_type='dr_grpo' divides by max_completion_length: pass the rollout's max_new_tokens")
    if not (0 <= epsilon < 1 and high >= 0):
        problems.append(f"epsilon={epsilon} must be in [0, 1) and epsilon_high={high} >= 0")
    if beta < 0:
        problems.append(f"beta={beta} must be >= 0")
    if not temperature > 0:
        problems.append(f"temperature={temperature} must be > 0")
    if problems:
        raise ValueError("invalid GRPO objective: " + "; ".join(problems))
    return GRPOObjective(loss_type=loss_type, epsilon=epsilon, epsilon_high=high, beta=beta, temperature=temperature,
                         max_completion_length=max_completion_length, kl_bias_correction=kl_bias_correction,
                         head=_head(model, chunk_size, "grpo_objective"), chunk_size=chunk_size or 0)


# -- the loop ------------------------------------------------------------------------------


def rollout_metrics(batch: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Return the step's reward metrics: ``reward`` and ``rewards/<name>/mean`` (NaN-free means), ``completions/mean_length``.

    >>> import torch
    >>> mb = {"rewards": torch.tensor([1.0, 3.0]), "completion_mask": torch.tensor([[0, 1], [1, 1]])}
    >>> {k: v.item() for k, v in rollout_metrics([mb]).items()}
    {'reward': 2.0, 'completions/mean_length': 1.5}
    """
    micro = list(batch)
    out: dict[str, Tensor] = {}
    for k in micro[0]:
        if k == "rewards" or k.startswith("rewards/"):
            values = torch.cat([mb[k] for mb in micro]).float()
            name = "reward" if k == "rewards" else f"{k}/mean"
            out[name] = values.nanmean() if (~values.isnan()).any() else torch.tensor(0.0)
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
    ``data.stream``); ``data.generation_batches`` groups ``rollout.steps_per_generation`` steps,
    calls ``rollout`` once on the block with the state reached so far, and feeds the step one
    slice per optimizer step (``rollout.num_iterations`` passes over the block). Each yielded
    state's metrics add :func:`rollout_metrics` of the slice it trained on.

    Resuming from a state saved at a generation boundary (``state.step`` a multiple of
    ``steps_per_generation × num_iterations``), with the prompt stream rebuilt from its cursor, is
    bitwise equal to not stopping. From inside a block, the rest of the block is generated anew
    with the resumed state (and passes not yet run are skipped), so save checkpoints at those
    multiples.

    >>> import torch
    >>> from trainfold import make_step
    >>> from trainfold import init_state, sgd
    >>> from trainfold.models import TinyLM, TinyLMConfig
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

    batches = generation_batches(prompt_stream, generate_block, rollout.steps_per_generation, rollout.num_generations,
                                 getattr(rollout, "num_iterations", 1))
    yield from trajectory(observed, state, batches, stop)
