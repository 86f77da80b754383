"""What a compiled graph runs: a micro-batch's gradients, over fresh copies of the functions compiled.

The built-in losses trace as they are (their label-range checks step aside while compiling; inside a
graph an out-of-range label fails in the kernel's own bounds check).

>>> fresh_function(len) is len
True
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from trainfold.core.forward import make_forward
from trainfold.step.driver import micro_loss, no_gradient_error
from trainfold.step.plan import StepPlan

__all__ = ["fresh_function", "micro_grads"]


def fresh_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Copy the Python function ``fn`` with its own code object, so that its compiled graphs get their own cache.

    ``torch.compile`` caches graphs per code object; two steps compiling the same function would
    share (and evict) each other's graphs. Builtins have no code object and are returned as they are.
    """
    if not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def micro_grads(
    plan: StepPlan,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    micro: dict[str, Tensor],
    num_items: Tensor,
    key: torch.Generator,
) -> tuple[Tensor, dict[str, Tensor], list[Tensor]]:
    """Return one micro-batch's ``(loss, aux, grads)`` over leaves made here: the compiled step's micro-batch graph."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    forward = make_forward(plan.model, buffers)
    with plan.autocast_scope(num_items.device.type):
        loss, aux = micro_loss(plan, forward, leaves, micro, num_items, key)
    found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    if all(g is None for g in found):  # known when tracing: the eager step then raises the error that names it
        raise no_gradient_error(plan.model, -1)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(found, leaves.values())]
    return loss.detach().float(), {k: v.detach().float() for k, v in aux.items()}, grads
