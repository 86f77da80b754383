"""Ensemble states: K ordinary states of one architecture stacked along a leading member axis, and back.

An *ensemble state* is an ordinary ``TrainState`` whose tensors carry a leading member axis of
size K (params, buffers, optimizer state, ``step``, ``seed``, metrics, ``loss_total``); the
cursor is shared and ``extras`` are carried as they are. ``stack_ensemble`` builds one from K
ordinary states, ``split_ensemble`` gives them back, so an ensemble checkpoint splits into K
ordinary checkpoints that ``make_step`` continues (``trainfold.step.ensemble.stack`` steps them).

>>> import torch
>>> from trainfold import sgd
>>> state = init_ensemble_state(torch.nn.Linear(3, 2), sgd(0.1), size=4)
>>> ensemble_size(state), [m.params["weight"].shape for m in split_ensemble(state)][0]
(4, torch.Size([2, 3]))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.state import TrainState, init_state
from trainfold.core.tree import flatten, map_tensors
from trainfold.optim import GradientTransformation

__all__ = ["ensemble_axes", "ensemble_size", "init_ensemble_state", "split_ensemble", "stack_batches", "stack_ensemble"]

Batch = Sequence[Mapping[str, Tensor]]
# every field of the state but the cursor and extras (one per run, not per member) is stacked along the member axis
_STACKED = tuple(f.name for f in attrs.fields(TrainState) if f.name not in ("cursor", "extras"))


def _check_stackable(name: str, nodes: Sequence[Any]) -> None:
    """Raise naming the place where the members' records differ in keys, shape or dtype, or hold DTensors."""
    flats = [flatten(n, name) for n in nodes]
    for flat in flats[1:]:
        if list(flat) != list(flats[0]):
            raise ValueError(f"ensemble members differ in the keys of {name}: {sorted(flats[0])} vs {sorted(flat)}")
    for key in flats[0]:
        tensors = [flat[key] for flat in flats]
        if any(any(c.__name__ == "DTensor" for c in type(t).__mro__) for t in tensors):
            raise TypeError(
                f"vmapped ensembles over DTensor shards are not supported ({name} is sharded; torch's "
                "vmap does not run on DTensors): stack full states (each DTensor's full_tensor()), or train "
                "each member on its own fully_shard module (a lent, donated state: init_state(..., copy=False))"
            )
        shapes = {(tuple(t.shape), t.dtype) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(
                f"ensemble members differ in shape or dtype at {key}: {sorted(map(str, shapes))}; "
                "members must be copies of one architecture"
            )


def stack_ensemble(states: Sequence[TrainState]) -> TrainState:
    """Stack K ordinary states of one architecture into an ensemble state (inverse of ``split_ensemble``).

    >>> import torch
    >>> from trainfold import init_state, sgd
    >>> ens = stack_ensemble([init_state(torch.nn.Linear(2, 1), sgd(0.1), seed=s) for s in (3, 4)])
    >>> ens.params["weight"].shape, ens.seed.tolist()
    (torch.Size([2, 1, 2]), [3, 4])
    """
    if not states:
        raise ValueError("an ensemble needs at least one member state")
    cursors = {s.cursor.as_tuple() for s in states}
    if len(cursors) > 1:
        raise ValueError(f"ensemble members must share one data cursor, got {sorted(cursors)}")
    fields = {}
    for name in _STACKED:
        nodes = [getattr(s, name) for s in states]
        _check_stackable(name, nodes)
        fields[name] = map_tensors(lambda *ts: torch.stack(ts), nodes[0], *nodes[1:])
    return attrs.evolve(states[0], **fields)


def split_ensemble(state: TrainState) -> list[TrainState]:
    """Return the K member states of an ensemble state, as ordinary ``TrainState`` records.

    Each member owns fresh tensors (nothing is shared with the ensemble or another member), so
    each can be checkpointed, or continued with ``make_step``, on its own.

    >>> import torch
    >>> from trainfold import adamw
    >>> ens = init_ensemble_state(torch.nn.Linear(2, 1), adamw(0.1), size=3)
    >>> [m.params["weight"].shape for m in split_ensemble(ens)][0], len(split_ensemble(ens))
    (torch.Size([1, 2]), 3)
    """
    size = ensemble_size(state)
    members = []
    for i in range(size):
        fields = {name: map_tensors(lambda t, i=i: t[i].clone(), getattr(state, name)) for name in _STACKED}
        cursor = attrs.evolve(state.cursor, epoch=state.cursor.epoch.clone(), position=state.cursor.position.clone())
        members.append(attrs.evolve(state, cursor=cursor, extras=dict(state.extras), **fields))
    return members


def ensemble_axes(state: TrainState) -> TrainState:
    """Return the ``in_dims`` (or ``out_dims``) of an ensemble state for ``torch.func.vmap``: 0 on the member axis.

    ``TrainState`` is a pytree; the stacked fields map over their leading axis, the shared cursor
    and the extras are passed whole (``None``).

    >>> import torch
    >>> from trainfold import sgd
    >>> ens = init_ensemble_state(torch.nn.Linear(3, 2), sgd(0.1), size=4)
    >>> model = torch.nn.Linear(3, 2)
    >>> member_out = lambda s, x: torch.func.functional_call(model, s.params, (x,))
    >>> torch.func.vmap(member_out, in_dims=(ensemble_axes(ens), None))(ens, torch.ones(5, 3)).shape
    torch.Size([4, 5, 2])
    """
    ensemble_size(state)  # refuses an ordinary state
    # vmap's in_dims: a pytree shaped like the state, its leaves axes or None, which TrainState's fields do not type
    return attrs.evolve(state, **{name: 0 for name in _STACKED}, cursor=None, extras=None)  # type: ignore[arg-type]


def ensemble_size(state: TrainState) -> int:
    """Return K, the number of members of an ensemble state.

    >>> import torch
    >>> from trainfold import sgd
    >>> ensemble_size(init_ensemble_state(torch.nn.Linear(2, 1), sgd(0.1), size=5))
    5
    """
    if state.step.dim() != 1:
        raise ValueError(
            f"not an ensemble state: step has shape {tuple(state.step.shape)}, expected (K,); "
            "build it with init_ensemble_state or stack_ensemble"
        )
    return int(state.step.shape[0])


def init_ensemble_state(
    models: nn.Module | Sequence[nn.Module],
    optimizer: GradientTransformation | Sequence[GradientTransformation],
    *,
    size: int | None = None,
    seeds: Sequence[int] | None = None,
) -> TrainState:
    """Return the first ensemble state: K members from K models (or ``size`` copies of one).

    ``optimizer`` is one optimizer for all members or one per member; ``seeds`` (default
    ``0..K-1``) seed each member's dropout as ``init_state(seed=...)`` would.

    >>> import torch
    >>> from trainfold import adamw
    >>> state = init_ensemble_state([torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)], adamw(0.1), seeds=[7, 9])
    >>> state.seed.tolist(), state.opt_state.count.tolist()
    ([7, 9], [0, 0])
    """
    if isinstance(models, nn.Module):
        if size is None or size < 1:
            raise ValueError(f"give size=K >= 1 to build K copies of one model (got size={size}), or a list of models")
        models = [models] * size
    models = list(models)
    k = len(models)
    if size is not None and size != k:
        raise ValueError(f"size={size} but {k} models were given; pass one or the other")
    optimizers = per_member(optimizer, k)
    seeds = list(range(k)) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != k:
        raise ValueError(f"got {len(seeds)} seeds for {k} members; give one seed per member")
    return stack_ensemble([init_state(m, o, seed=s) for m, o, s in zip(models, optimizers, seeds)])


def stack_batches(batches: Sequence[Batch]) -> Batch:
    """Stack K ordinary batches (one per member, same shapes) into one ensemble batch.

    >>> import torch
    >>> b = stack_batches([[{"x": torch.zeros(2, 3)}], [{"x": torch.ones(2, 3)}]])
    >>> len(b), b[0]["x"].shape
    (1, torch.Size([2, 2, 3]))
    """
    if not batches:
        raise ValueError("stack_batches needs one batch per member, got none")
    lengths = {len(b) for b in batches}
    if len(lengths) > 1:
        raise ValueError(f"member batches have different numbers of micro-batches: {sorted(lengths)}")
    return [{key: torch.stack([b[i][key] for b in batches]) for key in batches[0][i]} for i in range(len(batches[0]))]


def per_member(optimizer: GradientTransformation | Sequence[GradientTransformation], k: int) -> list[Any]:
    """Return one optimizer per member: ``optimizer`` K times, or the K given.

    >>> from trainfold import sgd
    >>> len(per_member(sgd(0.1), 3))
    3
    """
    if isinstance(optimizer, GradientTransformation):
        return [optimizer] * k
    optimizers = list(optimizer)
    if len(optimizers) != k:
        raise ValueError(f"got {len(optimizers)} optimizers for {k} members; give one, or one per member")
    return optimizers
