"""``make_step``: the plan from its arguments, then the variant they ask for (eager, compiled, differentiable)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from trainfold.core.collective import Collective
from trainfold.core.forward import Batch, Objective
from trainfold.core.state import TrainState
from trainfold.optim import GradientTransformation
from trainfold.step.amp import LossScaling
from trainfold.step.compiled import compile_step, refuse_uncompilable
from trainfold.step.differentiable import check_differentiable, differentiable_step
from trainfold.step.eager import eager_step
from trainfold.step.fsdp import refuse_engine_options
from trainfold.step.plan import step_plan
from trainfold.step.recompute import refuse_own_checkpointing

__all__ = ["make_step"]


def make_step(
    model: nn.Module,
    loss: Callable[..., Tensor] | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    objective: Objective | None = None,
    count_items: Callable[[Mapping[str, Tensor]], Tensor] | None = None,
    label_key: str = "labels",
    collective: Collective | None = None,
    autocast: torch.dtype | None = None,
    compile: bool | str | Callable[..., Any] = False,
    compile_mode: str | None = None,
    gradient_checkpointing: bool | int = False,
    loss_scaling: LossScaling | None = None,
    sharding: Any = None,
    differentiable: bool = False,
) -> Callable[[TrainState, Batch], TrainState]:
    """Return ``step(state, batch) -> state`` for ``model`` (the module doc of ``trainfold.step.driver``).

    ``loss(outputs, labels, num_items_in_batch)`` scores the outputs (default: ``losses.default_loss_for`` the
    model's task; the labels, ``label_key``, leave each micro-batch before the forward pass). ``objective(forward,
    params, micro_batch, num_items, key) -> (loss, aux)`` replaces forward and loss (``aux``: means, weighed by
    items, ``driver.aux_weights``). ``count_items(micro_batch)`` counts items (default: the loss's count of the
    labels); ``collective`` sums counts and gradients across ranks (a ``fully_shard`` module's default: its mesh's).
    ``compile``: ``compiled.compile_step`` (eager, with a warning, where it cannot). ``gradient_checkpointing`` (an
    int n: every n-th block): ``step.recompute``. ``loss_scaling`` (with ``autocast=torch.float16``): ``step.amp``.
    ``step(state, batch, donate=True)`` (``step.donating``) updates ``state``'s tensors in place and
    invalidates it (bitwise equal); a donated *lent* state (``init_state(..., copy=False)``) runs the module as
    it is, gradients in ``.grad``, across ranks under ``DistributedDataParallel``. Sharded training: wrap the
    module with FSDP2's ``fully_shard`` (``step.fsdp.fully_shard_model``: per block, then the root) and step a
    lent, donated state; ``sharding=`` is refused with that fix. ``differentiable``: ``step.differentiable``.

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> from trainfold.core.losses import cross_entropy
    >>> step = make_step(torch.nn.Linear(3, 2), cross_entropy, sgd(0.1))
    >>> batch = [{"input": torch.ones(4, 3), "labels": torch.tensor([0, 1, 1, 0])}]
    >>> step(init_state(torch.nn.Linear(3, 2), sgd(0.1)), batch).step.item()
    1
    """
    options = dict(compile=compile, sharding=sharding, collective=collective, loss_scaling=loss_scaling)
    check_differentiable(differentiable, optimizer, gradient_checkpointing=gradient_checkpointing, **options)
    settings: dict[str, Any] = dict(
        objective=objective, count_items=count_items, label_key=label_key, collective=collective
    )
    precision: dict[str, Any] = dict(
        autocast=autocast, gradient_checkpointing=gradient_checkpointing, loss_scaling=loss_scaling
    )
    refuse_engine_options(model, sharding=sharding, compile=compile)
    refuse_own_checkpointing(model, compile=bool(compile), differentiable=differentiable)
    plan = step_plan(model, loss, optimizer, **settings, **precision)
    if compile:
        refuse_uncompilable(plan)
    if differentiable:
        return differentiable_step(plan)
    step = eager_step(plan)
    if compile:
        return compile_step(step, backend="inductor" if compile is True else compile, mode=compile_mode)
    return step
