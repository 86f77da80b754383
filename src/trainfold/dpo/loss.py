"""The DPO loss of each preference pair, from policy and reference log-probs (TRL 1.16's 15 loss types).

Every loss is a function of the summed completion log-probs of the pairs (and, for the
length-normalised ``ipo``, ``sigmoid_norm`` and ``sft``, of the completion token counts), so a user
can call :func:`dpo` from any loop. A list of loss types with ``loss_weights`` is TRL's MPO mix:
``Σ_k w_k · ℓ_k`` per pair, whose mean over the pairs is TRL's ``Σ_k w_k · mean ℓ_k``.

>>> import torch
>>> dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1).shape
torch.Size([1])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DPO_LOSS_TYPES", "dpo_loss", "dpo_loss_errors", "loss_types_of"]

_SMOOTHED = ("robust", "exo_pair", "aot", "aot_unpaired")  # the loss types that read label_smoothing
_NEEDS_LENGTHS = ("ipo", "sigmoid_norm", "sft")


def loss_types_of(loss_type: str | Sequence[str]) -> tuple[str, ...]:
    """Return ``loss_type`` as a tuple of names (TRL accepts one name or a list).

    >>> loss_types_of("sigmoid"), loss_types_of(["sigmoid", "sft"])
    (('sigmoid',), ('sigmoid', 'sft'))
    """
    return (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)


def dpo_loss_errors(
    beta: float,
    loss_type: str | Sequence[str],
    label_smoothing: float,
    loss_weights: Sequence[float] | None = None,
    discopop_tau: float = 0.05,
) -> list[str]:
    """Return every problem with DPO loss settings (empty when they are valid).

    >>> dpo_loss_errors(0.1, "sigmoid", 0.0)
    []
    >>> dpo_loss_errors(0.1, ["sigmoid", "sft"], 0.0, loss_weights=[1.0])
    ['loss_weights=[1.0] has 1 weights for 2 loss types; give one weight per loss type']
    """
    problems = []
    types = loss_types_of(loss_type)
    unknown = [t for t in types if t not in DPO_LOSS_TYPES]
    if unknown or not types:
        problems.append(f"loss_type={loss_type!r} is not one of {list(DPO_LOSS_TYPES)} (or a list of them)")
    if loss_weights is not None and len(loss_weights) != len(types):
        problems.append(
            f"loss_weights={list(loss_weights)} has {len(loss_weights)} weights for {len(types)} loss types; "
            "give one weight per loss type"
        )
    if not beta > 0:
        problems.append(f"beta={beta} must be > 0")
    if "robust" in types and not 0 <= label_smoothing < 0.5:
        problems.append(f"label_smoothing={label_smoothing} must be in [0, 0.5) for the robust loss")
    if "exo_pair" in types and not 0 < label_smoothing < 1:
        problems.append(f"label_smoothing={label_smoothing} must be in (0, 1) for exo_pair (the EXO paper uses 1e-3)")
    if types and not unknown and label_smoothing != 0 and not set(types) & set(_SMOOTHED):
        problems.append(
            f"label_smoothing={label_smoothing} has no effect on loss_type={loss_type!r}; "
            f"use one of {list(_SMOOTHED)} for noisy preference labels, or label_smoothing=0"
        )
    if "discopop" in types and not discopop_tau > 0:
        problems.append(f"discopop_tau={discopop_tau} must be > 0")
    return problems


def _smoothed_logistic(z: Tensor, eps: float) -> Tensor:
    return -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps


@attrs.frozen(eq=False)
class _Pairs:
    """What every loss type reads: the pairs' summed log-probs (policy ``p``, reference ``r``; chosen ``c``,
    rejected ``r``), the completion token counts, and the settings ``beta``, ``eps`` (label smoothing), ``tau``."""

    pc: Tensor
    pr: Tensor
    rc: Tensor
    rr: Tensor
    nc: Tensor | None
    nr: Tensor | None
    beta: float
    eps: float
    tau: float

    @property
    def chosen(self) -> Tensor:  # ρ_c
        return self.pc - self.rc

    @property
    def rejected(self) -> Tensor:  # ρ_r
        return self.pr - self.rr

    @property
    def z(self) -> Tensor:  # βΔ
        return self.beta * (self.chosen - self.rejected)

    def normalised_margin(self) -> Tensor:  # ρ_c/n_c − ρ_r/n_r
        assert self.nc is not None and self.nr is not None
        return self.chosen / self.nc.clamp(min=1) - self.rejected / self.nr.clamp(min=1)


def _exo_pair(p: _Pairs) -> Tensor:
    z, eps = p.z, p.eps
    return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(torch.tensor(-eps))) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - torch.log(torch.tensor(eps))
    )


def _nca_pair(p: _Pairs) -> Tensor:
    c, r = p.beta * p.chosen, p.beta * p.rejected
    return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)


def _discopop(p: _Pairs) -> Tensor:
    mix = torch.sigmoid(p.z / p.tau)
    return -F.logsigmoid(p.z) * (1 - mix) + torch.exp(-p.z) * mix


def _sft(p: _Pairs) -> Tensor:  # the token mean of the chosen completions, the same for every pair
    assert p.nc is not None
    return (-p.pc.sum() / p.nc.sum()).expand(p.pc.shape[0])


def _sorted(t: Tensor) -> Tensor:
    return torch.sort(t, dim=0)[0]


# the per-pair loss of each loss type (the formulas of dpo_loss's doc)
_LOSSES: dict[str, Callable[[_Pairs], Tensor]] = {
    "sigmoid": lambda p: -F.logsigmoid(p.z),
    "hinge": lambda p: torch.relu(1 - p.z),
    "ipo": lambda p: (p.normalised_margin() - 1 / (2 * p.beta)) ** 2,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "robust": lambda p: (-(1 - p.eps) * F.logsigmoid(p.z) + p.eps * F.logsigmoid(-p.z)) / (1 - 2 * p.eps),
    "bco_pair": lambda p: -F.logsigmoid(p.beta * p.chosen) - F.logsigmoid(-p.beta * p.rejected),
    "sppo_hard": lambda p: (p.chosen - 0.5 / p.beta) ** 2 + (p.rejected + 0.5 / p.beta) ** 2,
    # sorted over the pairs: the i-th loss belongs to the i-th smallest margins, not to pair i
    "aot": lambda p: _smoothed_logistic(p.beta * (_sorted(p.pc - p.pr) - _sorted(p.rc - p.rr)), p.eps),
    "aot_unpaired": lambda p: _smoothed_logistic(p.beta * (_sorted(p.chosen) - _sorted(p.rejected)), p.eps),
    "apo_zero": lambda p: (1 - torch.sigmoid(p.beta * p.chosen)) + torch.sigmoid(p.beta * p.rejected),
    "apo_down": lambda p: torch.sigmoid(p.beta * p.chosen) + (1 - torch.sigmoid(p.z)),
    "discopop": _discopop,
    "sft": _sft,
    "sigmoid_norm": lambda p: -F.logsigmoid(p.beta * p.normalised_margin()),
}
DPO_LOSS_TYPES = tuple(_LOSSES)  # TRL's order


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    loss_type: str | Sequence[str] = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    *,
    loss_weights: Sequence[float] | None = None,
    discopop_tau: float = 0.05,
) -> Tensor:
    """Return the DPO loss of each pair (shape ``(pairs,)``; take ``.mean()`` for TRL's value).

    With ``ρ = policy − ref`` per sequence, ``Δ = ρ_c − ρ_r``, ``n`` the completion token
    counts and ``ε = label_smoothing``: ``sigmoid`` ``−log σ(βΔ)``; ``hinge`` ``max(0, 1 − βΔ)``;
    ``ipo`` ``(ρ_c/n_c − ρ_r/n_r − 1/(2β))²``; ``sigmoid_norm`` ``−log σ(β(ρ_c/n_c − ρ_r/n_r))``;
    ``robust`` ``(−(1−ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε)``; ``exo_pair`` the KL of
    ``σ(±βΔ)`` from ``(1−ε, ε)``; ``nca_pair`` ``−log σ(βρ_c) − ½log σ(−βρ_c) − ½log σ(−βρ_r)``;
    ``bco_pair`` ``−log σ(βρ_c) − log σ(−βρ_r)``; ``sppo_hard`` ``(ρ_c − 1/(2β))² + (ρ_r + 1/(2β))²``;
    ``aot`` / ``aot_unpaired`` the smoothed logistic loss of sorted policy minus sorted reference margins
    (resp. sorted ``ρ_c`` minus sorted ``ρ_r``); ``apo_zero`` ``1 − σ(βρ_c) + σ(βρ_r)``; ``apo_down``
    ``σ(βρ_c) + 1 − σ(βΔ)``; ``discopop`` the logistic and exponential losses of ``βΔ`` mixed by
    ``σ(βΔ/discopop_tau)``; ``sft`` ``−Σ π_c / Σ n_c`` (the chosen completions' token mean).
    ``ipo``, ``sigmoid_norm`` and ``sft`` need ``chosen_lengths`` (and ``rejected_lengths``).

    >>> import torch
    >>> t = lambda *x: torch.tensor(x)
    >>> round(dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5).item(), 4)  # -log σ(0.5·2)
    0.3133
    >>> dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, loss_type="hinge").item()
    0.0
    >>> mixed = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), 0.5, ["sigmoid", "hinge"], loss_weights=[2.0, 1.0])
    >>> round(mixed.item(), 4)
    0.6265
    """
    problems = dpo_loss_errors(beta, loss_type, label_smoothing, loss_weights, discopop_tau)
    types = loss_types_of(loss_type)
    needs = [t for t in types if t in _NEEDS_LENGTHS]
    if needs and (chosen_lengths is None or rejected_lengths is None):
        problems.append(f"loss_type={needs} is length-normalised: pass chosen_lengths and rejected_lengths")
    if problems:
        raise ValueError("; ".join(problems))
    weights = [None] * len(types) if loss_weights is None else list(loss_weights)
    pairs = _Pairs(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths,
        beta, label_smoothing, discopop_tau,
    )  # fmt: skip
    total = None
    for name, weight in zip(types, weights, strict=True):
        part = _LOSSES[name](pairs)
        part = part if weight is None else part * weight
        total = part if total is None else total + part
    assert total is not None
    return total
