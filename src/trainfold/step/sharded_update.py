"""The optimizer of the sharded step on this rank's local shards: the same kernels, without DTensor's dispatch.

An element-wise optimizer (clipping by the global norm, AdamW: what ``optimizer_plan`` accepts)
computes each shard's update from that shard alone, so it can run on the local tensors of the
``Shard(0)`` DTensors, given the global gradient norm; the results are wrapped back as DTensors
placed like the params: the optimizer's own (fused) kernels, bitwise the update on the DTensors and
faster (measured: 2.5x on a 4-block TinyLM on CPU); any other optimizer updates the DTensors
(``shard_update`` picks). The compiled sharded step uses it too: the element-wise plan compiled
(``optim.flat``, as the one-process compiled step) measured 6.9 vs 12.3 ms per update at 1.6M
params a rank, under 1% of that step, and is not bitwise the fused kernel (1e-5 after 4 steps).

>>> import torch
>>> from trainfold.optim import adamw, sgd
>>> _plan(adamw(1e-3)) is not None, _plan(sgd(0.1)) is None
(True, True)
>>> map_param_dicts({"mu": {"w": torch.ones(1)}, "count": torch.zeros(())}, frozenset({"w"}), lambda t: t * 2)
{'mu': {'w': tensor([2.])}, 'count': tensor(0.)}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
from torch import Tensor
from torch.distributed.tensor import DTensor

from trainfold.core.state import TrainState
from trainfold.optim import GradientTransformation, OptimizerPlan, optimizer_plan

__all__ = ["local", "map_param_dicts", "shard_update", "update_shards"]

Update = Callable[[dict[str, Tensor], TrainState, Tensor], tuple[dict[str, Tensor], Any]]


def map_param_dicts(node: Any, keys: frozenset[str], fn: Callable[..., Tensor], keyed: bool = False) -> Any:
    """Apply ``fn`` to the tensors of every dict in ``node`` keyed by the params (an optimizer's moments);
    ``keyed``: ``fn(tensor, param_name)``."""
    if isinstance(node, Mapping):
        if node and frozenset(node) <= keys and all(isinstance(v, Tensor) for v in node.values()):
            return {k: fn(v, k) if keyed else fn(v) for k, v in node.items()}
        return {k: map_param_dicts(v, keys, fn, keyed) for k, v in node.items()}
    if attrs.has(type(node)):
        fields = [f.name for f in attrs.fields(type(node)) if f.init]
        return attrs.evolve(node, **{f: map_param_dicts(getattr(node, f), keys, fn, keyed) for f in fields})
    if isinstance(node, tuple):
        items = [map_param_dicts(v, keys, fn, keyed) for v in node]
        return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
    return node


def update_shards(
    optimizer: GradientTransformation, grads: dict[str, Tensor], state: TrainState, norm: Tensor
) -> tuple[dict[str, Tensor], Any]:
    """Apply an element-wise optimizer to this rank's local shards (``norm``: the global gradient norm), then
    wrap the results as DTensors placed like the params: the same kernels as on the DTensors, without
    DTensor's dispatch (measured: 2.5x faster on a 4-block TinyLM, bitwise equal)."""
    keys, like = frozenset(state.params), state.params
    params, opt_state = optimizer.apply_owned(
        {k: local(v) for k, v in grads.items()},
        map_param_dicts(state.opt_state, keys, local),
        {k: local(v) for k, v in state.params.items()},
        norm=norm,
    )

    def back(t: Tensor, name: str) -> Tensor:
        return _like(t, like[name])

    return {k: back(v, k) for k, v in params.items()}, map_param_dicts(opt_state, keys, back, keyed=True)


def local(t: Tensor) -> Tensor:
    """Return this rank's part of ``t`` (a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like(t: Tensor, ref: Tensor) -> Tensor:
    """Return the local ``t`` as a DTensor placed like ``ref`` (``t`` itself when ``ref`` is plain)."""
    if not isinstance(ref, DTensor) or isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride())


def shard_update(optimizer: GradientTransformation) -> Update:
    """Return ``update(grads, state, norm) -> (params, opt_state)`` of the sharded step (see the module doc)."""
    if _plan(optimizer) is None:
        return lambda grads, state, norm: optimizer.apply(grads, state.opt_state, state.params)
    return lambda grads, state, norm: update_shards(optimizer, grads, state, norm)


def _plan(optimizer: GradientTransformation) -> OptimizerPlan | None:
    try:
        return optimizer_plan(optimizer)
    except (TypeError, KeyError, AttributeError):
        return None
