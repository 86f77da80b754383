"""The DPO loss of each preference pair, from policy and reference log-probs (TRL's loss types).

>>> import torch
>>> dpo(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1).shape
torch.Size([1])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DPO_LOSS_TYPES", "dpo", "dpo_loss_errors"]

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


def dpo_loss_errors(beta: float, loss_type: str, label_smoothing: float) -> list[str]:
    """Return every problem with DPO loss settings (empty when they are valid).

    >>> dpo_loss_errors(0.1, "sigmoid", 0.0)
    []
    """
    problems = []
    if loss_type not in DPO_LOSS_TYPES:
        problems.append(f"loss_type={loss_type!r} is not one of {list(DPO_LOSS_TYPES)}")
    if not beta > 0:
        problems.append(f"beta={beta} must be > 0")
    if loss_type == "robust" and not 0 <= label_smoothing < 0.5:
        problems.append(f"label_smoothing={label_smoothing} must be in [0, 0.5) for the robust loss")
    if loss_type in ("sigmoid", "hinge", "ipo") and label_smoothing != 0:
        problems.append(
            f"label_smoothing={label_smoothing} has no effect on loss_type={loss_type!r}; "
            "use loss_type='robust' for noisy preference labels, or label_smoothing=0"
        )
    return problems


def dpo(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> Tensor:
    """Return the DPO loss of each pair (shape ``(pairs,)``; take ``.mean()`` for TRL's value).

    With ``ρ = policy − ref`` per sequence and ``Δ = ρ_c − ρ_r``:
    ``sigmoid`` ``−log σ(βΔ)``; ``hinge`` ``max(0, 1 − βΔ)``;
    ``ipo`` ``(ρ_c/n_c − ρ_r/n_r − 1/(2β))²`` with the completion lengths ``n`` (needs
    ``chosen_lengths`` and ``rejected_lengths``); ``robust``
    ``(−(1−ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε)`` with ``ε = label_smoothing``.

    >>> import torch
    >>> t = lambda *x: torch.tensor(x)
    >>> round(dpo(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5).item(), 4)  # -log σ(0.5·2)
    0.3133
    >>> dpo(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, loss_type="hinge").item()
    0.0
    """
    problems = dpo_loss_errors(beta, loss_type, label_smoothing)
    if loss_type == "ipo" and (chosen_lengths is None or rejected_lengths is None):
        problems.append("loss_type='ipo' is length-normalised: pass chosen_lengths and rejected_lengths")
    if problems:
        raise ValueError("; ".join(problems))
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    z = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type == "ipo":
        assert chosen_lengths is not None and rejected_lengths is not None
        margin = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
        return (margin - 1 / (2 * beta)) ** 2
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
