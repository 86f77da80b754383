"""``chain``: transformations composed left to right, the state the tuple of the states they keep.

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

from typing import Any

import attrs
from torch import Tensor

from trainfold.core.tree import Tree
from trainfold.optim.transform import GradientTransformation, StepRule, overwrite

__all__ = ["Chain", "chain"]


def chain(*transforms: GradientTransformation, name: str = "chain") -> Chain:
    """Compose transformations left to right; ``name`` names the composite (``adamw`` is one).

    The state is the tuple of the states the parts keep (``add_decayed_weights`` and
    ``scale_by_learning_rate`` keep none); a chain whose parts keep one state has that state.
    The end of the chain that only scales the update folds into the part before it, which then
    steps the params in one go (``adamw``: torch's fused kernel).

    >>> import torch
    >>> from trainfold.optim import add_decayed_weights, scale_by_adam, scale_by_learning_rate
    >>> opt = chain(scale_by_adam(), add_decayed_weights(0.1), scale_by_learning_rate(1e-3))
    >>> type(opt.init({"w": torch.zeros(2)})).__name__, opt.name
    ('AdamState', 'chain')
    """
    if not transforms:
        raise ValueError("chain needs at least one transformation")
    return Chain(tuple(transforms), name)


@attrs.frozen(eq=False)
class Chain(GradientTransformation):
    """Transformations applied one after another (see :func:`chain`)."""

    parts: tuple[GradientTransformation, ...]
    name: str = "chain"
    slots: tuple[int, ...] = attrs.field(init=False, repr=False)  # the parts that keep a state

    @slots.default
    def _slots_default(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.parts) if t.keeps_state)

    @property
    def keeps_state(self) -> bool:  # type: ignore[override]
        return bool(self.slots)

    def _split(self, state: Any) -> list[Any]:
        slots, states = self.slots, [None] * len(self.parts)
        if len(slots) == 1:
            states[slots[0]] = state
        elif slots:
            if not isinstance(state, tuple) or len(state) != len(slots):
                got = len(state) if isinstance(state, tuple) else type(state).__name__
                kept = "" if len(slots) == len(self.parts) else f" (it keeps {len(slots)} states)"
                raise ValueError(
                    f"{self.name} of {len(self.parts)} transformations{kept} got a state of {got} parts; "
                    "build the state with this optimizer's init"
                )
            for i, s in zip(slots, state):
                states[i] = s
        return states

    def _join(self, states: list[Any]) -> Any:
        kept = [states[i] for i in self.slots]
        return kept[0] if len(kept) == 1 else (tuple(kept) if kept else None)

    def _count(self, states: list[Any], count: int | None) -> int | None:
        for t, s in zip(self.parts, states):
            c = t.counter(s)
            if c is not None:
                return int(c)
        return count

    def init(self, params: Tree) -> Any:
        return self._join([t.init(params) for t in self.parts])

    def counter(self, state: Any) -> Tensor | None:
        for t, s in zip(self.parts, self._split(state)):
            c = t.counter(s)
            if c is not None:
                return c
        return None

    def update_at(
        self,
        grads: Tree,
        state: Any,
        params: Tree,
        count: int | None = None,
        *,
        owned: bool = False,
        norm: Tensor | None = None,
    ) -> tuple[Tree, Any]:
        states = self._split(state)
        count = self._count(states, count)
        for i, t in enumerate(self.parts):
            grads, states[i] = t.update_at(grads, states[i], params, count, owned=owned, norm=norm)
            norm = None  # the grads changed: a later part computes its own
        return grads, self._join(states)

    def fold(self, rule: StepRule | None, params: Tree, count: int | None) -> StepRule | None:
        for t in reversed(self.parts):
            rule = t.fold(rule, params, count)
            if rule is None:
                return None
        return rule

    def apply_at(
        self,
        grads: Tree,
        state: Any,
        params: Tree,
        count: int | None = None,
        rule: StepRule | None = None,
        *,
        owned: bool = False,
        norm: Tensor | None = None,
        donate: bool = False,
    ) -> tuple[Tree, Any]:
        states = self._split(state)
        count = self._count(states, count)
        k = len(self.parts)  # parts[k:] fold into rule
        while k and (folded := self.parts[k - 1].fold(rule, params, count)) is not None:
            rule, k = folded, k - 1
        for i in range(max(k - 1, 0)):
            grads, states[i] = self.parts[i].update_at(grads, states[i], params, count, owned=owned, norm=norm)
            norm = None
        if k == 0:  # nothing but scaling: the rule steps the params
            assert rule is not None
            new_params = rule.apply(params, grads)
            return (overwrite(params, new_params) if donate else new_params), self._join(states)
        last = self.parts[k - 1]
        new_params, states[k - 1] = last.apply_at(
            grads, states[k - 1], params, count, rule, owned=owned, norm=norm, donate=donate
        )
        return new_params, self._join(states)

    def rate_at(self, state: Any, count: int | None) -> float | None:
        states = self._split(state)
        count = self._count(states, count)
        for t, s in zip(self.parts, states):
            rate = t.rate_at(s, count)
            if rate is not None:
                return rate
        return None

    def elementwise(self) -> tuple[Any, ...]:
        parts: list[Any] = []
        for t in self.parts:
            try:
                parts.extend(t.elementwise())
            except TypeError as err:
                if self.name == "chain":
                    raise
                raise TypeError(f"{self.name}: {err}") from None
        return tuple(parts)
