"""What a compiled graph runs: a micro-batch's gradients, loss twins without data-dependent checks, fresh copies.

>>> from trainfold.core.losses import cross_entropy
>>> traceable_loss(cross_entropy) is cross_entropy, fresh_function(len) is len
(False, True)
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainfold.core.forward import make_forward
from trainfold.core.losses import IGNORE_INDEX, causal_lm, cross_entropy, logits_of
from trainfold.step.driver import micro_loss, no_gradient_error
from trainfold.step.plan import StepPlan

__all__ = ["fresh_function", "micro_grads", "traceable_loss"]


def _summed_ce(logits: Tensor, labels: Tensor, num_items: Tensor, label_smoothing: float = 0.0) -> Tensor:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not fit labels of shape {tuple(labels.shape)}")
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return total / num_items.clamp(min=1)


def _traced_causal_lm(outputs: Any, labels: Tensor, num_items: Tensor, label_smoothing: float = 0.0) -> Tensor:
    shifted = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)  # as causal_lm: shift labels, not logits
    return _summed_ce(logits_of(outputs), shifted, num_items, label_smoothing)


def _traced_cross_entropy(outputs: Any, labels: Tensor, num_items: Tensor, label_smoothing: float = 0.0) -> Tensor:
    return _summed_ce(logits_of(outputs), labels, num_items, label_smoothing)


def traceable_loss(loss: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Return ``loss``, or for the built-in losses their twin without the data-dependent label check.

    The built-ins check label ranges with Python control flow on tensor values (``int(tensor)``,
    ``try``/``except`` around the kernel), which no single graph can hold; inside a graph an
    out-of-range label still fails, in the kernel's own bounds check.
    """
    twins = {causal_lm: _traced_causal_lm, cross_entropy: _traced_cross_entropy}
    base, epsilon = getattr(loss, "smooths", (loss, 0.0))  # label_smoothed(causal_lm, eps) and the like
    if base in twins:
        return functools.partial(twins[base], label_smoothing=epsilon) if epsilon else twins[base]
    return loss


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
