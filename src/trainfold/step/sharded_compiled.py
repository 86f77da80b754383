"""The sharded step under ``torch.compile``: each transformer block's forward compiled, collectives kept eager.

``make_step(..., sharding=mesh, compile=True)`` compiles the local compute the way torchtitan
compiles FSDP2 models, one block at a time: the step's driver, the all-gathers and the
reduce-scatters (``sharded_gather``) run eagerly around each block, and the block's forward runs
as one compiled graph (``torch.compile`` of its class's ``forward``; AOTAutograd gives its
backward). Blocks of one class share one graph, so compile time does not grow with depth, and a
graph never holds a collective. The model's root (embeddings, head, final norm, loss) runs eagerly.

The module the user holds is not changed: the compiled forward is put on each block for the
duration of a step only (an instance attribute, as activation checkpointing does) and removed
afterwards, so ``model(x)`` after training runs the plain module.

Random draws (dropout) come from the same seeded generators as the eager step: inductor is told
``fallback_random=True`` (torch's own random kernels rather than its fused ones), so the compiled
sharded step draws the eager step's dropout masks.

>>> import torch
>>> compiler = BlockCompiler("aot_eager")
>>> block = torch.nn.Linear(2, 2)
>>> compiler(block) is compiler(block), compiler.options()
(True, None)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from trainfold.step.recompute import checkpoint_blocks
from trainfold.step.traced import fresh_function

__all__ = ["BlockCompiler", "refuse_uncompilable_sharded"]


class BlockCompiler:
    """Compiles each block's forward once: ``compiler(block)`` is the callable that runs it compiled.

    Blocks of one class share the compiled ``forward`` of that class (a fresh copy of its code, so
    that two steps never share a graph cache); a block whose ``forward`` is an instance attribute
    gets its own.
    """

    def __init__(self, backend: str | Callable[..., Any] = "inductor", mode: str | None = None) -> None:
        self.backend, self.mode = backend, mode
        self._shared: dict[type, Callable[..., Any]] = {}
        self._bound: dict[int, Callable[..., Any]] = {}

    def options(self) -> dict[str, Any] | None:
        """Return the inductor options (the mode's, with torch's random kernels), ``None`` for other backends."""
        if self.backend != "inductor":
            return None
        import torch._inductor

        return {**(torch._inductor.list_mode_options(self.mode) if self.mode else {}), "fallback_random": True}

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``fn`` under ``torch.compile`` with this compiler's backend and mode."""
        import torch

        options = self.options()
        if options is not None:  # inductor: the mode travels in the options (torch.compile takes one of the two)
            return torch.compile(fn, backend=self.backend, options=options)
        return torch.compile(fn, backend=self.backend, mode=self.mode)

    def __call__(self, block: nn.Module) -> Callable[..., Any]:
        if id(block) not in self._bound:
            own = vars(block).get("forward")
            if own is not None:
                self._bound[id(block)] = self.compile(own)
            else:
                cls = type(block)
                if cls not in self._shared:
                    self._shared[cls] = self.compile(fresh_function(cls.forward))
                self._bound[id(block)] = functools.partial(self._shared[cls], block)
        return self._bound[id(block)]


def refuse_uncompilable_sharded(model: nn.Module, per_block: bool) -> None:
    """Raise ``ValueError`` where the compiled sharded step cannot compile: a model without blocks, or no per-block
    gathering (``Sharding(per_block=False)``).

    >>> import torch
    >>> refuse_uncompilable_sharded(torch.nn.Linear(2, 2), True)
    Traceback (most recent call last):
    ...
    ValueError: compile with sharding compiles each transformer block, and Linear has none (transformers' \
GradientCheckpointingLayer instances or the children of an nn.ModuleList); use compile=False for this model
    """
    if not per_block:
        raise ValueError(
            "compile with sharding compiles each transformer block as it is gathered, but this Sharding gathers "
            "the whole model (per_block=False); use Sharding(mesh) (per_block=True) or compile=False"
        )
    if not checkpoint_blocks(model):
        raise ValueError(
            f"compile with sharding compiles each transformer block, and {type(model).__name__} has none "
            "(transformers' GradientCheckpointingLayer instances or the children of an nn.ModuleList); "
            "use compile=False for this model"
        )
