"""The eager step: the micro-batch driver over the model's own forward, backward into ``.grad``, one update."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.forward import Batch, Forward, cache_off, make_forward, training_flags
from trainfold.core.state import TrainState, resharded
from trainfold.core.tree import global_norm, known_norm
from trainfold.distributed.distributed import failure_of
from trainfold.step.amp import SCALER, ScalerState, unscale_, updated
from trainfold.step.data_parallel import DataParallel, engine_for
from trainfold.step.driver import (
    MicroStep,
    StepStart,
    Sums,
    accumulate_step,
    materialized,
    micro_loss,
    next_state,
    no_gradient_error,
    open_step,
    sum_over_ranks,
    with_donation,
)
from trainfold.step.fsdp import summing, syncing_last
from trainfold.step.plan import StepPlan, is_fully_sharded

__all__ = ["eager_step", "is_lent", "only_leaves_need_grad", "pure_forward"]


def eager_step(plan: StepPlan) -> Callable[..., TrainState]:
    """Return ``step(state, batch, *, donate=False) -> state`` of ``plan``, run eagerly (``make_step`` builds it).

    The step carries its plan as ``step.plan``, so that ``compiled.compile_step(step)`` can wrap it, and its
    ``step.engine``: the ``data_parallel.DataParallel`` a lent state steps through across ranks (else None).

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> from trainfold.core.losses import cross_entropy
    >>> from trainfold.step.plan import step_plan
    >>> step = eager_step(step_plan(torch.nn.Linear(3, 2), cross_entropy, sgd(0.1)))
    >>> batch = [{"input": torch.ones(4, 3), "labels": torch.tensor([0, 1, 1, 0])}]
    >>> step(init_state(torch.nn.Linear(3, 2), sgd(0.1)), batch).step.item()
    1
    """
    fsdp = summing(plan.model)  # FSDP2 sums (not averages) its reduce-scattered gradients
    engine = None if fsdp else engine_for(plan.collective, plan.model)  # DDP across ranks, for lent states
    world = getattr(plan.collective, "world_size", 1)

    def run(state: TrainState, batch: Batch, donate: bool) -> TrainState:
        try:
            return _step(plan, state, batch, donate, engine, fsdp)
        except Exception as exc:  # another rank's error (DDP's or FSDP's collective lost it), named here; ours,
            if world < 2:  # recorded for the others
                raise
            failure = failure_of(exc, plan.collective.rank, world)  # type: ignore[union-attr]
            if failure is exc:
                raise
            raise failure from exc

    step = with_donation(run)
    step.plan = plan  # type: ignore[attr-defined]
    step.engine = engine  # type: ignore[attr-defined]
    return step


def _step(
    plan: StepPlan,
    state: TrainState,
    batch: Batch,
    donate: bool = False,
    engine: DataParallel | None = None,
    fsdp: bool = False,
) -> TrainState:
    lent = _lends(plan, state, donate, fsdp)
    start, done = open_step(plan, state, batch)
    if done is not None:
        return done
    device = next(iter(state.params.values())).device
    leaves, buffers = _leaves(state, lent, donate)
    scaler = _scaler_of(plan, state)
    modules = list(plan.model.modules())
    engine = engine if lent else None  # the pure path sums its gradients after backward
    module = engine.module() if engine is not None else plan.model
    forward = _lent_forward(module, plan.model, leaves, buffers) if lent else pure_forward(plan, leaves, buffers)
    with training_flags(modules, True), cache_off(plan.cache_configs), plan.recompute_scope(modules):
        micro = _backward(plan, forward, leaves, start, scaler, device, fsdp=fsdp and lent)
        if engine is not None:
            micro = engine.syncing_last(micro, len(batch))
        elif fsdp:  # FSDP2: reduce-scatter once per step, after the last micro-batch
            micro = syncing_last(plan.model, micro, len(batch))
        sums = accumulate_step(plan, state, start, micro, batch, device)
    try:
        summed = engine is not None or fsdp  # DDP or FSDP summed the gradients over the ranks in backward
        return _update(plan, state, start, leaves, buffers, sums, scaler, donate, lent, summed=summed)
    finally:
        if lent:
            for leaf in leaves.values():
                leaf.grad = None


def _lends(plan: StepPlan, state: TrainState, donate: bool, fsdp: bool) -> bool:
    """Say whether the step runs the module as it is (a donated, lent state); refuse an FSDP2 module otherwise."""
    lent = donate and is_lent(plan.model, state)
    if fsdp and donate and not lent:  # after a forward without backward the root may hold its gathered params
        lent = is_lent(resharded(plan.model), state)
    if fsdp and not lent:
        raise TypeError(
            f"{type(plan.model).__name__} is wrapped with fully_shard (FSDP2): its step runs the module as it is, on "
            "a lent, donated state: state = init_state(model, optimizer, copy=False), then "
            "step(state, batch, donate=True) (fit and train donate)"
        )
    return lent


def _leaves(state: TrainState, lent: bool, donate: bool) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Return the params to differentiate and the buffers of the forward pass: a lent state's own tensors (their
    ``.grad`` cleared), else fresh leaves and (but for a donated state, updated in place) copied buffers."""
    if lent:  # the state's params are the module's Parameters: run the module as it is
        leaves = dict(state.params)
        for leaf in leaves.values():
            leaf.grad = None
        return leaves, dict(state.buffers)
    # the pure path: fresh leaves bound to the module for the call; running stats update copies
    leaves = {k: v.detach().requires_grad_() for k, v in state.params.items()}
    return leaves, dict(state.buffers) if donate else {k: v.clone() for k, v in state.buffers.items()}


def is_lent(model: nn.Module, state: TrainState) -> bool:
    """Say whether ``state`` is lent by ``model``: its params are the module's own ``Parameter`` objects, and its
    buffers the module's own tensors (``init_state(model, optimizer, copy=False)``).

    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> lin = torch.nn.Linear(2, 1)
    >>> is_lent(lin, init_state(lin, sgd(0.1), copy=False)), is_lent(lin, init_state(lin, sgd(0.1)))
    (True, False)
    """
    own = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    return all(own.get(k) is v for tree in (state.params, state.buffers) for k, v in tree.items())


def pure_forward(plan: StepPlan, leaves: dict[str, Tensor], buffers: dict[str, Tensor]) -> Forward:
    """Return ``forward(params, inputs)`` through ``functional_call``, writing a buffer the module reassigns (rather
    than updates in place) for the step's ``leaves`` back into ``buffers``."""
    model, forward = plan.model, make_forward(plan.model, buffers)

    def bound(params: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Any:
        if params is not leaves:
            return forward(params, inputs)
        seen: dict[str, Tensor] = {}
        hook = model.register_forward_hook(lambda module, args, out: seen.update(module.named_buffers()))
        try:
            out = forward(params, inputs)
        finally:
            hook.remove()
        buffers.update({k: v for k, v in seen.items() if k in buffers and v is not buffers[k]})
        return out

    return bound


def _lent_forward(
    module: nn.Module, model: nn.Module, leaves: dict[str, Tensor], buffers: dict[str, Tensor]
) -> Forward:
    """Return ``forward(params, inputs)``: ``module`` as it is (or its DDP wrapper) for the lent ``leaves``, else
    ``functional_call`` (a frozen reference's params, say)."""
    other = make_forward(model, buffers)
    fsdp = is_fully_sharded(model)

    def forward(params: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Any:
        if params is leaves:
            return module(**inputs)
        if fsdp:  # FSDP's hooks would put the module's own gathered params back in place of these
            raise TypeError(
                f"{type(model).__name__} is wrapped with fully_shard (FSDP2): it runs on its own params only, so "
                "an objective cannot call forward on other params (a frozen reference); keep the reference in a "
                "module of its own, or precompute its outputs (e.g. DPO's reference log-probs)"
            )
        return other(params, inputs)

    return forward


def _backward(
    plan: StepPlan,
    forward: Forward,
    leaves: dict[str, Tensor],
    start: StepStart,
    scaler: ScalerState | None,
    device: torch.device,
    fsdp: bool = False,
) -> MicroStep:
    """Return the eager ``micro``: forward and loss (under autocast), backward into the leaves' ``.grad``.

    Under FSDP2 (``fsdp``) the graph holds the gathered params, not the leaves (the shards): backward runs
    over the whole graph and FSDP's hooks reduce-scatter into the leaves' ``.grad``.
    """
    leaf_list = list(leaves.values())
    n_dev = start.num_items.to(device)
    autocast = plan.autocast_scope(device.type)
    inputs = None if fsdp or only_leaves_need_grad(plan) else leaf_list

    def micro(mb: Mapping[str, Tensor], key: torch.Generator) -> tuple[Tensor, Mapping[str, Tensor], None]:
        with autocast:
            loss, aux = micro_loss(plan, forward, leaves, mb, n_dev, key)
        scaled = loss if scaler is None else loss * scaler.scale.to(loss.device)
        if not scaled.requires_grad:
            raise no_gradient_error(plan.model, start.number)
        # each gradient is added into its leaf's .grad as backward produces it (as .backward() does), so a
        # second micro-batch never holds a whole second set of gradients
        torch.autograd.backward(scaled, inputs=inputs)
        return loss, aux, None

    return micro


def only_leaves_need_grad(plan: StepPlan) -> bool:
    """Say whether backward reaches no tensor requiring grad but the step's leaves, so it needs no ``inputs=``.

    The step swaps its leaves into every parameter slot (frozen params and buffers are detached), and
    trainfold's own losses take only the outputs: backward then reaches the leaves alone, and
    ``inputs=leaves`` (a walk of the graph per micro-batch: ~1.5% of a 0.13M-param step) changes
    nothing. An objective or a loss of the user's may use other tensors that require grad (a
    reference model, a learned temperature): there ``inputs=`` keeps their ``.grad`` untouched.

    >>> from trainfold.core.losses import causal_lm
    >>> from trainfold.optim import sgd
    >>> from trainfold.step.plan import step_plan
    >>> only_leaves_need_grad(step_plan(torch.nn.Linear(2, 2), causal_lm, sgd(0.1)))
    True
    >>> only_leaves_need_grad(step_plan(torch.nn.Linear(2, 2), lambda out, labels, n: out.sum(), sgd(0.1)))
    False
    """
    module = getattr(plan.loss, "__module__", None) or ""
    return plan.objective is None and module.startswith("trainfold.core.")


def _update(
    plan: StepPlan,
    state: TrainState,
    start: StepStart,
    leaves: dict[str, Tensor],
    buffers: dict[str, Tensor],
    sums: Sums,
    scaler: ScalerState | None,
    donate: bool,
    lent: bool = False,
    summed: bool = False,
) -> TrainState:
    """Sum the gradients over ranks (unless DDP ``summed`` them), unscale them (fp16), and apply the optimizer
    (unless they overflowed).

    A lent state's params (the module's Parameters) are updated in place and stay the next state's params.
    """
    leaf_list = list(leaves.values())
    grads = materialized([leaf.grad for leaf in leaf_list], leaf_list, plan.model, start.number)
    sum_over_ranks(plan.collective, [sums.loss] if summed else [*grads, sums.loss])
    found_inf = None
    if scaler is not None:
        assert plan.loss_scaling is not None
        found_inf = unscale_(grads, scaler)
        state = attrs.evolve(state, extras={**state.extras, SCALER: updated(scaler, found_inf, plan.loss_scaling)})
    grad_tree = dict(zip(leaves, grads))
    norm = grad_norm = global_norm(grad_tree)
    if hasattr(grad_norm, "full_tensor"):  # DTensor gradients (FSDP2): their norm is reduced over the ranks
        grad_norm = grad_norm.full_tensor()
    if found_inf is not None and bool(found_inf):  # overflow: skip the update, keep the params and optimizer state
        return next_state(plan, state, start, sums, grad_norm, buffers=buffers)
    learning_rate = plan.optimizer.learning_rate(state.opt_state)  # before a donated update reuses the tensors
    with torch.no_grad(), known_norm(grad_tree, norm):  # a chain's clipping reuses the norm
        params, opt_state = plan.optimizer.apply(grad_tree, state.opt_state, state.params, donate=donate)
    new_params = {k: state.params[k] if lent else params[k].detach() for k in leaves}
    if lent:
        _check_in_place(params, state.params)
        buffers = _own_buffers(plan.model, buffers)
    return next_state(
        plan, state, start, sums, grad_norm, learning_rate, params=new_params, buffers=buffers, opt_state=opt_state
    )


def _check_in_place(params: Mapping[str, Tensor], lent: Mapping[str, Tensor]) -> None:
    """Copy into the lent Parameters any new param the optimizer returned in fresh memory."""
    with torch.no_grad():
        for k, p in lent.items():
            if params[k] is not p:
                p.copy_(params[k])


def _own_buffers(model: nn.Module, buffers: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return the module's current tensors for ``buffers``' names (a module may reassign a buffer)."""
    own = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    return {k: own.get(k, v) for k, v in buffers.items()}


def _scaler_of(plan: StepPlan, state: TrainState) -> ScalerState | None:
    if plan.loss_scaling is None:
        return None
    scaler = state.extras.get(SCALER)
    if scaler is None:
        raise KeyError(
            f"loss_scaling needs the scaler in state.extras[{SCALER!r}]: "
            "init_state(..., extras={trainfold.step.amp.SCALER: trainfold.step.amp.initial_scaler(scaling)})"
        )
    return scaler
