"""GRPO's loss: the clipped surrogate plus ``beta``·KL(k3) to the reference, for ``make_step(objective=...)``.

Token losses are normalised as ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (see :func:`grpo_objective`).
Per-token tensors are laid out like the rows: ``input_ids`` is ``prompt + completion`` per row,
right-padded, and per-token log-probs have shape ``(rows, seq - 1)`` (position t scores token
t+1), masked by ``completion_mask[:, 1:]``.

>>> obj = grpo_objective("dr_grpo", max_completion_length=4)
>>> obj.loss_type, obj.epsilon_high
('dr_grpo', 0.2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.chunked_loss import OutputHead, check_chunk_size, chunked_token_logps, output_head
from trainfold.core.losses import logits_of
from trainfold.recipes.generate import token_logps

__all__ = ["GRPO_LOSS_TYPES", "GRPOObjective", "chunk_head", "grpo_objective", "next_token_logps", "token_entropy"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_MODEL_KEYS = ("input_ids", "attention_mask")


# -- log-probs -----------------------------------------------------------------------------


def next_token_logps(
    forward: Callable[..., Any],
    params: Mapping[str, Tensor],
    inputs: Mapping[str, Tensor],
    head: OutputHead | None,
    chunk_size: int,
    temperature: float,
) -> Tensor:
    """Return each next token's log-prob ``(batch, seq - 1)``.

    From the logits, or chunk by chunk from the hidden states.
    """
    ids = inputs["input_ids"]
    if head is None:
        return token_logps(logits_of(forward(params, inputs)), ids, temperature)
    hidden = head.hidden(forward, params, inputs)
    return chunked_token_logps(
        hidden[:, :-1], head.weight(params), ids[:, 1:], bias=head.bias, chunk_size=chunk_size, temperature=temperature
    )


def chunk_head(model: nn.Module | None, chunk_size: int | None, what: str) -> OutputHead | None:
    """Return ``model``'s output head for log-probs ``chunk_size`` tokens at a time (None: from the logits)."""
    if chunk_size is None:
        return None
    if model is None:
        raise ValueError(f"{what}(chunk_size=...) needs model= (the causal LM whose output embedding it applies)")
    check_chunk_size(chunk_size)
    return output_head(model)


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
    >>> loss.item(), sorted(aux)[:2], aux["clip_ratio/region_mean"].item(), round(aux["entropy"].item(), 4)
    (-0.75, ['clip_ratio/high_mean', 'clip_ratio/low_mean'], 0.0, 2.7726)
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

    def logps_and_entropy(
        self, forward: Callable[..., Any], params: Mapping[str, Tensor], inputs: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """Return the next tokens' log-probs (with grad) and the entropies (without), ``(rows, seq - 1)`` each.

        From the logits, or chunk by chunk from the hidden states (``head``): never the full logits then.
        """
        if self.head is None:
            logits = logits_of(forward(params, inputs))
            logps = token_logps(logits, inputs["input_ids"], self.temperature)
            with torch.no_grad():
                return logps, token_entropy(logits[:, :-1], self.temperature)
        hidden = self.head.hidden(forward, params, inputs)
        weight, ids = self.head.weight(params), inputs["input_ids"]
        logps = chunked_token_logps(
            hidden[:, :-1],
            weight,
            ids[:, 1:],
            bias=self.head.bias,
            chunk_size=self.chunk_size,
            temperature=self.temperature,
        )
        with torch.no_grad():
            return logps, _chunked_entropy(hidden[:, :-1], weight, self.head.bias, self.chunk_size, self.temperature)

    def __call__(
        self,
        forward: Callable[..., Any],
        params: Mapping[str, Tensor],
        micro_batch: Mapping[str, Tensor],
        num_items_in_batch: Tensor,
        key: torch.Generator | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        inputs = {k: micro_batch[k] for k in _MODEL_KEYS if k in micro_batch}
        logps, entropy = self.logps_and_entropy(forward, params, inputs)
        mask = micro_batch["completion_mask"][:, 1:].to(logps.dtype)
        old = micro_batch.get("old_logps")
        old = logps.detach() if old is None else old.to(logps)
        ratio = torch.exp(logps - old)
        adv = micro_batch["advantages"].to(logps)[:, None]
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        n = num_items_in_batch.to(logps.dtype)
        block = _block_size(micro_batch, "generation_micro_batches").to(logps) if self.loss_type == "dapo" else None
        if self.loss_type == "dapo" and "step_micro_batches" in micro_batch:  # TRL: each micro-batch by its own
            n = (micro_batch["generation_tokens"][0] * micro_batch["step_micro_batches"][0]).to(logps)  # generation
        if "step_micro_batches" in micro_batch:  # TRL's metrics: token means per micro-batch, averaged over the step
            share = 1 / micro_batch["step_micro_batches"][0].to(logps)
            metric = lambda x: (x * mask).sum() / mask.sum().clamp(min=1) * share
        else:  # aggregated like the loss
            metric = lambda x: self._aggregate(x, mask, n, block)
        aux: dict[str, Tensor] = {"entropy": metric(entropy)}
        if self.beta != 0:
            if "ref_logps" not in micro_batch:
                raise KeyError(
                    "grpo_objective has beta != 0 but the micro-batch has no 'ref_logps': "
                    "pass ref_params to make_rollout"
                )
            ref = micro_batch["ref_logps"].to(logps)
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.kl_bias_correction:
                kl = kl * ratio
            per_token = per_token + self.beta * kl
            aux["kl"] = metric(kl.detach())
        low = ((ratio < 1 - self.epsilon) & (adv < 0)).to(logps.dtype)
        high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).to(logps.dtype)
        aux["clip_ratio/low_mean"] = metric(low)
        aux["clip_ratio/high_mean"] = metric(high)
        aux["clip_ratio/region_mean"] = metric(low + high)
        return self._aggregate(per_token, mask, n, block), aux


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Return the entropy of each position's next-token distribution ``softmax(logits / temperature)``.

    >>> [round(h, 4) for h in token_entropy(torch.zeros(1, 2, 4))[0].tolist()]  # uniform over 4: ln 4
    [1.3863, 1.3863]
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _chunked_entropy(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, chunk_size: int, temperature: float
) -> Tensor:
    flat = hidden.reshape(-1, hidden.shape[-1])
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        logits = flat[start : start + chunk_size] @ weight.T
        parts.append(token_entropy(logits if bias is None else logits + bias, temperature))
    return torch.cat(parts).reshape(hidden.shape[:-1])


def _block_size(micro_batch: Mapping[str, Tensor], key: str) -> Tensor:
    if key not in micro_batch:
        raise KeyError(
            f"loss_type='dapo' needs the micro-batch's {key!r}, which make_rollout records; "
            "build the micro-batches with make_rollout, or choose loss_type='bnpo'"
        )
    return micro_batch[key][0]


def _objective_problems(
    loss_type: str, epsilon: float, high: float, beta: float, temperature: float, max_completion_length: int | None
) -> list[str]:
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
    return problems


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
      optimizer step per generation (``optimizer_steps_per_generation=1``) this is ``bnpo``; with more, every
      step of a block has the same normaliser, as in TRL. Micro-batches that carry
      ``step_micro_batches`` (the GRPO run's) are normalised by their own generation's tokens ×
      ``step_micro_batches / generation_micro_batches``: TRL's ``N_gen · GA / steps_per_generation``,
      also when one optimizer step spans several generations.

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
    problems = _objective_problems(loss_type, epsilon, high, beta, temperature, max_completion_length)
    if problems:
        raise ValueError("invalid GRPO objective: " + "; ".join(problems))
    return GRPOObjective(
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=high,
        beta=beta,
        temperature=temperature,
        max_completion_length=max_completion_length,
        kl_bias_correction=kl_bias_correction,
        head=chunk_head(model, chunk_size, "grpo_objective"),
        chunk_size=chunk_size or 0,
    )
