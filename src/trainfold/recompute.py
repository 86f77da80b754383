"""Gradient (activation) checkpointing as a scope, not a model setting: recompute blocks in backward.

``recomputing(model)`` makes each block of ``model`` keep only its inputs during the forward pass
and run again in the backward pass (``torch.utils.checkpoint``, non-reentrant, so it works with
``torch.autograd.grad``), trading about one extra forward for the activations of every block. It
lasts for the ``with`` block only: the model is left as it was, even when the step raises. The
step enters it when built with ``make_step(..., gradient_checkpointing=True)`` (or
``TrainingArguments(gradient_checkpointing=True)``).

Blocks are the model's transformer layers: instances of transformers' ``GradientCheckpointingLayer``
when there are any, otherwise the children of its longest ``nn.ModuleList`` (``layers``, ``h``,
``blocks``). Random draws inside a block (dropout) are replayed exactly in the recomputation, so
gradients equal those without checkpointing.

>>> import torch
>>> from trainfold.models import TinyLM, TinyLMConfig
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, max_len=8))
>>> [name for name, _ in checkpoint_blocks(model)]
['blocks.0', 'blocks.1']
>>> with recomputing(model):
...     inside = "forward" in vars(model.blocks[0])
>>> inside, "forward" in vars(model.blocks[0])
(True, False)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_blocks", "recomputing"]

_HF_LAYER = "GradientCheckpointingLayer"


def checkpoint_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return ``(name, module)`` for the blocks :func:`recomputing` checkpoints (see the module doc).

    >>> import torch
    >>> checkpoint_blocks(torch.nn.Linear(2, 2))
    []
    """
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(b)], b) for b in _blocks(list(model.modules()))]


@functools.cache
def _is_hf_layer(cls: type) -> bool:
    return any(c.__name__ == _HF_LAYER for c in cls.__mro__[1:])


def _blocks(modules: list[nn.Module]) -> list[nn.Module]:
    marked = [m for m in modules if _is_hf_layer(type(m))]
    if marked:
        return marked
    lists = [m for m in modules if isinstance(m, nn.ModuleList) and len(m) > 0]
    return list(max(lists, key=len)) if lists else []


@contextlib.contextmanager
def recomputing(model: nn.Module, blocks: list[nn.Module] | None = None, every: int = 1,
                modules: list[nn.Module] | None = None) -> Iterator[list[nn.Module]]:
    """Checkpoint every ``every``-th of ``blocks`` (default: :func:`checkpoint_blocks`) for the duration; yield them.

    ``every=2`` checkpoints blocks 0, 2, 4, … (HF's ``every_n_layers``): less recomputation, more
    memory. ``modules`` is ``list(model.modules())`` when the caller has walked the tree already.
    Raises ``ValueError`` naming the fix when the model has no blocks to checkpoint.
    """
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"every must be an int >= 1 (1: every block), got {every!r}")
    found = _blocks(list(model.modules()) if modules is None else modules) if blocks is None else list(blocks)
    chosen = found[::every]
    if not chosen:
        raise ValueError(
            f"gradient checkpointing found no blocks in {type(model).__name__}: it checkpoints transformers' "
            "GradientCheckpointingLayer instances or the children of an nn.ModuleList; give the blocks explicitly"
        )
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for block in chosen:
            patched.append((block, vars(block).get("forward")))
            block.forward = _checkpointed(block.forward)  # an instance attribute: shadows the class's forward
        yield chosen
    finally:
        for block, previous in reversed(patched):
            if previous is None:
                del block.forward
            else:
                block.forward = previous


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
