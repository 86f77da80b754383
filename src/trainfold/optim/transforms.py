"""The small transformations: clipping, weight decay, the learning rate, and SGD's momentum (``trace``).

Each is a record of its hyperparameters with a pure ``update``; ``chain`` composes them.

>>> import torch
>>> clip = clip_by_global_norm(1.0)
>>> g, _ = clip.update({"a": torch.tensor([3.0, 4.0])}, clip.init({}), {})
>>> [round(x, 4) for x in g["a"].tolist()]
[0.6, 0.8]
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.core.state import scalar
from trainfold.core.tree import Tree, check_keys, known_or_global_norm
from trainfold.optim.masks import Mask, resolve_mask
from trainfold.optim.schedules import Schedule, as_schedule
from trainfold.optim.transform import GradientTransformation, rate_value

__all__ = [
    "AddDecayedWeights",
    "ClipByGlobalNorm",
    "ScaleByLearningRate",
    "SgdState",
    "Trace",
    "add_decayed_weights",
    "clip_by_global_norm",
    "clip_coefficient",
    "scale_by_learning_rate",
    "scaled",
    "scaled_tree",
    "trace",
]


def scaled(tensors: list[Tensor], factor: float | Tensor) -> list[Tensor]:
    """Return ``[t * factor for t in tensors]``: one ``_foreach_mul``, or a product each if ``factor`` requires grad.

    torch's ``_foreach_mul(TensorList, Tensor)`` cannot differentiate with respect to the scalar tensor (its backward
    fails with "inconsistent range for TensorList output"), which a differentiable step needs; the values are the same.

    >>> [t.item() for t in scaled([torch.tensor(1.0), torch.tensor(2.0)], torch.tensor(3.0, requires_grad=True))]
    [3.0, 6.0]
    """
    if isinstance(factor, Tensor) and factor.requires_grad:
        return [t * factor for t in tensors]
    return list(torch._foreach_mul(tensors, factor))  # list(): the stubs say tuple, torch gives a list


def scaled_tree(tree: Tree, factor: float | Tensor) -> Tree:
    """Return ``{name: t * factor}`` of ``tree`` (:func:`scaled`).

    >>> scaled_tree({"w": torch.tensor(2.0)}, -0.5)["w"].item()
    -1.0
    """
    keys = list(tree)
    return dict(zip(keys, scaled([tree[k] for k in keys], factor)))


def clip_coefficient(norm: Tensor, max_norm: float | Tensor) -> Tensor:
    """Return the factor that scales gradients of global norm ``norm`` to at most ``max_norm`` (as torch).

    >>> round(clip_coefficient(torch.tensor(5.0), 1.0).item(), 4), clip_coefficient(torch.tensor(0.5), 1.0).item()
    (0.2, 1.0)
    """
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


# -- clipping ---------------------------------------------------------------------------------------


def clip_by_global_norm(max_norm: float) -> ClipByGlobalNorm:
    """Scale gradients so their global 2-norm is at most ``max_norm`` (as ``clip_grad_norm_``).

    >>> clip_by_global_norm(0.0)
    Traceback (most recent call last):
    ...
    ValueError: max_norm must be > 0, got 0.0; leave clipping out of the chain instead
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}; leave clipping out of the chain instead")
    return ClipByGlobalNorm(float(max_norm))


@attrs.frozen
class ClipByGlobalNorm(GradientTransformation):
    """See :func:`clip_by_global_norm`; its state is an empty tuple."""

    max_norm: float
    name = "clip_by_global_norm"

    def init(self, params: Tree) -> tuple:
        return ()

    def update(self, grads: Tree, state: tuple, params: Tree) -> tuple[Tree, tuple]:
        if not grads:
            return {}, state
        return scaled_tree(grads, clip_coefficient(known_or_global_norm(grads), self.max_norm)), state

    def donated_update(self, grads: Tree, state: tuple, params: Tree) -> tuple[Tree, tuple]:
        """``update`` scaling the donated ``grads`` in place (as ``clip_grad_norm_``): the same values, no copy.

        >>> g = {"a": torch.tensor([3.0, 4.0])}
        >>> out, _ = clip_by_global_norm(1.0).donated_update(g, (), {})
        >>> out["a"] is g["a"], [round(x, 4) for x in g["a"].tolist()]
        (True, [0.6, 0.8])
        """
        tensors = list(grads.values())
        if not _disjoint(tensors) or any(t.requires_grad for t in tensors):  # a differentiable step's: its graph
            return self.update(grads, state, params)
        torch._foreach_mul_(tensors, clip_coefficient(known_or_global_norm(grads), self.max_norm))
        return dict(grads), state


def _disjoint(tensors: list[Tensor]) -> bool:
    """Say whether ``tensors`` are dense and share no memory (autograd may hand out one tensor for two leaves, or
    a broadcast view), so that scaling each in place scales every element once.

    >>> g = torch.ones(4)
    >>> _disjoint([g[:2], g[2:]]), _disjoint([g, g]), _disjoint([torch.ones(1).expand(3)])
    (True, False, False)
    """
    spans = []
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its shard (its own data_ptr is 0)
        if not local.is_contiguous():
            return False
        if local.numel():
            spans.append((local.data_ptr(), local.data_ptr() + local.numel() * local.element_size()))
    spans.sort()
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


# -- weight decay -----------------------------------------------------------------------------------


def add_decayed_weights(weight_decay: float = 0.0, mask: Mask | None = None) -> AddDecayedWeights:
    """Add ``weight_decay * param`` to the update of each param ``mask`` marks (None: every param).

    Before ``scale_by_learning_rate`` it is decoupled decay (as ``AdamW``); before momentum,
    coupled (as ``SGD(weight_decay=)``). ``mask`` is a ``{name: bool}`` mapping or a function of
    the params returning one.

    >>> t = add_decayed_weights(0.5, mask={"w": True, "b": False})
    >>> p = {"w": torch.tensor(2.0), "b": torch.tensor(2.0)}
    >>> {k: v.item() for k, v in t.update({"w": torch.tensor(1.0), "b": torch.tensor(1.0)}, (), p)[0].items()}
    {'w': 2.0, 'b': 1.0}
    """
    return AddDecayedWeights(float(weight_decay), mask)


@attrs.frozen(eq=False)
class AddDecayedWeights(GradientTransformation):
    """See :func:`add_decayed_weights`; its state is an empty tuple."""

    weight_decay: float
    mask: Mask | None = None
    _masks: dict = attrs.field(factory=dict, init=False, repr=False)
    name = "add_decayed_weights"

    def decayed(self, params: Tree) -> list[str]:
        """Return the names of the params ``mask`` marks, in ``params`` order (cached per key set)."""
        key = tuple(params)
        if key not in self._masks:
            self._masks[key] = [k for k, d in resolve_mask(self.mask, params).items() if d]
        return self._masks[key]

    def init(self, params: Tree) -> tuple:
        return ()

    def update(self, grads: Tree, state: Any, params: Tree) -> tuple[Tree, Any]:
        if not self.weight_decay:
            return grads, state
        check_keys(grads, params, "grads", "params")
        names, out = self.decayed(params), dict(grads)
        decayed = torch._foreach_add([grads[k] for k in names], [params[k] for k in names], alpha=self.weight_decay)
        out.update(zip(names, decayed))
        return out, state


# -- the learning rate ------------------------------------------------------------------------------


def scale_by_learning_rate(learning_rate: float | Schedule) -> ScaleByLearningRate:
    """Scale the update by ``-learning_rate`` (a float or a schedule of the update count, which it keeps).

    >>> opt = scale_by_learning_rate(lambda step: 0.1 * (step + 1))
    >>> u, count = opt.update({"w": torch.tensor(2.0)}, opt.init({}), {})
    >>> round(u["w"].item(), 4), count.item(), round(opt.learning_rate(count), 4)
    (-0.2, 1, 0.2)
    """
    return ScaleByLearningRate(as_schedule(learning_rate))


@attrs.frozen
class ScaleByLearningRate(GradientTransformation):
    """See :func:`scale_by_learning_rate`; its state is the update count (a 0-d int64 tensor)."""

    schedule: Schedule
    name = "scale_by_learning_rate"

    def init(self, params: Tree) -> Tensor:
        return scalar(0)

    def update(self, grads: Tree, state: Tensor, params: Tree) -> tuple[Tree, Tensor]:
        return scaled_tree(grads, -self.schedule(int(state))), state + 1

    def learning_rate(self, state: Tensor) -> float:
        return rate_value(self.schedule(int(state)))


# -- SGD's momentum ---------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class SgdState:
    """What :func:`trace` (and so ``sgd``) carries between updates: the update count and the momentum buffers.

    >>> from trainfold.optim import sgd
    >>> opt = sgd(0.1, momentum=0.9)
    >>> p = {"w": torch.tensor(1.0)}
    >>> _, state = opt.apply({"w": torch.tensor(2.0)}, opt.init(p), p)
    >>> state.count.item(), {k: v.item() for k, v in state.momentum.items()}
    (1, {'w': 2.0})
    """

    count: Tensor
    momentum: dict[str, Tensor]


def trace(momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False) -> Trace:
    """Momentum as ``torch.optim.SGD``: ``buf = momentum * buf + (1 - dampening) * g`` (``buf = g`` at first).

    >>> trace(0.0, nesterov=True)
    Traceback (most recent call last):
    ...
    ValueError: nesterov=True needs momentum > 0 and dampening 0 (as torch.optim.SGD)
    """
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov=True needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
    return Trace(momentum, dampening, nesterov)


@attrs.frozen
class Trace(GradientTransformation):
    """See :func:`trace`; its state is an :class:`SgdState` (it counts the updates)."""

    momentum: float
    dampening: float
    nesterov: bool
    name = "trace"

    def init(self, params: Tree) -> SgdState:
        buf = {k: torch.zeros_like(v) for k, v in params.items()} if self.momentum else {}
        return SgdState(scalar(0), buf)

    def update(self, grads: Tree, state: SgdState, params: Tree) -> tuple[Tree, SgdState]:
        check_keys(grads, params, "grads", "params")
        keys = list(params)
        g, buf = [grads[k] for k in keys], state.momentum
        if self.momentum:
            check_keys(buf, params, "SGD momentum state", "params")
            if int(state.count) == 0:  # torch starts the buffer at the first gradient
                new = [x.clone() for x in g]
            else:
                new = scaled([buf[k] for k in keys], self.momentum)
                torch._foreach_add_(new, g, alpha=1.0 - self.dampening)
            buf = dict(zip(keys, new))
            g = list(torch._foreach_add(g, new, alpha=self.momentum)) if self.nesterov else new
        return dict(zip(keys, g)), SgdState(state.count + 1, buf)
