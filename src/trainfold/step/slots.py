"""Where a module keeps its named tensors, and swapping a state's tensors into them for one step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module  # what functional_call uses

from trainfold.core.forward import Forward, make_forward

__all__ = ["Slots"]


class Slots:
    """Where a module keeps each of its named tensors, found once and reused while the tree is unchanged.

    ``functional_call`` walks the module tree to find every slot on each call (about 0.3 ms on a
    two-layer Llama); a step swaps the same names in every time, so the walk is cached here and
    redone only when the module list or any module's parameter or buffer count changes.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 1)
    >>> slots, buffers = Slots(lin), {}
    >>> params = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
    >>> with slots.bound(list(lin.modules()), params, buffers) as forward:
    ...     forward(params, {"input": torch.ones(1, 2)}).item()
    2.0
    >>> lin.weight is params["weight"]                   # swapped back afterwards
    False
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules: list[nn.Module] = []  # held, so that the ids in ``key`` stay theirs
        self.key: list[tuple[int, int, int]] = []
        self.names: frozenset[str] = frozenset()
        self.places: list[tuple[str, dict[str, Any], str]] = []  # (name, the module's slot dict, attribute)

    def _find(self, modules: list[nn.Module], key: list[tuple[int, int, int]]) -> None:
        canonical = {id(t): n for n, t in self.model.named_parameters()}
        canonical.update({id(t): n for n, t in self.model.named_buffers()})
        places = []
        for module in modules:  # a module reachable twice holds its slots once
            for slots in (module._parameters, module._buffers):
                places += [(canonical[id(t)], slots, a) for a, t in slots.items() if t is not None]
        self.modules, self.key, self.places, self.names = modules, key, places, frozenset(canonical.values())

    @contextlib.contextmanager
    def bound(
        self, modules: list[nn.Module], params: dict[str, Tensor], buffers: dict[str, Tensor]
    ) -> Iterator[Forward]:
        """Yield ``forward(params, inputs)`` with ``params`` and ``buffers`` swapped in for the duration.

        Other params (a frozen reference, say) go through ``functional_call``. A buffer the module
        reassigns (rather than updates in place) is written back into ``buffers``.
        """
        other = make_forward(self.model, buffers)

        def forward(p: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Any:
            return self.model(**inputs) if p is params else other(p, inputs)

        key = [(id(m), len(m._parameters), len(m._buffers)) for m in modules]
        if key != self.key:
            self._find(modules, key)
        if self.names != params.keys() | buffers.keys():  # alias names or a mismatch: functional_call's rules
            with _reparametrize_module(self.model, {**params, **buffers}, tie_weights=True, strict=True):
                yield forward
            return
        saved = []
        try:
            for name, slots, attr in self.places:  # frozen parameters travel with the buffers
                saved.append(slots[attr])
                slots[attr] = params[name] if name in params else buffers[name]
            yield forward
        finally:
            for (name, slots, attr), old in zip(reversed(self.places[: len(saved)]), reversed(saved)):
                if name in buffers and slots[attr] is not buffers[name]:
                    buffers[name] = slots[attr]
                slots[attr] = old
