"""The ensemble's update: clipping and AdamW on the stacked members' tensors, with per-member hyperparameters.

Element-wise ops only (no ``torch._foreach_*``, which vmap cannot batch), so it also traces under
``torch.compile``; a hyperparameter the members share is one float, else a ``(K,)`` tensor broadcast
against each stacked tensor (``trainfold.recipes.ensemble`` runs it).

>>> import torch
>>> _uniform([0.9, 0.9]), _uniform([0.1, 0.2]).tolist()
(0.9, [0.10000000149011612, 0.20000000298023224])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch
from torch import Tensor

from trainfold.core.state import TrainState
from trainfold.optim import AdamState, OptimizerPlan, adamw_update

__all__ = ["member_hyperparameters", "stacked_update"]


@overload
def _bcast(x: Tensor, like: Tensor) -> Tensor: ...
@overload
def _bcast(x: float | Tensor, like: Tensor) -> float | Tensor: ...
def _bcast(x: float | Tensor, like: Tensor) -> float | Tensor:
    return x.reshape((-1,) + (1,) * (like.dim() - 1)) if isinstance(x, Tensor) else x


def stacked_update(
    clips: Sequence[float | Tensor],
    decay: list[float | Tensor],
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    lr: Tensor,
    step_size: Tensor,
    bc2_sqrt: Tensor,
    b1: float | Tensor,
    b2: float | Tensor,
    eps: float | Tensor,
    active: Tensor,
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """Clip per member and apply AdamW to stacked tensors; members not ``active`` keep their values."""

    def member_norm(gs: list[Tensor]) -> Tensor:
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.reshape(g.shape[0], -1).float(), dim=1) for g in gs]), dim=0
        )

    norm = member_norm(grads)
    for i, max_norm in enumerate(clips):
        coef = torch.clamp(max_norm / ((member_norm(grads) if i else norm) + 1e-6), max=1.0)
        grads = [g * _bcast(coef, g) for g in grads]
    new_p, new_mu, new_nu = [], [], []
    for p, g, m, v, wd in zip(params, grads, mu, nu, decay):
        (q,), (m2,), (v2,) = adamw_update(
            [p],
            [g],
            [m],
            [v],
            [_bcast(wd, p)],
            _bcast(lr, p),
            _bcast(step_size, p),
            _bcast(bc2_sqrt, p),
            _bcast(b1, p),
            _bcast(b2, p),
            _bcast(eps, p),
        )
        keep = _bcast(active, p)
        new_p.append(torch.where(keep, q, p))
        new_mu.append(torch.where(keep, m2, m))
        new_nu.append(torch.where(keep, v2, v))
    return norm, new_p, new_mu, new_nu


def _uniform(values: Sequence[float]) -> float | Tensor:
    """One float when all members agree, else a float32 (K,) tensor."""
    return float(values[0]) if len(set(values)) == 1 else torch.tensor(values, dtype=torch.float32)


def member_hyperparameters(
    opts: list[OptimizerPlan], state: TrainState, adam: AdamState, device: torch.device
) -> tuple[dict[str, Any], Tensor]:
    """Return ``stacked_update``'s per-member hyperparameters (keyword arguments) and the members' learning rates.

    A hyperparameter is one float where all members agree, else a ``(K,)`` tensor on ``device``.
    """
    scalars = [o.scalars(int(c)) for o, c in zip(opts, adam.count)]
    lr, step_size, bc2_sqrt = (
        torch.tensor([s[j] for s in scalars], dtype=torch.float32, device=device) for j in range(3)
    )
    decays = [o.decay(state.params) for o in opts]
    b1, b2, eps = (_to(_uniform([getattr(o, h) for o in opts]), device) for h in ("b1", "b2", "eps"))
    hyper = dict(
        clips=[_to(_uniform([o.clips[j] for o in opts]), device) for j in range(len(opts[0].clips))],
        decay=[_to(_uniform([d[name] for d in decays]), device) for name in state.params],
        lr=lr,
        step_size=step_size,
        bc2_sqrt=bc2_sqrt,
        b1=b1,
        b2=b2,
        eps=eps,
    )
    return hyper, torch.tensor([s[0] for s in scalars], dtype=torch.float64)


def _to(x: float | Tensor, device: torch.device) -> float | Tensor:
    return x.to(device) if isinstance(x, Tensor) else x
