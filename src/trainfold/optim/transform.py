"""The gradient transformation: a pure ``(init, update)`` pair, as optax's.

``update(grads, state, params) -> (updates, state)`` returns deltas to add to the params. Three more
methods have defaults every transformation inherits: ``apply(grads, state, params, donate=)``
returns the new params (a transformation that steps params itself, as ``adamw`` through torch's
kernels, overrides it; with ``donate=True`` the params and state tensors are updated in place and
returned, bitwise what ``apply`` returns, and the gradients are donated too: a chain's clipping
scales them in place), ``donated_update`` is ``update`` free to write into the gradients (``update``
unless a transformation overrides it), and ``learning_rate(state)`` is the rate the next update
uses (NaN where there is none). Nothing passed in is changed unless donated.

>>> import torch
>>> half = GradientTransformation(init=lambda params: (),
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

__all__ = ["GradientTransformation", "apply_updates", "overwrite"]


class GradientTransformation:
    """A pure optimizer: ``init(params)`` and ``update(grads, state, params)``.

    ``GradientTransformation(init, update)`` wraps two functions (a custom transformation); the
    built-ins (``adamw``, ``clip_by_global_norm``, ``chain`` ...) are records of their
    hyperparameters that implement the methods. ``name`` names it in error messages.
    """

    name: str = "a custom transformation"

    def __init__(
        self,
        init: Callable[[Tree], Any],
        update: Callable[[Tree, Any, Tree], tuple[Tree, Any]],
        name: str = "a custom transformation",
    ) -> None:
        self.init, self.update = init, update  # type: ignore[method-assign,assignment]  # instance overrides the methods
        self.name = name

    def __repr__(self) -> str:
        return f"GradientTransformation(name={self.name!r})"

    def init(self, params: Tree) -> Any:
        """Return the state before the first update."""
        raise NotImplementedError

    def update(self, grads: Tree, state: Any, params: Tree) -> tuple[Tree, Any]:
        """Return ``(updates, new_state)``: the deltas to add to ``params``."""
        raise NotImplementedError

    def donated_update(self, grads: Tree, state: Any, params: Tree) -> tuple[Tree, Any]:
        """Return what ``update`` returns, free to write into ``grads`` (a donated ``apply``'s: the caller is done
        with them), so that the updates need not be new memory; ``update`` unless overridden."""
        return self.update(grads, state, params)

    def apply(self, grads: Tree, state: Any, params: Tree, *, donate: bool = False) -> tuple[Tree, Any]:
        """Return ``(new_params, new_state)`` for one update; ``donate``: written into ``params`` and ``state``.

        >>> from trainfold.optim import chain, clip_by_global_norm, sgd
        >>> opt = chain(clip_by_global_norm(1.0), sgd(0.5))
        >>> p = {"w": torch.tensor([1.0])}
        >>> new, _ = opt.apply({"w": torch.tensor([4.0])}, opt.init(p), p, donate=True)
        >>> new["w"] is p["w"], round(p["w"].item(), 4)
        (True, 0.5)
        """
        updates, new_state = self.update(grads, state, params)
        new_params = apply_updates(params, updates)
        if not donate:
            return new_params, new_state
        return overwrite(params, new_params), overwrite(state, new_state)

    def learning_rate(self, state: Any) -> float:
        """Return the learning rate the next update uses (NaN for a transformation without one)."""
        return float("nan")


def rate_value(rate: Any) -> float:
    """Return a schedule's value as a float (a tensor rate, a differentiable step's: its value)."""
    return float(rate.detach()) if isinstance(rate, Tensor) else float(rate)


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
