"""GRPO's loss: the clipped surrogate plus ``beta``·KL(k3) to the reference, for ``make_step(objective=...)``.

The policy losses of TRL's loss types are ``trainfold.grpo.loss``'s; their sums are normalised as
the loss type asks (see :func:`grpo_objective`).
Per-token tensors are laid out like the rows: ``input_ids`` is ``prompt + completion`` per row,
right-padded, and per-token log-probs have shape ``(rows, seq - 1)`` (position t scores token
t+1), masked by ``completion_mask[:, 1:]``. :func:`completion_rows` makes the rows (with their completion mask);
:func:`spread_completions` and :func:`gather_completions` move per-token values between those positions (completion
token ``j`` at ``len(prompt) - 1 + j``) and a fixed-width ``(rows, width)`` completion layout.

>>> rows = completion_rows([[5, 6], [7]], [[1], [2, 3]])
>>> rows["input_ids"].tolist(), rows["completion_mask"].tolist()
([[5, 6, 1], [7, 2, 3]], [[0, 0, 1], [0, 1, 1]])

>>> obj = grpo_objective("dr_grpo", max_completion_length=4)
>>> obj.loss_type, obj.epsilon_high
('dr_grpo', 0.2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.chunked_loss import OutputHead, check_chunk_size, chunked_token_logps, output_head
from trainfold.core.forward import Forward, LossAux, ModelInputsObjective, Tensors
from trainfold.core.generate import pad_right, token_logps
from trainfold.core.losses import logits_of
from trainfold.grpo.loss import (
    GRPO_LOSS_TYPES,
    PolicyLoss,
    policy_loss_errors,
    policy_token_losses,
    vespo_weights,
)

__all__ = [
    "GRPO_LOSS_TYPES",
    "GRPOObjective",
    "chunk_head",
    "completion_rows",
    "gather_completions",
    "grpo_objective",
    "next_token_logps",
    "spread_completions",
    "token_entropy",
]

_BY_GENERATION = ("dapo", "cispo", "vespo")  # normalised by the generation's tokens, as TRL's dapo


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
class GRPOObjective(ModelInputsObjective):
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

    policy: PolicyLoss
    beta: float
    temperature: float
    max_completion_length: int | None
    kl_bias_correction: bool
    head: OutputHead | None = None  # set: log-probs chunk by chunk from the hidden states (loss_chunk_size)
    chunk_size: int = 0
    aux_reduction = "sum"  # its metrics are shares of the step's (normalised as its loss, or times 1/micro-batches)

    @property
    def loss_type(self) -> str:
        """The policy loss's type (``trainfold.grpo.loss.GRPO_LOSS_TYPES``)."""
        return self.policy.loss_type

    @property
    def epsilon(self) -> float:
        """The lower clip range."""
        return self.policy.epsilon

    @property
    def epsilon_high(self) -> float:
        """The upper clip range (``cispo``: the cap of the ratio)."""
        return self.policy.epsilon_high

    def count_items(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count what the loss averages over: completion tokens (``bnpo``), the generation block's
        completion tokens (``dapo``, ``cispo``, ``vespo``; once per micro-batch), or completions (otherwise)."""
        if self.loss_type == "bnpo":
            return micro_batch["completion_mask"][:, 1:].sum()
        if self.loss_type in _BY_GENERATION:
            return _block_size(micro_batch, "generation_tokens")
        return torch.tensor(micro_batch["completion_mask"].shape[0])

    def _aggregate(self, per_token: Tensor, mask: Tensor, n: Tensor, block: Tensor | None) -> Tensor:
        masked = per_token * mask
        if self.loss_type in ("grpo", "sapo"):
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n
        if self.loss_type == "luspo":  # each completion's token sum, averaged over the completions
            return masked.sum() / n
        if self.loss_type == "bnpo":
            return masked.sum() / n
        if self.loss_type in _BY_GENERATION:  # n = the block's tokens x the step's micro-batches (over ranks)
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

    def loss_of(self, forward: Forward, params: Tensors, inputs: Tensors, micro: Tensors, n: Tensor) -> LossAux:
        logps, entropy = self.logps_and_entropy(forward, params, inputs)
        return self.loss_from_logps(logps, entropy, micro, n)

    def loss_from_logps(
        self, logps: Tensor, entropy: Tensor, micro_batch: Mapping[str, Tensor], num_items_in_batch: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Return ``(loss, metrics)`` from the policy's next-token log-probs and entropies ``(rows, seq - 1)``.

        What ``__call__`` does after the forward pass: a plain function of the log-probs and the
        micro-batch (``completion_mask``, ``advantages``, optional ``old_logps`` and ``ref_logps``).
        """
        mask = micro_batch["completion_mask"][:, 1:].to(logps.dtype)
        old = micro_batch.get("old_logps")
        old = logps.detach() if old is None else old.to(logps)
        adv = micro_batch["advantages"].to(logps)[:, None]
        per_token, ratio = policy_token_losses(logps, old, adv, mask, self.policy)
        if "importance_sampling_ratio" in micro_batch:  # TRL: the policy loss times the sampler's IS weight
            per_token = per_token * micro_batch["importance_sampling_ratio"].to(logps)
        n = num_items_in_batch.to(logps.dtype)
        by_gen = self.loss_type in _BY_GENERATION
        block = _block_size(micro_batch, "generation_micro_batches").to(logps) if by_gen else None
        if by_gen and "step_micro_batches" in micro_batch:  # TRL: each micro-batch by its own generation
            n = (micro_batch["generation_tokens"][0] * micro_batch["step_micro_batches"][0]).to(logps)
        metric = self._metric(micro_batch, mask, n, block)
        aux: dict[str, Tensor] = {"entropy": metric(entropy)}
        if self.beta != 0:
            if "ref_logps" not in micro_batch:
                raise KeyError(
                    "grpo_objective has beta != 0 but the micro-batch has no 'ref_logps': "
                    "run it on grpo_stream's batches (beta > 0 scores the reference), or pass ref_logps"
                )
            ref = micro_batch["ref_logps"].to(logps)
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.kl_bias_correction:
                kl = kl * ratio
            per_token = per_token + self.beta * kl
            aux["kl"] = metric(kl.detach())
        aux.update(_ratio_metrics(self.policy, ratio.detach(), (logps - old).detach(), adv, mask, metric))
        if "step_micro_batches" in micro_batch and "clip_ratio/low_mean" in aux:  # TRL's per-micro-batch extremes
            share = 1 / micro_batch["step_micro_batches"][0].to(mask)
            aux.update(_clip_extremes(self.policy, ratio.detach(), adv, mask, share))
        return self._aggregate(per_token, mask, n, block), aux

    def _metric(
        self, micro_batch: Mapping[str, Tensor], mask: Tensor, n: Tensor, block: Tensor | None
    ) -> Callable[[Tensor], Tensor]:
        if "step_micro_batches" in micro_batch:  # TRL's metrics: means per micro-batch, averaged over the step
            share = 1 / micro_batch["step_micro_batches"][0].to(mask)

            def metric(x: Tensor) -> Tensor:
                if x.shape[-1] == 1:  # one value per completion (sequence-level ratios): a mean over completions
                    return x.sum() / x.shape[0] * share
                return (x * mask).sum() / mask.sum().clamp(min=1) * share

            return metric
        return lambda x: self._aggregate(x, mask, n, block)  # aggregated like the loss


def _ratio_metrics(
    p: PolicyLoss, ratio: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, metric: Callable[[Tensor], Tensor]
) -> dict[str, Tensor]:
    """Return TRL's ratio metrics: clip fractions (clipped losses), ``cispo_clip_ratio``, ``vespo/phi_seq_mean``."""
    if p.loss_type == "cispo":
        return {"cispo_clip_ratio": metric(((ratio > p.epsilon_high) & (adv > 0)).to(mask.dtype))}
    if p.loss_type == "vespo":
        return {"vespo/phi_seq_mean": metric(vespo_weights(adv, log_ratio, mask, p))}
    if p.loss_type == "sapo":
        return {}
    low = ((ratio < 1 - p.epsilon) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + p.epsilon_high) & (adv > 0)).to(mask.dtype)
    return {
        "clip_ratio/low_mean": metric(low),
        "clip_ratio/high_mean": metric(high),
        "clip_ratio/region_mean": metric(low + high),
    }


def _clip_extremes(p: PolicyLoss, ratio: Tensor, adv: Tensor, mask: Tensor, share: Tensor) -> dict[str, Tensor]:
    """Return TRL's ``clip_ratio/low_min`` and ``clip_ratio/high_max``: the least low-clipped and the most
    high-clipped completion's fraction of clipped tokens in the micro-batch (NaN-skipping), times ``share``."""

    def per_completion(x: Tensor) -> Tensor:
        fractions = x[:, 0] if x.shape[-1] == 1 else (x * mask).sum(-1) / mask.sum(-1)
        return fractions[~torch.isnan(fractions)]

    low = per_completion(((ratio < 1 - p.epsilon) & (adv < 0)).to(mask.dtype))
    high = per_completion(((ratio > 1 + p.epsilon_high) & (adv > 0)).to(mask.dtype))
    nan = torch.full((), float("nan"), dtype=mask.dtype, device=mask.device)
    return {
        "clip_ratio/low_min": (low.min() if low.numel() else nan) * share,
        "clip_ratio/high_max": (high.max() if high.numel() else nan) * share,
    }


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
            f"loss_type='dapo' needs the micro-batch's {key!r}, which grpo_stream's batches carry; "
            "train on grpo_stream(...).stream(), or choose loss_type='bnpo'"
        )
    return micro_batch[key][0]


def _objective_problems(
    policy: PolicyLoss, beta: float, temperature: float, max_completion_length: int | None
) -> list[str]:
    problems = policy_loss_errors(policy)
    if policy.loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length < 1):
        problems.append("loss_type='dr_grpo' divides by max_completion_length: pass the run's max_completion_length")
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
    **policy: Any,
) -> GRPOObjective:
    """Return the GRPO objective: per token the policy loss (``−min(r·A, clip(r, 1−ε, 1+ε_high)·A)``...) ``+ β·KL``.

    ``r = π_θ / π_old``, ``π_old`` the micro-batch's ``old_logps`` (else the current log-probs without
    gradient: ``r = 1``, gradient ``∇ log π``). Each ``loss_type``'s policy loss is
    :func:`trainfold.grpo.loss.policy_token_losses`; its other settings are keywords
    (``trainfold.grpo.loss.PolicyLoss``: TRL's names and defaults). KL is the k3 estimator
    ``exp(ref − logπ) − (ref − logπ) − 1`` against ``ref_logps``, times ``r`` when ``kl_bias_correction``
    (TRL's default). Token losses are summed over completion tokens, then normalised over the optimizer step:

    * ``grpo``, ``sapo``: each completion's token mean, averaged over the step's completions;
    * ``luspo``: each completion's token sum, averaged over the step's completions;
    * ``bnpo``: the token mean over all the step's completion tokens (TRL divides per
      micro-batch instead; the two agree with one micro-batch per step);
    * ``dr_grpo``: the token sum over ``completions × max_completion_length``;
    * ``dapo`` (TRL's default), ``cispo``, ``vespo``: the token sum over the generation block's completion
      tokens per optimizer step (its total over all ranks divided by the optimizer steps it feeds): ``bnpo``
      with one optimizer step per generation; with more, every step of a block has TRL's normaliser.
      Micro-batches that carry ``step_micro_batches`` (the GRPO run's) are normalised by their own
      generation's tokens × ``step_micro_batches / generation_micro_batches``: TRL's
      ``N_gen · GA / steps_per_generation``, also when one optimizer step spans several generations.

    Metrics (``clip_ratio/{low,high,region}_mean``, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``kl``) are
    aggregated the same way (the run adds TRL's ``clip_ratio/{low_min,high_max}``). ``temperature`` must be the
    sampling temperature; ``chunk_size`` (with ``model``, a causal LM) takes the log-probs chunk by chunk.

    >>> grpo_objective("luspo", importance_sampling_level="sequence").policy.importance_sampling_level
    'sequence'
    """
    unknown = sorted(set(policy) - set(attrs.fields_dict(PolicyLoss)))
    if unknown:
        raise TypeError(
            f"grpo_objective got unknown settings {unknown}; the policy-loss settings are those of PolicyLoss"
        )
    high = epsilon if epsilon_high is None else epsilon_high
    settings = PolicyLoss(loss_type=loss_type, epsilon=epsilon, epsilon_high=high, **policy)
    problems = _objective_problems(settings, beta, temperature, max_completion_length)
    if problems:
        raise ValueError("invalid GRPO objective: " + "; ".join(problems))
    return GRPOObjective(
        policy=settings,
        beta=beta,
        temperature=temperature,
        max_completion_length=max_completion_length,
        kl_bias_correction=kl_bias_correction,
        head=chunk_head(model, chunk_size, "grpo_objective"),
        chunk_size=chunk_size or 0,
    )


def completion_rows(
    prompt_ids: Sequence[list[int]], completions: Sequence[list[int]], pad: int = 0
) -> dict[str, Tensor]:
    """Return ``input_ids``, ``attention_mask`` and ``completion_mask`` of the rows ``prompt + completion``."""
    ids, attention = pad_right([p + c for p, c in zip(prompt_ids, completions)], pad)
    completion_mask = attention.clone()
    for row, p in enumerate(prompt_ids):
        completion_mask[row, : len(p)] = 0
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion_mask}


def spread_completions(values: Tensor, prompt_lengths: Sequence[int], lengths: Sequence[int], width: int) -> Tensor:
    """Place completion-position values ``(rows, C)`` at their next-token positions ``(rows, width)``.

    >>> spread_completions(torch.tensor([[1.0, 2.0]]), [2], [2], 4).tolist()
    [[0.0, 1.0, 2.0, 0.0]]
    """
    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    for row, (p, n) in enumerate(zip(prompt_lengths, lengths)):
        out[row, p - 1 : p - 1 + n] = values[row, :n]
    return out


def gather_completions(values: Tensor, prompt_lengths: Sequence[int], lengths: Sequence[int], width: int) -> Tensor:
    """Return the completion-position values ``(rows, width)`` of next-token values (inverse of ``spread``).

    >>> gather_completions(torch.tensor([[0.0, 1.0, 2.0, 0.0]]), [2], [2], 3).tolist()
    [[1.0, 2.0, 0.0]]
    """
    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    for row, (p, n) in enumerate(zip(prompt_lengths, lengths)):
        out[row, :n] = values[row, p - 1 : p - 1 + n]
    return out
