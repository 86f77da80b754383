"""The optimizers users pick, ``adamw`` and ``sgd``, as ``torch.optim.AdamW`` and ``torch.optim.SGD`` compute them.

``adamw`` runs torch's own AdamW kernels (defined in ``trainfold.optim.adam``); ``sgd`` is weight decay,
``trace`` (momentum) and the learning rate, with torch's op order (bitwise ``torch.optim.SGD``).
Their states are an ``AdamState`` and an ``SgdState``; ``chain`` puts clipping in front.

>>> import torch
>>> from trainfold.optim import chain, clip_by_global_norm
>>> opt = chain(clip_by_global_norm(1.0), sgd(0.1))
>>> params = {"w": torch.tensor([1.0])}
>>> new, state = opt.apply({"w": torch.tensor([10.0])}, opt.init(params), params)
>>> round(new["w"].item(), 4)  # the gradient was clipped to norm 1
0.9
"""

from __future__ import annotations

import attrs

from trainfold.core.tree import Tree
from trainfold.optim.adam import adamw
from trainfold.optim.masks import Mask
from trainfold.optim.schedules import Schedule, as_schedule
from trainfold.optim.transform import GradientTransformation, rate_value
from trainfold.optim.transforms import AddDecayedWeights, SgdState, Trace, scaled_tree, trace

__all__ = ["SGD", "adamw", "sgd"]


def sgd(
    learning_rate: float | Schedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
    mask: Mask | None = None,
    *,
    maximize: bool = False,
) -> SGD:
    """SGD with optional momentum, dampening, Nesterov and (coupled) weight decay, as ``torch.optim.SGD``.

    ``mask`` (as in :func:`adamw`; ``None`` decays every param) picks the params weight decay applies to;
    ``maximize`` ascends the objective (the gradients negated first, as torch does).

    >>> import torch
    >>> opt = sgd(0.5)
    >>> p = {"w": torch.tensor(1.0)}
    >>> opt.apply({"w": torch.tensor(2.0)}, opt.init(p), p)[0]["w"].item()
    0.0
    """
    decay = AddDecayedWeights(float(weight_decay), mask)
    return SGD(as_schedule(learning_rate), decay, trace(momentum, dampening, nesterov), bool(maximize))


@attrs.frozen(eq=False)
class SGD(GradientTransformation):
    """See :func:`sgd`: weight decay, then momentum, then the learning rate; its state is an ``SgdState``."""

    schedule: Schedule
    decay: AddDecayedWeights
    trace: Trace
    maximize: bool = False
    name = "sgd"

    def init(self, params: Tree) -> SgdState:
        return self.trace.init(params)

    def learning_rate(self, state: SgdState) -> float:
        return rate_value(self.schedule(int(state.count)))

    def update(self, grads: Tree, state: SgdState, params: Tree) -> tuple[Tree, SgdState]:
        if self.maximize:
            grads = {k: -g for k, g in grads.items()}
        decayed, _ = self.decay.update(grads, (), params)
        direction, new_state = self.trace.update(decayed, state, params)
        return scaled_tree(direction, -self.schedule(int(state.count))), new_state
