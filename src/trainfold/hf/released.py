"""A sharded run's module without its weights: the full params are released while the shards train, back at the end.

Under ``fsdp="full_shard"`` the state holds each rank's ``1/world`` of the params (``step.sharded``);
the step needs only the module's structure (it swaps the gathered blocks into the module's slots).
``release`` puts a ``meta`` twin (same shape, dtype, ``requires_grad``; no storage) in every slot of
a trained param, tied ones sharing one twin, and empties the module's own ``Parameter`` objects, so
per-rank memory is the shards and the gathered blocks only. ``Released.restore`` writes the trained
weights into those same objects, one param at a time (never two full copies of the model), and
puts them back: afterwards ``model.lm_head.weight`` is the object it was, holding the trained
values. A run that raises leaves the twins in place (its weights live on the ranks' shards only:
load ``result.last_checkpoint`` or a checkpoint of the run).

>>> import torch
>>> lin = torch.nn.Linear(2, 1)
>>> weight = lin.weight
>>> held = release(lin, frozenset({"weight", "bias"}))
>>> lin.weight.device.type, tuple(lin.weight.shape), weight.numel()
('meta', (1, 2), 0)
>>> held.restore(lambda name: torch.ones(1, 2) if name == "weight" else torch.zeros(1))
>>> lin.weight is weight, lin.weight.tolist()
(True, [[1.0, 1.0]])
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.state import TrainState

__all__ = ["Released", "release", "release_weights", "restored"]


@attrs.frozen(eq=False)
class Released:
    """The module's own trained ``Parameter`` objects (by canonical name, storage released) and the slots they fill."""

    originals: dict[str, nn.Parameter]
    slots: list[tuple[dict[str, nn.Parameter | None], str, str]]  # (a module's _parameters, attribute, name)

    def restore(self, value: Callable[[str], Tensor]) -> None:
        """Put ``value(name)`` into each original param (in its own dtype and device), then the originals back."""
        for name, param in self.originals.items():
            param.data = value(name).detach().to(device=param.device, dtype=param.dtype)  # one param at a time
        for params, attr, name in self.slots:
            params[attr] = self.originals[name]


def release(model: nn.Module, names: frozenset[str]) -> Released:
    """Replace ``model``'s params named in ``names`` by ``meta`` twins and release their storage; return the record."""
    canonical = {id(p): n for n, p in model.named_parameters() if n in names}
    originals: dict[str, nn.Parameter] = {}
    twins: dict[str, nn.Parameter] = {}
    slots = []
    for module in model.modules():
        for attr, param in module._parameters.items():
            name = canonical.get(id(param)) if param is not None else None
            if name is None:
                continue
            if name not in twins:
                originals[name] = param
                twins[name] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            module._parameters[attr] = twins[name]
            slots.append((module._parameters, attr, name))
    for param in originals.values():
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return Released(originals, slots)


def release_weights(model: nn.Module, state: TrainState) -> Released | None:
    """Release ``model``'s trained params when ``state`` holds them as shards (``fsdp``); ``None`` otherwise."""
    from trainfold.step import sharded  # DTensor (~1 s to import): only on use

    if not sharded.is_sharded(state):
        return None
    return release(model, frozenset(state.params))


def restored(released: Released | None, state: TrainState) -> TrainState:
    """Gather ``state``'s params into the released module (every rank: a collective); return the state holding them.

    The state returned has the module's own (plain, full) tensors as params, so that
    ``TrainResult.apply_to`` copies only the buffers; without a ``Released`` it is ``state``.
    """
    if released is None:
        return state
    from trainfold.step import sharded  # DTensor (~1 s to import): only on use

    released.restore(lambda name: sharded.full_params({name: state.params[name]})[name])
    return attrs.evolve(state, params={name: p.detach() for name, p in released.originals.items()})
