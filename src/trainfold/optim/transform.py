"""The gradient transformation: a pure ``(init, update)`` pair, and the protocol its fast paths share.

``update(grads, state, params) -> (updates, state)`` returns deltas to add to the params;
``apply(grads, state, params) -> (new_params, state)`` returns the new params directly;
``apply_owned(grads, state, params, norm=, donate=)`` is the step's own path: the caller owns
``grads`` (clipping rescales them in place, reusing the global ``norm`` it already computed) and,
with ``donate=True``, the params and state are updated in place and returned (bitwise what ``apply``
returns). ``learning_rate(state)`` is the rate the next update uses (NaN where there is none).

Each built-in transformation owns its fast paths through a few methods that ``chain`` calls
(``counter``, ``fold``, ``update_at``, ``apply_at``, ``rate_at``, ``elementwise``): the end of a
chain that only scales the update (``add_decayed_weights``, ``scale_by_learning_rate``) *folds* into a
``StepRule`` that the part before it applies to the params in one go (``scale_by_adam``: torch's fused
AdamW kernel). Nothing passed in is changed.

>>> import torch
>>> half = GradientTransformation(init=lambda params: None,
...                               update=lambda g, s, p: ({k: -0.5 * v for k, v in g.items()}, s))
>>> p = {"w": torch.tensor(1.0)}
>>> half.apply({"w": torch.tensor(4.0)}, half.init(p), p)[0]["w"].item()
-1.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.core.tree import Tree, check_keys

__all__ = ["GradientTransformation", "StepRule", "apply_updates", "overwrite"]


@attrs.frozen(eq=False)
class StepRule:
    """The end of a chain folded into one step on the params: ``p * (1 - lr * decay[k]) - lr * update``.

    ``decay`` maps the params that get decoupled weight decay (as ``torch.optim.AdamW``) to their
    rate; ``groups`` lists them by rate, the decayed params first, as torch's param groups.

    >>> rule = StepRule(0.5, {"w": 0.1})
    >>> rule.groups({"w": 0, "b": 0})
    [(['w'], 0.1), (['b'], 0.0)]
    >>> new = rule.apply(
    ...     {"w": torch.tensor(2.0), "b": torch.tensor(2.0)}, {"w": torch.tensor(1.0), "b": torch.tensor(1.0)}
    ... )
    >>> {k: round(v.item(), 4) for k, v in new.items()}
    {'w': 1.4, 'b': 1.5}
    """

    lr: float
    decay: Mapping[str, float] = attrs.field(factory=dict)

    def groups(self, params: Mapping[str, Any]) -> list[tuple[list[str], float]]:
        """Return ``[(names, weight_decay), ...]``: the params by decay rate, in ``params`` order, none empty."""
        decay = self.decay
        rest = [k for k in params if k not in decay]
        rates = set(decay.values())
        if len(rates) == 1:  # one decay rate (adamw): two groups, as torch's decay/no-decay param groups
            on = [k for k in params if k in decay]
            return [(keys, wd) for keys, wd in ((on, float(rates.pop())), (rest, 0.0)) if keys]
        by_rate: dict[float, list[str]] = {}
        for k in params:
            if k in decay:
                by_rate.setdefault(float(decay[k]), []).append(k)
        return [(keys, wd) for wd, keys in by_rate.items()] + ([(rest, 0.0)] if rest else [])

    def apply(self, params: Tree, updates: Tree) -> Tree:
        """Return the new params for ``updates`` (the update before the learning rate scales it)."""
        check_keys(updates, params, "updates", "params")
        keys = list(params)
        scaled = torch._foreach_mul([updates[k] for k in keys], -self.lr)
        base = [params[k] * (1.0 - self.lr * self.decay[k]) if self.decay.get(k, 0.0) else params[k] for k in keys]
        return dict(zip(keys, torch._foreach_add(base, scaled)))


class GradientTransformation:
    """A pure optimizer: ``init(params)`` and ``update(grads, state, params)``, with fast paths.

    ``GradientTransformation(init, update)`` wraps two functions (a custom transformation); the
    built-ins (``scale_by_adam``, ``clip_by_global_norm``, ``chain`` ...) are records of their
    hyperparameters that implement the methods below. ``name`` names it in error messages;
    ``keeps_state=False`` (its ``init`` returns None) leaves it no place in a chain's state.
    """

    name: str = "a custom transformation"
    keeps_state: bool = True  # False: init returns None and a chain keeps no place for its state

    def __init__(
        self,
        init: Callable[[Tree], Any],
        update: Callable[[Tree, Any, Tree], tuple[Tree, Any]],
        name: str = "a custom transformation",
        keeps_state: bool = True,
    ) -> None:
        self.init, self.update = init, update  # type: ignore[method-assign,assignment]  # instance overrides the methods
        self.name, self.keeps_state = name, keeps_state

    def __repr__(self) -> str:
        return f"GradientTransformation(name={self.name!r})"

    def init(self, params: Tree) -> Any:
        """Return the state before the first update."""
        raise NotImplementedError

    def update(self, grads: Tree, state: Any, params: Tree) -> tuple[Tree, Any]:
        """Return ``(updates, new_state)``: the deltas to add to ``params``."""
        return self.update_at(grads, state, params)

    def apply(self, grads: Tree, state: Any, params: Tree) -> tuple[Tree, Any]:
        """Return ``(new_params, new_state)`` for one update."""
        return self.apply_at(grads, state, params)

    def apply_owned(
        self, grads: Tree, state: Any, params: Tree, *, norm: Tensor | None = None, donate: bool = False
    ) -> tuple[Tree, Any]:
        """Return ``(new_params, new_state)`` as ``apply``, overwriting ``grads`` (the caller's to lose).

        ``norm`` is the global norm of ``grads`` if the caller computed it (clipping reuses it). With
        ``donate`` the params and state tensors are updated in place and returned (bitwise what
        ``apply`` returns); a part without an in-place path computes ``apply`` and copies the result in.

        >>> from trainfold.optim import chain, clip_by_global_norm, sgd
        >>> opt = chain(clip_by_global_norm(1.0), sgd(0.5))
        >>> p = {"w": torch.tensor([1.0])}
        >>> new, _ = opt.apply_owned({"w": torch.tensor([4.0])}, opt.init(p), p, donate=True)
        >>> new["w"] is p["w"], round(p["w"].item(), 4)
        (True, 0.5)
        """
        return self.apply_at(grads, state, params, owned=True, norm=norm, donate=donate)

    def learning_rate(self, state: Any) -> float:
        """Return the learning rate the next update uses (NaN for a transformation without one)."""
        rate = self.rate_at(state, None)
        if isinstance(rate, Tensor):  # a tensor rate (a differentiable step's): its value
            return float(rate.detach())
        return float("nan") if rate is None else rate

    # -- the protocol chain composes (defaults: a transformation with no fast path) -------------------

    def counter(self, state: Any) -> Tensor | None:
        """Return the number of updates ``state`` has seen, if this transformation counts them."""
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
        """``update`` at update ``count`` (from a counting part of the chain); ``owned``: ``grads`` may be reused."""
        return self.update(grads, state, params)

    def fold(self, rule: StepRule | None, params: Tree, count: int | None) -> StepRule | None:
        """Return ``rule`` with this transformation folded in before it, or None where it cannot fold."""
        return None

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
        """Return ``(new_params, new_state)`` for this update followed by ``rule`` (None: add the update)."""
        updates, new_state = self.update_at(grads, state, params, count, owned=owned, norm=norm)
        new_params = apply_updates(params, updates) if rule is None else rule.apply(params, updates)
        if not donate:
            return new_params, new_state
        return overwrite(params, new_params), overwrite(state, new_state)

    def rate_at(self, state: Any, count: int | None) -> float | None:
        """Return the learning rate this transformation applies at update ``count``, if it applies one."""
        return None

    def elementwise(self) -> tuple[Any, ...]:
        """Return the traceable element-wise parts of this transformation, for the compiled and ensemble steps."""
        raise TypeError(
            f"{self.name} has no element-wise path in the compiled and ensemble steps; "
            "they support chain(clip_by_global_norm(...), adamw(...)): use trainfold.adamw, or the eager step"
        )


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """Return ``params + updates`` as new tensors.

    >>> apply_updates({"w": torch.tensor(1.0)}, {"w": torch.tensor(0.5)})["w"].item()
    1.5
    """
    check_keys(updates, params, "updates", "params")
    keys = list(params)
    return dict(zip(keys, torch._foreach_add([params[k] for k in keys], [updates[k] for k in keys])))


def overwrite(old: Any, new: Any) -> Any:
    """Copy ``new``'s tensors into ``old``'s at the same places and return ``old``'s structure holding them.

    Where the structures differ (other keys, shapes or dtypes) ``new``'s part is returned as it is; 0-d
    tensors (counters) are never overwritten, so a record's old counters keep their values.

    >>> old = {"w": torch.zeros(2)}
    >>> out = overwrite(old, {"w": torch.ones(2)})
    >>> out["w"] is old["w"], old["w"].tolist()
    (True, [1.0, 1.0])
    """
    if isinstance(new, Tensor):
        same = (
            isinstance(old, Tensor)
            and old.dim() > 0
            and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
        )
        if not same:
            return new
        if _local(old).data_ptr() != _local(new).data_ptr():  # not already written in place
            old.copy_(new)
        return old
    if attrs.has(type(new)) and type(old) is type(new):
        fields = [f.name for f in attrs.fields(type(new)) if f.init]
        return attrs.evolve(new, **{f: overwrite(getattr(old, f), getattr(new, f)) for f in fields})
    if isinstance(new, Mapping) and isinstance(old, Mapping):
        return {k: overwrite(old[k], v) if k in old else v for k, v in new.items()}
    if isinstance(new, tuple) and isinstance(old, tuple) and len(old) == len(new):
        return type(new)(overwrite(a, b) for a, b in zip(old, new)) if type(new) is tuple else new
    return new


def _local(t: Tensor) -> Tensor:
    """Return a DTensor's local shard (whose storage is real: a DTensor's own ``data_ptr`` is 0), else ``t``."""
    return getattr(t, "_local_tensor", t)
