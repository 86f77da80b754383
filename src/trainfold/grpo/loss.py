"""GRPO's per-token policy losses (TRL 1.16's loss types), as plain functions of log-probs and advantages.

:func:`policy_token_losses` turns the policy's next-token log-probs, the sampling policy's
(``old``) and each completion's advantage into one loss per token (or per sequence, with
``importance_sampling_level="sequence"``); ``trainfold.grpo.objective`` adds the KL term and
normalises the sum as the loss type asks. Every tensor is ``(rows, positions)`` with a 0/1 ``mask``
of the completion tokens; advantages are ``(rows,)``.

>>> import torch
>>> logps = torch.log(torch.tensor([[0.5, 0.25]]))
>>> loss, ratio = policy_token_losses(logps, logps, torch.tensor([2.0]), torch.ones(1, 2), PolicyLoss())
>>> loss.tolist(), ratio.tolist()  # on-policy: ratio 1, loss -A per token
([[-2.0, -2.0]], [[1.0, 1.0]])
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

__all__ = ["GRPO_LOSS_TYPES", "PolicyLoss", "policy_loss_errors", "policy_token_losses", "vespo_weights"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@attrs.frozen
class PolicyLoss:
    """The settings of a policy loss, by TRL's ``GRPOConfig`` names and defaults.

    >>> PolicyLoss("cispo", epsilon_high=5.0).epsilon_high
    5.0
    """

    loss_type: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    importance_sampling_level: str = "token"  # "sequence": one ratio per completion, its tokens' mean (GSPO)
    delta: float | None = None  # caps the unclipped ratio (INTELLECT-2's two-sided clip)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


def policy_loss_errors(p: PolicyLoss) -> list[str]:
    """Return every problem with policy-loss settings (empty when valid).

    >>> policy_loss_errors(PolicyLoss(importance_sampling_level="seq"))
    ["importance_sampling_level='seq' is not one of ['token', 'sequence']"]
    """
    problems = []
    if p.loss_type not in GRPO_LOSS_TYPES:
        problems.append(f"loss_type={p.loss_type!r} is not one of {list(GRPO_LOSS_TYPES)}")
    if p.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        problems.append(
            f"importance_sampling_level={p.importance_sampling_level!r} is not one of "
            f"{list(IMPORTANCE_SAMPLING_LEVELS)}"
        )
    if not (0 <= p.epsilon < 1 and p.epsilon_high >= 0):
        problems.append(f"epsilon={p.epsilon} must be in [0, 1) and epsilon_high={p.epsilon_high} >= 0")
    if p.delta is not None and not p.delta > 1 + p.epsilon_high:
        problems.append(f"delta={p.delta} must be > 1 + epsilon_high (it caps the unclipped ratio), or None")
    if not (p.sapo_temperature_pos > 0 and p.sapo_temperature_neg > 0):
        problems.append("sapo_temperature_pos and sapo_temperature_neg must be > 0")
    return problems


@torch.no_grad()
def vespo_weights(advantages: Tensor, log_ratio: Tensor, mask: Tensor, p: PolicyLoss) -> Tensor:
    """Return VESPO's gamma weight ``φ(w) = e^λ · w^k · e^{−λw}`` per completion, ``(rows, 1)``, without grad.

    ``w = exp(Σ_t clamp(log r_t, ±20))`` over the completion tokens, clamped to ``[1e-8, e^20]``;
    ``k, λ`` are the ``_pos`` settings where ``A >= 0``, else the ``_neg`` ones (``φ(1) = 1``).

    >>> import torch
    >>> vespo_weights(torch.tensor([1.0]), torch.zeros(1, 3), torch.ones(1, 3), PolicyLoss("vespo")).tolist()
    [[1.0]]
    """
    floor = math.log(1e-8)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(floor, 20.0)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    positive = adv >= 0
    k = torch.where(positive, p.vespo_k_pos, p.vespo_k_neg)
    lam = torch.where(positive, p.vespo_lambda_pos, p.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * seq - lam * seq.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def policy_token_losses(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, p: PolicyLoss
) -> tuple[Tensor, Tensor]:
    """Return ``(loss, ratio)``: the policy loss per token and the importance ratio ``r = π_θ/π_old``.

    Both are ``(rows, positions)``, or ``(rows, 1)`` with ``importance_sampling_level="sequence"``
    (``log r`` = the completion's mean token log-ratio). With ``A`` the advantage:

    * ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``−min(r·A, clip(r, 1−ε, 1+ε_high)·A)``
      (``r`` first capped at ``delta`` when it is set);
    * ``cispo``: ``−stopgrad(min(r, ε_high)) · A · log π_θ``;
    * ``sapo``: ``−(4/τ)·σ(τ(r − 1)) · A``, ``τ`` = ``sapo_temperature_pos`` where ``A > 0``, else ``_neg``;
    * ``vespo``: ``−φ(w) · A · log π_θ`` with :func:`vespo_weights` (token-level ratios).

    >>> import torch
    >>> logps, old = torch.log(torch.tensor([[0.9]])), torch.log(torch.tensor([[0.5]]))
    >>> loss, ratio = policy_token_losses(logps, old, torch.tensor([1.0]), torch.ones(1, 1), PolicyLoss())
    >>> round(ratio.item(), 4), round(loss.item(), 4)  # r = 1.8 clipped to 1.2
    (1.8, -1.2)
    """
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    if p.importance_sampling_level == "sequence":
        log_ratio_used = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    else:
        log_ratio_used = log_ratio
    ratio = torch.exp(log_ratio_used)
    if p.loss_type == "cispo":
        return -torch.clamp(ratio, max=p.epsilon_high).detach() * adv * logps, ratio
    if p.loss_type == "sapo":
        tau = torch.where(adv > 0, p.sapo_temperature_pos, p.sapo_temperature_neg)
        return -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv, ratio
    if p.loss_type == "vespo":
        return -vespo_weights(adv, log_ratio, mask, p) * adv * logps, ratio
    clipped = torch.clamp(ratio, 1 - p.epsilon, 1 + p.epsilon_high)
    capped = ratio if p.delta is None else torch.clamp(ratio, max=p.delta)
    return -torch.min(capped * adv, clipped * adv), ratio
