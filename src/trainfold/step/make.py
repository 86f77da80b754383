"""``make_step``: the plan from its arguments, then the variant they ask for (eager, compiled, differentiable)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
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

__all__ = ["Execution", "make_step"]


@attrs.frozen
class Execution:
    """How a step runs, beside what it computes: mixed precision, compiling, recomputed blocks, a differentiable
    update (``make_step``'s keywords of the same names; its doc says what each does).

    >>> Execution(compile=True, gradient_checkpointing=2).compile_mode is None
    True
    """

    autocast: torch.dtype | None = None
    loss_scaling: LossScaling | None = None
    compile: bool | str | Callable[..., Any] = False
    compile_mode: str | None = None
    gradient_checkpointing: bool | int = False
    differentiable: bool = False


def make_step(
    model: nn.Module,
    loss: Callable[..., Tensor] | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    objective: Objective | None = None,
    count_items: Callable[[Mapping[str, Tensor]], Tensor] | None = None,
    label_key: str = "labels",
    collective: Collective | None = None,
    execution: Execution | None = None,
    **keywords: Any,
) -> Callable[[TrainState, Batch], TrainState]:
    """Return ``step(state, batch) -> state`` for ``model`` (the module doc of ``trainfold.step.driver``).

    ``loss(outputs, labels, num_items_in_batch)`` scores the outputs (default: ``losses.default_loss_for`` the
    model's task; the labels, ``label_key``, leave each micro-batch before the forward pass). ``objective(forward,
    params, micro_batch, num_items, key) -> (loss, aux)`` replaces forward and loss (``aux``: means, weighed by
    items, ``driver.aux_weights``). ``count_items(micro_batch)`` counts items (default: the loss's count of the
    labels); ``collective`` sums counts and gradients across ranks (a ``fully_shard`` module's default: its mesh's).

    How the step runs is an ``Execution`` record, or its fields as keywords (``make_step(model, loss, opt,
    compile=True)`` is ``make_step(model, loss, opt, execution=Execution(compile=True))``): ``autocast`` (a dtype)
    and ``loss_scaling`` (with ``autocast=torch.float16``): ``step.amp``. ``compile`` (True or a backend) and
    ``compile_mode``: ``compiled.compile_step`` (eager, with a warning, where it cannot). ``gradient_checkpointing``
    (an int n: every n-th block): ``step.recompute``. ``differentiable``: ``step.differentiable``.
    ``step(state, batch, donate=True)`` (``step.donating``) updates ``state``'s tensors in place and
    invalidates it (bitwise equal); a donated *lent* state (``init_state(..., copy=False)``) runs the module as
    it is, gradients in ``.grad``, across ranks under ``DistributedDataParallel``. Sharded training: wrap the
    module with FSDP2's ``fully_shard`` (``step.fsdp.fully_shard_model``: per block, then the root) and step a
    lent, donated state; ``sharding=`` is refused with that fix.

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> from trainfold.core.losses import cross_entropy
    >>> step = make_step(torch.nn.Linear(3, 2), cross_entropy, sgd(0.1))
    >>> batch = [{"input": torch.ones(4, 3), "labels": torch.tensor([0, 1, 1, 0])}]
    >>> step(init_state(torch.nn.Linear(3, 2), sgd(0.1)), batch).step.item()
    1
    """
    run = _execution(model, execution, keywords)
    check_differentiable(
        run.differentiable, optimizer, gradient_checkpointing=run.gradient_checkpointing, compile=run.compile,
        collective=collective, loss_scaling=run.loss_scaling,
    )  # fmt: skip
    refuse_own_checkpointing(model, compile=bool(run.compile), differentiable=run.differentiable)
    plan = step_plan(
        model, loss, optimizer, objective=objective, count_items=count_items, label_key=label_key,
        collective=collective, autocast=run.autocast, gradient_checkpointing=run.gradient_checkpointing,
        loss_scaling=run.loss_scaling,
    )  # fmt: skip
    if run.compile:
        refuse_uncompilable(plan)
    if run.differentiable:
        return differentiable_step(plan)
    step = eager_step(plan)
    if run.compile:
        backend = "inductor" if run.compile is True else run.compile
        return compile_step(step, backend=backend, mode=run.compile_mode)
    return step


def _execution(model: nn.Module, execution: Execution | None, keywords: dict[str, Any]) -> Execution:
    """Return ``execution`` with ``keywords`` (its fields) set, refusing ``sharding=`` and what cannot run."""
    sharding = keywords.pop("sharding", None)
    fields = list(attrs.fields_dict(Execution))
    unknown = sorted(set(keywords) - set(fields))
    if unknown:
        raise TypeError(
            f"make_step got unexpected keywords {unknown}; it takes objective, count_items, label_key, collective, "
            f"execution, and the fields of Execution as keywords: {fields}"
        )
    run = attrs.evolve(execution or Execution(), **keywords)
    refuse_engine_options(model, sharding=sharding, compile=run.compile)
    return run
