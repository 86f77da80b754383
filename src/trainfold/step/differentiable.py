"""The differentiable step: the update stays in autograd's graph (``make_step(..., differentiable=True)``).

The eager step takes gradients over fresh leaves and returns detached params: the fastest path,
and the right one for training. This step instead differentiates the loss with
``create_graph=True`` and applies the optimizer's pure ``update`` out of place, so the params it
returns are functions of the params it was given and of every tensor hyperparameter that requires
grad. A loss computed after K steps then has the exact gradient with respect to the learning rate
(``sgd(lr_tensor)``), the momentum, or the initial params: hypergradients, MAML's second-order
term, unrolled optimisation. Metrics (loss, grad norm) are recorded detached, as in every step.

It runs on one process, without compiling, sharding or loss scaling (each is refused by name);
dropout and the micro-batch driver's seeding are the eager step's, so with the same state and
batch the two steps agree in value to rounding.

>>> import torch
>>> from trainfold.core.losses import cross_entropy
>>> from trainfold.core.state import init_state
>>> from trainfold.optim import sgd
>>> from trainfold.step.plan import step_plan
>>> lr = torch.tensor(0.5, requires_grad=True)
>>> model = torch.nn.Linear(2, 2)
>>> step = differentiable_step(step_plan(model, cross_entropy, sgd(lr)))
>>> batch = [{"input": torch.ones(3, 2), "labels": torch.tensor([0, 1, 1])}]
>>> new = step(init_state(model, sgd(lr)), batch)
>>> new.params["weight"].grad_fn is not None, torch.autograd.grad(new.params["weight"].sum(), lr)[0].shape
(True, torch.Size([]))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from trainfold.core.forward import Batch, cache_off, training_flags
from trainfold.core.state import TrainState
from trainfold.core.tree import global_norm
from trainfold.optim.hyper import grad_hyperparameters
from trainfold.optim.transform import apply_updates
from trainfold.step.driver import accumulate_step, materialized, micro_loss, next_state, no_gradient_error, open_step
from trainfold.step.eager import pure_forward
from trainfold.step.plan import StepPlan

__all__ = ["check_differentiable", "differentiable_step"]


def check_differentiable(differentiable: bool, optimizer: Any, **options: Any) -> None:
    """Raise ``ValueError`` for what ``make_step(..., differentiable=differentiable, **options)`` would get wrong.

    A differentiable step refuses every option it cannot honour (all named at once); any other step refuses
    an optimizer holding tensors that require grad, whose gradient it would silently lose.

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> check_differentiable(True, sgd(0.1), compile=True, sharding=None)
    Traceback (most recent call last):
    ...
    ValueError: make_step(..., differentiable=True) cannot take compile=True (the graph through the update is ...
    >>> check_differentiable(False, sgd(torch.tensor(0.1, requires_grad=True)))
    Traceback (most recent call last):
    ...
    ValueError: the optimizer holds tensors that require grad at ['sgd.schedule.<value>']: ...
    """
    if not differentiable:
        held = [] if optimizer is None else grad_hyperparameters(optimizer)
        if held:
            raise ValueError(
                f"the optimizer holds tensors that require grad at {held}: this step updates the params detached, "
                "so their gradient would be silently lost; pass make_step(..., differentiable=True) to "
                "differentiate through the update, or pass plain numbers (or .detach()ed tensors)"
            )
        return
    bad = [f"{name}={value!r}" for name, value in options.items() if value not in (None, False, 0)]
    if bad:
        raise ValueError(
            f"make_step(..., differentiable=True) cannot take {', '.join(bad)} (the graph through the update is "
            "built eagerly on one process, without loss scaling or recomputed blocks); drop those options, or "
            "differentiate a step without them"
        )


def differentiable_step(plan: StepPlan) -> Callable[..., TrainState]:
    """Return ``step(state, batch) -> state`` of ``plan`` that keeps autograd's graph through the update.

    ``donate=True`` is refused (an in-place update would cut the graph).
    """

    def step(state: TrainState, batch: Batch, *, donate: bool = False) -> TrainState:
        if donate:
            raise ValueError(
                "a differentiable step cannot take a donated state: updating params in place would cut the graph "
                "through the update; call it without donate=True (fit(..., donate=False))"
            )
        with torch.enable_grad():  # also under torch.no_grad: the step is its gradient
            return _step(plan, state, batch)

    step.plan = plan  # type: ignore[attr-defined]
    return step


def _step(plan: StepPlan, state: TrainState, batch: Batch) -> TrainState:
    start, done = open_step(plan, state, batch)
    if done is not None:
        return done
    device = next(iter(state.params.values())).device
    # params that already carry a graph (or require grad) are used as they are; the others become leaves
    leaves = {k: v if v.requires_grad else v.detach().requires_grad_() for k, v in state.params.items()}
    leaf_list = list(leaves.values())
    buffers = {k: v.clone() for k, v in state.buffers.items()}
    n_dev = start.num_items.to(device)
    total: list[Tensor | None] = [None] * len(leaf_list)

    def micro(mb: Mapping[str, Tensor], key: torch.Generator) -> tuple[Tensor, Mapping[str, Tensor], None]:
        with plan.autocast_scope(device.type):
            loss, aux = micro_loss(plan, forward, leaves, mb, n_dev, key)
        if not loss.requires_grad:
            raise no_gradient_error(plan.model, start.number)
        grads = torch.autograd.grad(loss, leaf_list, create_graph=True, allow_unused=True)
        for i, g in enumerate(grads):  # out of place: every partial sum stays in the graph
            total[i] = _plus(total[i], g)
        return loss, aux, None

    forward = pure_forward(plan, leaves, buffers)  # functional_call: the graph reaches the leaves
    with training_flags(list(plan.model.modules()), True), cache_off(plan.cache_configs):
        sums = accumulate_step(plan, state, start, micro, batch, device)
    grads = dict(zip(leaves, materialized(total, leaf_list, plan.model, start.number)))
    learning_rate = plan.optimizer.learning_rate(state.opt_state)
    updates, opt_state = plan.optimizer.update(grads, state.opt_state, leaves)
    params = apply_updates(leaves, updates)
    norm = global_norm(grads)
    return next_state(
        plan, state, start, sums, norm, learning_rate, params=params, buffers=buffers, opt_state=opt_state
    )


def _plus(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a + b
