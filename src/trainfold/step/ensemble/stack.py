"""Train K copies of a model at once: one step over stacked parameters, vmapped forward pass.

The state is an ensemble state (``trainfold.step.ensemble.state``: every tensor with a leading
member axis of size K). The step runs the model's forward pass
once for all members with ``torch.func.vmap`` over ``functional_call``, scores each member with the
loss (outside vmap, so losses may check their inputs), and takes all members' gradients with one
``torch.autograd.grad`` of the summed losses (members share no parameter, so each gets exactly its
own gradient). Counting, seeding, summing over micro-batches and ranks and the step's metrics are
the micro-batch driver's (``trainfold.step.driver``). Then each member's optimizer (any
transformation: ``adamw``, ``sgd``, ``from_torch(...)``, chains) applies its update to that
member's slice of the stacked params and optimizer state, outside vmap, exactly as ``make_step``
would. Members may differ in initial weights, seeds and optimizers (pass one optimizer per member).

Speed on CPU (``benchmarks/ensemble.py``): the matmuls of small models already keep the cores
busy, so an eager vmapped step is no faster than K sequential steps. Compiled, the step pays
off; ``batching="unroll"`` (all members' forward passes in one compiled graph, no vmap) was the
fastest there, and also serves models whose ops have no batching rule (CPU sdpa).

>>> import torch
>>> from trainfold import adamw
>>> from trainfold.core.losses import cross_entropy
>>> from trainfold.step.ensemble.state import init_ensemble_state, split_ensemble
>>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
>>> state = init_ensemble_state(models, adamw(0.1))
>>> step = make_ensemble_step(models[0], cross_entropy, adamw(0.1))
>>> batch = [{"input": torch.ones(4, 5, 3), "labels": torch.zeros(4, 5, dtype=torch.long)}]
>>> new = step(state, batch)
>>> new.step.tolist(), len(split_ensemble(new))
([1, 1, 1, 1], 4)
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import attrs
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils import _pytree as pytree

from trainfold.core.collective import Collective, item_count, items_in_batch
from trainfold.core.forward import train_mode
from trainfold.core.losses import counter_for, default_loss_for, warn_no_items
from trainfold.core.state import TrainState
from trainfold.core.tree import global_norm, map_tensors
from trainfold.optim import GradientTransformation, overwrite
from trainfold.step.compiled import CompileFallbackWarning
from trainfold.step.driver import accumulate, advanced, no_gradient_error, sum_over_ranks, with_donation
from trainfold.step.ensemble.state import (
    ensemble_size,
)
from trainfold.step.plan import refuse_sharded
from trainfold.step.traced import fresh_function

Batch = Sequence[Mapping[str, Tensor]]


# -- the step ---------------------------------------------------------------------------------------


_OP = re.compile(r"aten::[\w.]+")


def _vmap_error(err: RuntimeError, model: nn.Module) -> TypeError | None:
    """Turn vmap's refusal into an error naming the op and the fix; ``None`` if it is another error."""
    text = str(err)
    if "vmap" not in text and "Batching rule" not in text:
        return None
    op = _OP.search(text)
    if op:
        what = op.group(0)
    elif ".item()" in text:
        what = "Tensor.item()"
    elif "data-dependent control flow" in text:
        what = "data-dependent control flow (if/while on a tensor's value)"
    elif "boolean mask" in text:
        what = "indexing with a boolean mask"
    else:
        what = "an op"
    first = text.strip().splitlines()[0]
    return TypeError(
        f"{type(model).__name__} cannot run as a vmapped ensemble: {what} has no batching rule ({first}). "
        "Rewrite that part of the forward pass with batchable ops, or train the members one by one with make_step"
    )


def _member(outputs: Any, m: int) -> Any:
    return (
        outputs[m]
        if isinstance(outputs, Tensor)
        else pytree.tree_map(lambda t: t[m] if isinstance(t, Tensor) else t, outputs)
    )


def _select(micro: Mapping[str, Tensor], m: int, shared: bool) -> dict[str, Tensor]:
    return dict(micro) if shared else {k: v[m] for k, v in micro.items()}


@attrs.frozen
class _EnsemblePlan:
    model: nn.Module
    loss: Callable[..., Tensor]
    count_items: Callable[[Mapping[str, Tensor]], Tensor]
    label_key: str
    shared: bool
    unroll: bool
    optimizers: tuple[GradientTransformation, ...] = ()
    collective: Collective | None = None


def _grads(
    plan: _EnsemblePlan,
    k: int,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    micro: dict[str, Tensor],
    num_items: Tensor,
) -> tuple[Tensor, list[Tensor]]:
    """Return the K members' losses (K,) and the stacked gradients of one micro-batch."""
    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    inputs = {key: v for key, v in micro.items() if key != plan.label_key}
    labels = micro[plan.label_key]

    def forward(p: dict[str, Tensor], b: dict[str, Tensor], x: dict[str, Tensor]) -> Any:
        return functional_call(plan.model, (p, b), args=(), kwargs=x, strict=True)

    if plan.unroll:  # member by member, on views of the stacked tensors
        outputs = [
            forward(
                {n: v[m] for n, v in leaves.items()},
                {n: v[m] for n, v in buffers.items()},
                _select(inputs, m, plan.shared),
            )
            for m in range(k)
        ]
    else:
        batched = vmap(forward, in_dims=(0, 0, None if plan.shared else 0), randomness="different")(
            leaves, buffers, inputs
        )
        outputs = [_member(batched, m) for m in range(k)]
    losses = [plan.loss(outputs[m], labels if plan.shared else labels[m], num_items[m]) for m in range(k)]
    stacked = torch.stack(losses)
    total = stacked.sum()
    if not total.requires_grad:
        raise no_gradient_error(plan.model, -1)
    grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    if all(g is None for g in grads):  # static: known when tracing too
        raise no_gradient_error(plan.model, -1)
    return stacked.detach().float(), [torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves.values())]


def make_ensemble_step(
    model: nn.Module,
    loss: Callable[..., Tensor] | None = None,
    optimizer: GradientTransformation | Sequence[GradientTransformation] | None = None,
    *,
    count_items: Callable[[Mapping[str, Tensor]], Tensor] | None = None,
    label_key: str = "labels",
    shared_batch: bool = False,
    batching: str = "vmap",
    compile: bool | str = False,
    collective: Collective | None = None,
) -> Callable[[TrainState, Batch], TrainState]:
    """Return ``step(ensemble_state, batch) -> ensemble_state`` training K members of ``model`` at once.

    Each tensor of each micro-batch has a leading member axis (``stack_batches`` builds it);
    with ``shared_batch=True`` every member sees the same, unstacked micro-batches. Member m's
    update equals ``make_step(model, loss, optimizer_m)`` on its own batch, up to float rounding.
    The optimizer is one transformation for all members, or one per member.
    ``batching="vmap"`` runs one forward pass for all members (``torch.func.vmap``; every op needs a
    batching rule); ``"unroll"`` runs the members one after another on views of the stacked tensors
    (no batching rule needed; under ``compile=True`` all members in one graph, on CPU the faster choice
    for small models). ``compile=True`` runs the gradient and the update under ``torch.compile`` (a
    string names the backend, e.g. ``"aot_eager"``); if compiling fails it warns with a
    ``CompileFallbackWarning`` and runs eagerly. ``collective`` sums each member's item count, loss and
    gradients across ranks, as ``make_step``'s does. Dropout masks are seeded from ``(seeds, step,
    micro)`` (and the rank): deterministic, but not the ones a member's own ``make_step`` would draw.
    ``step(state, batch, donate=True)`` (or ``step.donating``, which ``fit`` uses) writes the update
    into the donated state's stacked tensors, bitwise as the non-donating step, and invalidates it.

    >>> import torch
    >>> from trainfold import adamw
    >>> from trainfold.core.losses import cross_entropy
    >>> models = [torch.nn.Linear(3, 2) for _ in range(2)]
    >>> from trainfold.step.ensemble.state import init_ensemble_state
    >>> opts = [adamw(0.0), adamw(0.1)]                  # one learning rate per member
    >>> step = make_ensemble_step(models[0], cross_entropy, opts, shared_batch=True, batching="unroll")
    >>> state = init_ensemble_state(models, opts)
    >>> new = step(state, [{"input": torch.ones(5, 3), "labels": torch.zeros(5, dtype=torch.long)}])
    >>> [torch.equal(new.params["weight"][m], state.params["weight"][m]) for m in range(2)]
    [True, False]
    >>> new.metrics["learning_rate"].tolist()
    [0.0, 0.1]
    """
    if optimizer is None:
        raise TypeError("make_ensemble_step needs an optimizer, e.g. optimizer=trainfold.adamw(1e-3)")
    refuse_sharded(model)
    loss = default_loss_for(model) if loss is None else loss
    optimizers = [optimizer] if isinstance(optimizer, GradientTransformation) else list(optimizer)
    bad = [o for o in optimizers if not isinstance(o, GradientTransformation)]
    if bad:
        raise TypeError(f"optimizer must be a transformation (e.g. trainfold.adamw(1e-3)) or one per member; got {bad}")
    opts = tuple(optimizers)
    if batching not in ("vmap", "unroll"):
        raise ValueError(f"batching must be 'vmap' or 'unroll', got {batching!r}")
    counter = count_items or _counter(loss, label_key)
    plan = _EnsemblePlan(model, loss, counter, label_key, shared_batch, batching == "unroll", opts, collective)
    return with_donation(_compiled(plan, compile) if compile else _eager(plan))


def _eager(plan: _EnsemblePlan) -> Callable[[TrainState, Batch, bool], TrainState]:
    return lambda state, batch, donate: _run(plan, _grads, state, batch, donate)


def _compiled(plan: _EnsemblePlan, compile: bool | str) -> Callable[[TrainState, Batch, bool], TrainState]:
    """Return ``run(state, batch, donate)`` under ``torch.compile``, eager (with a warning) once compiling failed."""
    backend = compile if isinstance(compile, str) else "inductor"
    grads_fn = torch.compile(fresh_function(_grads), backend=backend, fullgraph=True)
    eager = _eager(plan)
    failed: list[str] = []

    def run(state: TrainState, batch: Batch, donate: bool) -> TrainState:
        if failed:
            return eager(state, batch, donate)
        try:
            with torch._dynamo.config.patch(trace_autograd_ops=True):
                return _run(plan, grads_fn, state, batch, donate)
        except (ValueError, KeyError):
            raise
        except Exception as err:
            result = eager(state, batch, donate)
            failed.append(f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:500]}")
            warnings.warn(
                f"make_ensemble_step(compile=True): compiling failed ({failed[0]}); running eagerly instead",
                CompileFallbackWarning,
                stacklevel=2,
            )
            return result

    return run


def _counter(loss: Callable[..., Tensor], label_key: str) -> Callable[[Mapping[str, Tensor]], Tensor]:
    count_labels = counter_for(loss)

    def count(micro: Mapping[str, Tensor]) -> Tensor:
        if label_key not in micro:
            raise KeyError(f"micro-batch has no {label_key!r} key (keys: {sorted(micro)}); pass label_key=")
        return count_labels(micro[label_key])

    return count


def _run(
    plan: _EnsemblePlan,
    grads_fn: Callable[..., Any],
    state: TrainState,
    batch: Batch,
    donate: bool = False,
) -> TrainState:
    k = ensemble_size(state)
    if len(batch) == 0:
        raise ValueError("a step's batch must hold at least one micro-batch")
    opts = _member_optimizers(plan.optimizers, k)
    _check_batch(batch, k, plan.shared)
    cursor = getattr(batch, "cursor", state.cursor)
    num_items = items_in_batch(_member_counter(plan, k), batch, plan.collective)  # (K,): each member's count
    active = num_items > 0
    if not bool(active.any()):  # every member's step counts, none learns (as make_step's empty step)
        warn_no_items(int(state.step.max()))
        idle = {"loss": torch.full((k,), float("nan")), "grad_norm": torch.zeros(k), "num_items": num_items.float()}
        return advanced(state, idle, cursor=cursor)
    device = next(iter(state.params.values())).device
    buffers = dict(state.buffers) if donate else {name: v.clone() for name, v in state.buffers.items()}
    n_dev = num_items.to(device)

    def micro(mb: Mapping[str, Tensor], key: torch.Generator) -> tuple[Tensor, Mapping[str, Tensor], list[Tensor]]:
        try:
            losses, g = grads_fn(plan, k, state.params, buffers, dict(mb), n_dev)
        except RuntimeError as err:
            better = _vmap_error(err, plan.model)
            if better is None:
                raise
            raise better from err
        return losses, {}, g

    rank = plan.collective.rank if plan.collective is not None else None
    seeds = [int(s) for s in state.seed]
    with train_mode(plan.model, True):
        sums = accumulate(micro, batch, seeds, int(state.step.max()), rank, device, loss_shape=(k,))
    assert sums.grads is not None
    grads = cast(list[Tensor], sums.grads)  # the member micro-step zero-fills unused gradients: none is None
    sum_over_ranks(plan.collective, [*grads, sums.loss])
    return _updated(opts, state, buffers, grads, sums.loss, num_items, cursor, donate)


def _member_counter(plan: _EnsemblePlan, k: int) -> Callable[[Mapping[str, Tensor]], Tensor]:
    def count(micro: Mapping[str, Tensor]) -> Tensor:
        return torch.stack([item_count(plan.count_items(_select(micro, m, plan.shared))) for m in range(k)])

    return count


def _member_optimizers(opts: Sequence[GradientTransformation], k: int) -> list[GradientTransformation]:
    if len(opts) == 1:
        return list(opts) * k
    if len(opts) != k:
        raise ValueError(f"the step has {len(opts)} optimizers but the state has {k} members")
    return list(opts)


def _updated(
    opts: list[GradientTransformation],
    state: TrainState,
    buffers: dict[str, Tensor],
    grads: list[Tensor],
    total: Tensor,
    num_items: Tensor,
    cursor: Any,
    donate: bool,
) -> TrainState:
    """Apply each member's optimizer to its slice and return the next ensemble state with its metrics.

    A member without items learns nothing (params and optimizer state kept) but its step counts; its loss is NaN.
    """
    keys = list(state.params)
    active = (num_items > 0).tolist()
    params, opt_states, norms, rates = [], [], [], []
    with torch.no_grad():
        for m, opt in enumerate(opts):
            member = {n: state.params[n][m] for n in keys}
            member_grads = {n: g[m] for n, g in zip(keys, grads)}
            member_state = map_tensors(lambda t, m=m: t[m], state.opt_state)
            norms.append(global_norm(member_grads).detach().float().cpu() if active[m] else torch.tensor(0.0))
            rates.append(opt.learning_rate(member_state))
            if active[m]:
                member, member_state = opt.apply(member_grads, member_state, member)
            params.append(member)
            opt_states.append(member_state)
        new_params = {n: torch.stack([p[n] for p in params]) for n in keys}
        opt_state = map_tensors(lambda *ts: torch.stack(ts), opt_states[0], *opt_states[1:])
        if donate:  # the new values go into the donated state's stacked tensors
            new_params, opt_state = overwrite(state.params, new_params), overwrite(state.opt_state, opt_state)
    fresh = {
        "loss": torch.where(torch.tensor(active), total.cpu(), torch.tensor(float("nan"))),
        "grad_norm": torch.stack(norms),
        "learning_rate": torch.tensor(rates, dtype=torch.float64),
        "num_items": num_items.float(),
    }
    return advanced(state, fresh, params=new_params, buffers=buffers, opt_state=opt_state, cursor=cursor)


def _check_batch(batch: Batch, k: int, shared: bool) -> None:
    if shared:
        return
    bad = sorted(
        {f"{key}: {tuple(v.shape)}" for mb in batch for key, v in mb.items() if v.dim() == 0 or v.shape[0] != k}
    )
    if bad:
        raise ValueError(
            f"ensemble micro-batches need a leading member axis of size {k}; got {bad}. "
            "Stack the members' batches with stack_batches, or pass shared_batch=True to give all members the same data"
        )
