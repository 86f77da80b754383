"""The element-wise AdamW plan that the compiled and ensemble steps run, assembled from the transforms.

Each transformation offers its traceable element-wise part (``elementwise()``); a plan is the
clipping parts, then Adam's moments, the weight decay and the learning rate (``adamw`` after any
number of ``clip_by_global_norm``). ``OptimizerPlan.update`` is the update graph's body.

>>> import torch
>>> from trainfold.optim import adamw
>>> plan = optimizer_plan(adamw(1e-3))
>>> plan.clips, plan.b1
((), 0.9)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from torch import Tensor

from trainfold.core.tree import global_norm
from trainfold.optim.adam import AdamState, ElementwiseAdam, adamw_update
from trainfold.optim.schedules import Schedule
from trainfold.optim.transform import GradientTransformation
from trainfold.optim.transforms import ElementwiseClip, ElementwiseDecay, ElementwiseRate

__all__ = ["OptimizerPlan", "adamw_update", "optimizer_plan"]

SUPPORTED = "chain(clip_by_global_norm(...), adamw(...))"


@attrs.frozen
class OptimizerPlan:
    """What the element-wise AdamW path needs: clipping parts, then Adam, weight decay and learning rate.

    ``clips`` are the ``max_norm`` values applied in order before AdamW; ``decay(params)`` maps each
    param to its weight decay; ``adam_of(opt_state)`` takes the AdamW state out of the optimizer's
    state and ``wrap(opt_state, adam_state)`` puts a new one back.

    >>> import torch
    >>> from trainfold.optim import adamw, chain, clip_by_global_norm
    >>> opt = chain(clip_by_global_norm(1.0), adamw(0.1, weight_decay=0.01))
    >>> plan = optimizer_plan(opt)
    >>> params = {"weight": torch.ones(2, 2), "bias": torch.zeros(2)}
    >>> plan.decay(params), plan.adam_of(opt.init(params)).count.item()
    ({'weight': 0.01, 'bias': 0.0}, 0)
    """

    head: tuple[ElementwiseClip, ...]
    adam: ElementwiseAdam
    decays: ElementwiseDecay | None
    rate: ElementwiseRate

    @property
    def learning_rate(self) -> Schedule:
        """The learning-rate schedule, a function of the update count."""
        return self.rate.schedule

    @property
    def clips(self) -> tuple[float, ...]:
        """The clipping parts' ``max_norm``, in order."""
        return tuple(c.max_norm for c in self.head)

    @property
    def b1(self) -> float:
        return self.adam.b1

    @property
    def b2(self) -> float:
        return self.adam.b2

    @property
    def eps(self) -> float:
        return self.adam.eps

    def decay(self, params: Mapping[str, Tensor]) -> dict[str, float]:
        """Return ``{name: weight_decay}`` for ``params``."""
        return self.decays(params) if self.decays is not None else dict.fromkeys(params, 0.0)

    def adam_of(self, opt_state: Any) -> AdamState:
        """Return the AdamW part of ``opt_state``."""
        adam = opt_state[-1] if isinstance(opt_state, tuple) and opt_state else opt_state
        if not isinstance(adam, AdamState):
            raise TypeError(
                f"expected an AdamW state, got {type(adam).__name__}; build the state with this optimizer's init"
            )
        return adam

    def wrap(self, opt_state: Any, adam: AdamState) -> Any:
        """Return ``opt_state`` with its AdamW part replaced by ``adam``."""
        return (*opt_state[:-1], adam) if isinstance(opt_state, tuple) else adam

    def scalars(self, count: int) -> tuple[float, float, float]:
        """Return ``(learning_rate, step_size, sqrt(bias_correction2))`` for update ``count + 1``.

        >>> from trainfold.optim import adamw
        >>> [round(x, 4) for x in optimizer_plan(adamw(0.1)).scalars(0)]
        [0.1, 1.0, 0.0316]
        """
        rate = float(self.learning_rate(count))
        t = count + 1
        return rate, rate / (1.0 - self.b1**t), math.sqrt(1.0 - self.b2**t)

    def update(
        self,
        decay: Sequence[float | Tensor],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        mu: Sequence[Tensor],
        nu: Sequence[Tensor],
        lr: Tensor,
        step_size: Tensor,
        bc2_sqrt: Tensor,
    ) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """Return ``(pre-clip global norm, new params, mu, nu)``: the clipping parts, then AdamW (traceable)."""
        norm = global_norm(grads)
        for i, clip in enumerate(self.head):
            grads = clip(grads, None if i else norm)
        new_p, new_mu, new_nu = self.adam(params, grads, mu, nu, decay, lr, step_size, bc2_sqrt)
        return norm, new_p, new_mu, new_nu


def optimizer_plan(optimizer: GradientTransformation) -> OptimizerPlan:
    """Assemble the element-wise plan of ``optimizer`` from its parts' element-wise twins.

    Raises ``TypeError`` naming the part that has no element-wise path, or the order that does not fit.

    >>> from trainfold.optim import adamw, chain, clip_by_global_norm, sgd
    >>> plan = optimizer_plan(chain(clip_by_global_norm(1.0), adamw(1e-3)))
    >>> plan.clips, plan.b1
    ((1.0,), 0.9)
    >>> optimizer_plan(sgd(0.1))  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    TypeError: sgd: trace has no element-wise path in the compiled and ensemble steps; they support
    chain(clip_by_global_norm(...), adamw(...)): use trainfold.adamw, or the eager step
    """
    parts = list(optimizer.elementwise())
    head: list[ElementwiseClip] = []
    while parts and isinstance(parts[0], ElementwiseClip):
        head.append(parts.pop(0))
    adam = parts.pop(0) if parts and isinstance(parts[0], ElementwiseAdam) else None
    decays = parts.pop(0) if parts and isinstance(parts[0], ElementwiseDecay) else None
    rate = parts.pop(0) if parts and isinstance(parts[0], ElementwiseRate) else None
    if adam is None or rate is None or parts:
        raise TypeError(
            f"the compiled and ensemble steps support {SUPPORTED}; {optimizer.name} has its element-wise parts "
            f"in another order ({', '.join(type(p).__name__ for p in optimizer.elementwise())}): use the eager step"
        )
    return OptimizerPlan(tuple(head), adam, decays, rate)
