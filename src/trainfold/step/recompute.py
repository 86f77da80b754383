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

Inside the scope the KV cache is off, as transformers' ``gradient_checkpointing_enable`` arranges:
a recomputed block would append its keys and values to the cache a second time. Every module
config with ``use_cache=True`` reads ``False`` for the duration (restored afterwards), and a
block called with ``use_cache=True`` or a ``cache``/``past_key_values``/``layer_past`` gets
``use_cache=False`` and no cache. Training never reads the cache, so the update is unchanged.

>>> import torch
>>> from trainfold.core.models import TinyLM, TinyLMConfig
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import checkpoint

from trainfold.core.forward import cache_configs, cache_off

__all__ = [
    "checkpoint_blocks",
    "recomputing",
    "own_checkpointing",
    "own_blocks",
    "own_off",
    "refuse_own_checkpointing",
]

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
    # cast: mypy checks a type[Module] against Hashable through Module's instance __hash__
    marked = [m for m in modules if _is_hf_layer(cast(type, type(m)))]
    if marked:
        return marked
    lists = [m for m in modules if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    longest = max(lists, key=len)
    return list(longest)


@contextlib.contextmanager
def recomputing(
    model: nn.Module,
    blocks: list[nn.Module] | None = None,
    every: int = 1,
    modules: list[nn.Module] | None = None,
    configs: Sequence[Any] | None = None,
    own: Sequence[nn.Module] = (),
) -> Iterator[list[nn.Module]]:
    """Checkpoint every ``every``-th of ``blocks`` (default: :func:`checkpoint_blocks`) for the duration; yield them.

    ``every=2`` checkpoints blocks 0, 2, 4, … (HF's ``every_n_layers``): less recomputation, more
    memory. ``modules`` is ``list(model.modules())`` when the caller has walked the tree already,
    ``configs`` its :func:`cache_configs` when the caller has found them already. ``own``: modules
    whose own checkpointing (:func:`own_checkpointing`) is switched off for the duration.
    Raises ``ValueError`` naming the fix when the model has no blocks to checkpoint.
    """
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"every must be an int >= 1 (1: every block), got {every!r}")
    modules = list(model.modules()) if modules is None else modules
    found = _blocks(modules) if blocks is None else list(blocks)
    chosen = found[::every]
    if not chosen:
        raise ValueError(
            f"gradient checkpointing found no blocks in {type(model).__name__}: it checkpoints transformers' "
            "GradientCheckpointingLayer instances or the children of an nn.ModuleList; give the blocks explicitly"
        )
    patched: list[tuple[nn.Module, Any]] = []
    with cache_off(cache_configs(modules) if configs is None else configs), own_off(own):
        try:
            for block in chosen:
                patched.append((block, vars(block).get("forward")))
                block.forward = _checkpointed(block, block.forward)  # an instance attribute: shadows the class's
            yield chosen
        finally:
            for block, previous in reversed(patched):
                if previous is None:
                    del block.forward
                else:
                    block.forward = previous


def own_checkpointing(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Return the modules whose own gradient checkpointing is on (transformers' ``gradient_checkpointing_enable()``).

    Such a module recomputes in backward with the weights it holds then, which are not the step's
    (a copied state's); the step checkpoints the same blocks itself instead, with those switched off.

    >>> import transformers
    >>> config = transformers.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
    ...                                   num_attention_heads=2, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(config)
    >>> model.activation_checkpointing_enable()
    >>> [type(m).__name__ for m in own_checkpointing(model.modules())]
    ['LlamaModel', 'LlamaDecoderLayer', 'LlamaDecoderLayer']
    """
    return [m for m in modules if m.__dict__.get("gradient_checkpointing") is True]


def refuse_own_checkpointing(model: nn.Module, *, compile: bool, differentiable: bool) -> None:
    """Raise ``ValueError`` naming the fix when ``model``'s own checkpointing is on and the step cannot take it over."""
    option = "differentiable" if differentiable else "compile"
    if (compile or differentiable) and own_checkpointing(model.modules()):
        raise ValueError(
            f"{type(model).__name__} has its own gradient checkpointing on (model.gradient_checkpointing_enable()), "
            f"which make_step(..., {option}=...) does not support: its recomputation would not read the step's "
            "tensors; call model.gradient_checkpointing_disable() (the eager step checkpoints such a model itself)"
        )


def own_blocks(own: Sequence[nn.Module], modules: list[nn.Module]) -> list[nn.Module]:
    """Return the blocks that stand for ``own``: the transformers layers among them (HF's ``every_n_layers``
    choice), else the blocks :func:`checkpoint_blocks` finds in ``modules`` (maybe none)."""
    return [m for m in own if _is_hf_layer(cast(type, type(m)))] or _blocks(modules)


@contextlib.contextmanager
def own_off(own: Sequence[nn.Module]) -> Iterator[None]:
    """Switch the own checkpointing of ``own`` (:func:`own_checkpointing`) off for the duration."""
    try:
        for module in own:
            module.__dict__["gradient_checkpointing"] = False  # as transformers sets it
        yield
    finally:
        for module in own:
            module.__dict__["gradient_checkpointing"] = True


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _checkpointed(block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*positional: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        for name in _CACHE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
        return checkpoint(_replaying(block, forward), *positional, use_reentrant=False, **kwargs)

    return run


def _replaying(block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``forward`` such that its recomputation reads the tensors the first call read.

    The pure step binds its tensors to the module only for the forward pass (``functional_call``);
    backward, which recomputes the block, runs after, when the module holds its own weights again,
    which differ from a copied state's once it has stepped. So the block's tensors are taken at the
    call and bound again for the recomputation where the block holds others (a lent state's module,
    FSDP2's gathered params, holds the same ones: nothing is rebound). The binding is torch's own, the one
    ``torch.func.functional_call`` makes (``_reparametrize_module``); ``functional_call`` itself is not used
    because it goes through the block's ``__call__``, whose hooks ran once already, in the first pass.
    """
    held = _tensors(block)

    def again(*positional: Any, **kwargs: Any) -> Any:
        now = _tensors(block)
        if all(now.get(k) is v for k, v in held.items()):
            return forward(*positional, **kwargs)
        with _reparametrize_module(block, held):
            return forward(*positional, **kwargs)

    return again


def _tensors(block: nn.Module) -> dict[str, Any]:
    return {**dict(block.named_parameters(remove_duplicate=False)), **dict(block.named_buffers(remove_duplicate=False))}
