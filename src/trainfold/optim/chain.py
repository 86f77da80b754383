"""``chain``: transformations composed left to right, the state the tuple of the parts' states (optax's).

>>> import torch
>>> from trainfold.optim import adamw, clip_by_global_norm, sgd
>>> opt = chain(clip_by_global_norm(1.0), sgd(0.1))
>>> params = {"w": torch.tensor([1.0])}
>>> new, state = opt.apply({"w": torch.tensor([10.0])}, opt.init(params), params)
>>> round(new["w"].item(), 4)  # the gradient was clipped to norm 1
0.9
>>> [type(s).__name__ for s in chain(clip_by_global_norm(1.0), adamw(1e-3)).init(params)]
['tuple', 'AdamState']
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import attrs

from trainfold.core.tree import Tree, known_norm
from trainfold.optim.transform import GradientTransformation, overwrite

__all__ = ["Chain", "chain"]


def chain(*transforms: GradientTransformation, name: str = "chain") -> Chain:
    """Compose transformations left to right; ``name`` names the composite in error messages.

    The state is the tuple of the parts' states. ``apply`` runs every part's ``update`` but the
    last one's, whose ``apply`` steps the params (``adamw`` last: torch's AdamW kernels); a donated
    ``apply`` runs their ``donated_update`` (``clip_by_global_norm`` scales the donated gradients in
    place: no gradient-sized copy), bitwise the same.

    >>> import torch
    >>> from trainfold.optim import scale_by_adam, scale_by_learning_rate
    >>> opt = chain(scale_by_adam(), scale_by_learning_rate(1e-3))
    >>> [type(s).__name__ for s in opt.init({"w": torch.zeros(2)})], opt.name
    (['AdamState', 'Tensor'], 'chain')
    """
    if not transforms:
        raise ValueError("chain needs at least one transformation")
    return Chain(tuple(transforms), name)


@attrs.frozen(eq=False)
class Chain(GradientTransformation):
    """Transformations applied one after another (see :func:`chain`)."""

    parts: tuple[GradientTransformation, ...]
    name: str = "chain"

    def _split(self, state: Any) -> tuple[Any, ...]:
        if not isinstance(state, tuple) or len(state) != len(self.parts):
            got = len(state) if isinstance(state, tuple) else type(state).__name__
            raise ValueError(
                f"{self.name} of {len(self.parts)} transformations got a state of {got} parts; "
                "build the state with this optimizer's init"
            )
        return state

    def init(self, params: Tree) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in self.parts)

    def update(self, grads: Tree, state: Any, params: Tree) -> tuple[Tree, tuple[Any, ...]]:
        states = list(self._split(state))
        for i, t in enumerate(self.parts):
            with known_norm(None) if i else contextlib.nullcontext():  # the step's norm: the first part's gradients
                grads, states[i] = t.update(grads, states[i], params)
        return grads, tuple(states)

    def apply(self, grads: Tree, state: Any, params: Tree, *, donate: bool = False) -> tuple[Tree, tuple[Any, ...]]:
        states = list(self._split(state))
        for i, t in enumerate(self.parts[:-1]):
            with known_norm(None) if i else contextlib.nullcontext():  # the step's norm: the first part's gradients
                grads, new = (t.donated_update if donate else t.update)(grads, states[i], params)
            states[i] = overwrite(states[i], new) if donate else new
        with known_norm(None) if len(self.parts) > 1 else contextlib.nullcontext():
            new_params, states[-1] = self.parts[-1].apply(grads, states[-1], params, donate=donate)
        return new_params, tuple(states)

    def learning_rate(self, state: Any) -> float:
        for t, s in zip(self.parts, self._split(state)):
            rate = t.learning_rate(s)
            if not math.isnan(rate):
                return rate
        return float("nan")
