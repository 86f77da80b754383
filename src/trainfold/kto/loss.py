"""The KTO loss of each unpaired row, from policy and reference log-probs (TRL 1.16's ``KTOTrainer``).

With ``r = logp − ref_logp`` (summed completion log-probs) and ``z`` the KL estimate
(:func:`kl_estimate`: the mean of ``logp − ref_logp`` over the batch's mismatched KL pairs, detached,
clamped at 0), ``loss_type="kto"`` gives a desirable row ``w_d · (1 − σ(β(r − z)))`` and an undesirable
row ``w_u · (1 − σ(β(z − r)))``; ``"apo_zero_unpaired"`` needs no KL: ``w_d · (1 − σ(βr))`` and ``w_u · σ(βr)``.
The loss of a batch is the mean over its rows (TRL's ``nanmean`` of the weighted losses).

>>> import torch
>>> zero = torch.zeros(2)
>>> kto_loss(zero, zero, torch.tensor([True, False]), torch.tensor(0.0), beta=0.1).tolist()  # policy == reference
[0.5, 0.5]
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KTO_LOSS_TYPES", "kl_estimate", "kto_loss", "kto_loss_errors"]

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_loss_errors(beta: float, loss_type: str, desirable_weight: float, undesirable_weight: float) -> list[str]:
    """Return every problem with KTO loss settings (empty when they are valid).

    >>> kto_loss_errors(0.1, "sigmoid", 1.0, -1.0)  # doctest: +NORMALIZE_WHITESPACE
    ["loss_type='sigmoid' is not one of ['kto', 'apo_zero_unpaired']",
     'undesirable_weight=-1.0 must be >= 0']
    """
    problems = []
    if loss_type not in KTO_LOSS_TYPES:
        problems.append(f"loss_type={loss_type!r} is not one of {list(KTO_LOSS_TYPES)}")
    if not beta > 0:
        problems.append(f"beta={beta} must be > 0")
    for name, w in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not w >= 0:
            problems.append(f"{name}={w} must be >= 0")
    return problems


def kl_estimate(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """Return TRL's KL estimate of a batch: ``mean(kl_logps − ref_kl_logps)`` over its mismatched pairs, detached,
    clamped at 0.

    >>> import torch
    >>> kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0])).item(), kl_estimate(-torch.ones(1),
    ...     torch.zeros(1)).item()
    (0.5, 0.0)
    """
    return (kl_logps - ref_kl_logps.to(kl_logps)).mean().detach().clamp(min=0)


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    label: Tensor,
    kl: Tensor,
    beta: float,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Tensor:
    """Return each row's weighted KTO loss (see the module doc); ``label`` True marks a desirable row."""
    problems = kto_loss_errors(beta, loss_type, desirable_weight, undesirable_weight)
    if problems:
        raise ValueError("; ".join(problems))
    ratio = logps - ref_logps.to(logps)
    desirable = label.to(torch.bool)
    if loss_type == "kto":
        kl = kl.to(logps)
        chosen, rejected = 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))
    else:
        chosen, rejected = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    return torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)
