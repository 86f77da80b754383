"""Train K copies of a model at once: one step over stacked parameters, vmapped forward pass.

An *ensemble state* is an ordinary ``TrainState`` whose tensors carry a leading member axis of
size K (params, buffers, optimizer state, ``step``, ``seed``, metrics, ``loss_total``); the
cursor is shared and ``extras`` are carried as they are. ``stack_ensemble`` builds one from K
ordinary states, ``split_ensemble`` gives them back, so an ensemble checkpoint splits into K
ordinary checkpoints that ``make_step`` continues.

The step runs the model's forward pass once for all members with ``torch.func.vmap`` over
``functional_call``, scores each member with the loss (outside vmap, so losses may check their
inputs), and takes all members' gradients with one ``torch.autograd.grad`` of the summed
losses (members share no parameter, so each gets exactly its own gradient). Clipping and AdamW
run element-wise on the stacked tensors, with per-member learning rates, weight decays and
bias corrections as broadcast tensors: no ``torch._foreach_*`` op, which vmap cannot batch.
Members may differ in initial weights, seeds and optimizer hyperparameters (pass one
optimizer per member).

Speed on CPU (``benchmarks/ensemble.py``): the matmuls of small models already keep the cores
busy, so an eager vmapped step is no faster than K sequential steps. Compiled, the step pays
off; ``batching="unroll"`` (all members' forward passes in one compiled graph, no vmap) was the
fastest there, and also serves models whose ops have no batching rule (CPU sdpa).

>>> import torch
>>> from trainfold import adamw
>>> from trainfold.core.losses import cross_entropy
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
from typing import Any

import attrs
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils import _pytree as pytree

from trainfold.core.forward import train_mode
from trainfold.core.losses import counter_for, default_loss_for, warn_no_items
from trainfold.core.rng import derive_seed, private_rng
from trainfold.core.state import TrainState, init_state
from trainfold.optim import AdamState, GradientTransformation, OptimizerPlan, adamw_update, optimizer_plan
from trainfold.step.compiled import CompileFallbackWarning, _fresh, traceable_loss
from trainfold.step.driver import no_gradient_error, refuse_sharded, with_donation

__all__ = [
    "ensemble_size",
    "init_ensemble_state",
    "make_ensemble_step",
    "split_ensemble",
    "stack_batches",
    "stack_ensemble",
]

Batch = Sequence[Mapping[str, Tensor]]
_STACKED = ("params", "buffers", "opt_state", "step", "seed", "metrics", "loss_total", "nonfinite_losses")


# -- states -----------------------------------------------------------------------------------------


def _map_tensors(fn: Callable[[list[Tensor]], Tensor], nodes: Sequence[Any], where: str) -> Any:
    """Rebuild the structure of ``nodes[0]`` with ``fn`` applied to the K tensors at each place."""
    first = nodes[0]
    if isinstance(first, Tensor):
        return fn(list(nodes))
    if first is None:
        return None
    if attrs.has(type(first)):
        return attrs.evolve(
            first,
            **{
                f.name: _map_tensors(fn, [getattr(n, f.name) for n in nodes], f"{where}.{f.name}")
                for f in attrs.fields(type(first))
                if f.init
            },
        )
    if isinstance(first, Mapping):
        for n in nodes[1:]:
            if list(n) != list(first):
                raise ValueError(f"ensemble members differ in the keys of {where}: {sorted(first)} vs {sorted(n)}")
        return {k: _map_tensors(fn, [n[k] for n in nodes], f"{where}.{k}") for k in first}
    if isinstance(first, (tuple, list)):
        items = [_map_tensors(fn, [n[i] for n in nodes], f"{where}.{i}") for i in range(len(first))]
        return type(first)(items)
    raise TypeError(f"cannot stack {type(first).__name__} at {where}: a state holds tensors, dicts, tuples, records")


def _stack(where: str) -> Callable[[list[Tensor]], Tensor]:
    def stack(tensors: list[Tensor]) -> Tensor:
        if any(any(c.__name__ == "DTensor" for c in type(t).__mro__) for t in tensors):
            raise TypeError(
                f"vmapped ensembles over DTensor shards are not supported ({where} is sharded; torch's "
                "vmap does not run on DTensors): stack full states (trainfold.step.sharded.gather_state), or "
                "train each member on its own with make_step(..., sharding=)"
            )
        shapes = {(tuple(t.shape), t.dtype) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(
                f"ensemble members differ in shape or dtype at {where}: {sorted(map(str, shapes))}; "
                "members must be copies of one architecture"
            )
        return torch.stack(tensors)

    return stack


def stack_ensemble(states: Sequence[TrainState]) -> TrainState:
    """Stack K ordinary states of one architecture into an ensemble state (inverse of ``split_ensemble``).

    >>> import torch
    >>> from trainfold import init_state, sgd
    >>> ens = stack_ensemble([init_state(torch.nn.Linear(2, 1), sgd(0.1), seed=s) for s in (3, 4)])
    >>> ens.params["weight"].shape, ens.seed.tolist()
    (torch.Size([2, 1, 2]), [3, 4])
    """
    if not states:
        raise ValueError("an ensemble needs at least one member state")
    cursors = {s.cursor.as_tuple() for s in states}
    if len(cursors) > 1:
        raise ValueError(f"ensemble members must share one data cursor, got {sorted(cursors)}")
    fields = {name: _map_tensors(_stack(name), [getattr(s, name) for s in states], name) for name in _STACKED}
    return attrs.evolve(states[0], **fields)


def split_ensemble(state: TrainState) -> list[TrainState]:
    """Return the K member states of an ensemble state, as ordinary ``TrainState`` records.

    Each member owns fresh tensors (nothing is shared with the ensemble or another member), so
    each can be checkpointed, or continued with ``make_step``, on its own.

    >>> import torch
    >>> from trainfold import adamw
    >>> ens = init_ensemble_state(torch.nn.Linear(2, 1), adamw(0.1), size=3)
    >>> [m.params["weight"].shape for m in split_ensemble(ens)][0], len(split_ensemble(ens))
    (torch.Size([1, 2]), 3)
    """
    size = ensemble_size(state)
    members = []
    for i in range(size):
        fields = {
            name: _map_tensors(lambda ts, i=i: ts[0][i].clone(), [getattr(state, name)], name) for name in _STACKED
        }
        cursor = attrs.evolve(state.cursor, epoch=state.cursor.epoch.clone(), position=state.cursor.position.clone())
        members.append(attrs.evolve(state, cursor=cursor, extras=dict(state.extras), **fields))
    return members


def ensemble_size(state: TrainState) -> int:
    """Return K, the number of members of an ensemble state.

    >>> import torch
    >>> from trainfold import sgd
    >>> ensemble_size(init_ensemble_state(torch.nn.Linear(2, 1), sgd(0.1), size=5))
    5
    """
    if state.step.dim() != 1:
        raise ValueError(
            f"not an ensemble state: step has shape {tuple(state.step.shape)}, expected (K,); "
            "build it with init_ensemble_state or stack_ensemble"
        )
    return int(state.step.shape[0])


def init_ensemble_state(
    models: nn.Module | Sequence[nn.Module],
    optimizer: GradientTransformation | Sequence[GradientTransformation],
    *,
    size: int | None = None,
    seeds: Sequence[int] | None = None,
) -> TrainState:
    """Return the first ensemble state: K members from K models (or ``size`` copies of one).

    ``optimizer`` is one optimizer for all members or one per member; ``seeds`` (default
    ``0..K-1``) seed each member's dropout as ``init_state(seed=...)`` would.

    >>> import torch
    >>> from trainfold import adamw
    >>> state = init_ensemble_state([torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)], adamw(0.1), seeds=[7, 9])
    >>> state.seed.tolist(), state.opt_state.count.tolist()
    ([7, 9], [0, 0])
    """
    if isinstance(models, nn.Module):
        if size is None or size < 1:
            raise ValueError(f"give size=K >= 1 to build K copies of one model (got size={size}), or a list of models")
        models = [models] * size
    models = list(models)
    k = len(models)
    if size is not None and size != k:
        raise ValueError(f"size={size} but {k} models were given; pass one or the other")
    optimizers = _per_member_optimizers(optimizer, k)
    seeds = list(range(k)) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != k:
        raise ValueError(f"got {len(seeds)} seeds for {k} members; give one seed per member")
    return stack_ensemble([init_state(m, o, seed=s) for m, o, s in zip(models, optimizers, seeds)])


def stack_batches(batches: Sequence[Batch]) -> Batch:
    """Stack K ordinary batches (one per member, same shapes) into one ensemble batch.

    >>> import torch
    >>> b = stack_batches([[{"x": torch.zeros(2, 3)}], [{"x": torch.ones(2, 3)}]])
    >>> len(b), b[0]["x"].shape
    (1, torch.Size([2, 2, 3]))
    """
    if not batches:
        raise ValueError("stack_batches needs one batch per member, got none")
    lengths = {len(b) for b in batches}
    if len(lengths) > 1:
        raise ValueError(f"member batches have different numbers of micro-batches: {sorted(lengths)}")
    return [{key: torch.stack([b[i][key] for b in batches]) for key in batches[0][i]} for i in range(len(batches[0]))]


def _per_member_optimizers(
    optimizer: GradientTransformation | Sequence[GradientTransformation], k: int
) -> list[GradientTransformation]:
    if isinstance(optimizer, GradientTransformation):
        return [optimizer] * k
    optimizers = list(optimizer)
    if len(optimizers) != k:
        raise ValueError(f"got {len(optimizers)} optimizers for {k} members; give one, or one per member")
    return optimizers


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


def _bcast(x: float | Tensor, like: Tensor) -> float | Tensor:
    return x.reshape((-1,) + (1,) * (like.dim() - 1)) if isinstance(x, Tensor) else x


def _update(
    clips: Sequence[float | Tensor],
    decay: list[float | Tensor],
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    lr: Tensor,
    step_size: Tensor,
    bc2_sqrt: Tensor,
    b1: float | Tensor,
    b2: float | Tensor,
    eps: float | Tensor,
    active: Tensor,
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """Clip per member and apply AdamW to stacked tensors; members not ``active`` keep their values."""

    def member_norm(gs: list[Tensor]) -> Tensor:
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.reshape(g.shape[0], -1).float(), dim=1) for g in gs]), dim=0
        )

    norm = member_norm(grads)
    for i, max_norm in enumerate(clips):
        coef = torch.clamp(max_norm / ((member_norm(grads) if i else norm) + 1e-6), max=1.0)
        grads = [g * _bcast(coef, g) for g in grads]
    new_p, new_mu, new_nu = [], [], []
    for p, g, m, v, wd in zip(params, grads, mu, nu, decay):
        (q,), (m2,), (v2,) = adamw_update(
            [p],
            [g],
            [m],
            [v],
            [_bcast(wd, p)],
            _bcast(lr, p),
            _bcast(step_size, p),
            _bcast(bc2_sqrt, p),
            _bcast(b1, p),
            _bcast(b2, p),
            _bcast(eps, p),
        )
        keep = _bcast(active, p)
        new_p.append(torch.where(keep, q, p))
        new_mu.append(torch.where(keep, m2, m))
        new_nu.append(torch.where(keep, v2, v))
    return norm, new_p, new_mu, new_nu


def _uniform(values: Sequence[float]) -> float | Tensor:
    """One float when all members agree, else a float32 (K,) tensor."""
    return float(values[0]) if len(set(values)) == 1 else torch.tensor(values, dtype=torch.float32)


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
) -> Callable[[TrainState, Batch], TrainState]:
    """Return ``step(ensemble_state, batch) -> ensemble_state`` training K members of ``model`` at once.

    Each tensor of each micro-batch has a leading member axis (``stack_batches`` builds it);
    with ``shared_batch=True`` every member sees the same, unstacked micro-batches. Member m's
    update equals ``make_step(model, loss, optimizer_m)`` on its own batch, up to float rounding.
    The optimizer (one, or one per member) must be ``adamw`` or ``chain(clip_by_global_norm, adamw)``.
    ``batching="vmap"`` runs one forward pass for all members (``torch.func.vmap``; every op
    needs a batching rule); ``"unroll"`` runs the members' forward passes one after another on
    views of the stacked tensors, which needs no batching rule and, under ``compile=True``, puts
    all members in one graph (on CPU the faster choice for small models; compile time grows with K).
    ``compile=True`` runs the ensemble's gradient and the update under ``torch.compile`` (a string
    names the compiler backend, e.g. ``"aot_eager"``); if compiling fails it warns with a
    ``CompileFallbackWarning`` and runs eagerly.
    Dropout masks are seeded from ``(seeds, step, micro)``: deterministic, but not the ones a
    member's own ``make_step`` would draw. ``step(state, batch, donate=True)`` (or ``step.donating``,
    which ``fit`` uses) writes the update into the donated state's stacked tensors, bitwise as the
    non-donating step, and invalidates that state.

    >>> import torch
    >>> from trainfold import adamw
    >>> from trainfold.core.losses import cross_entropy
    >>> models = [torch.nn.Linear(3, 2) for _ in range(2)]
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
    opts = [optimizer_plan(o) for o in optimizers]  # TypeError names an unsupported part
    if batching not in ("vmap", "unroll"):
        raise ValueError(f"batching must be 'vmap' or 'unroll', got {batching!r}")
    if len({len(o.clips) for o in opts}) > 1:
        raise ValueError("ensemble members' optimizers must all clip, or none; got chains of different lengths")
    plan = _EnsemblePlan(
        model=model,
        loss=loss,
        count_items=count_items or _counter(loss, label_key),
        label_key=label_key,
        shared=shared_batch,
        unroll=batching == "unroll",
    )
    grads_fn, update_fn, traced = _grads, _update, attrs.evolve(plan, loss=traceable_loss(loss))
    if compile:
        backend = compile if isinstance(compile, str) else "inductor"
        grads_fn = torch.compile(_fresh(_grads), backend=backend, fullgraph=True)
        update_fn = torch.compile(_fresh(_update), backend=backend, fullgraph=True)
    failed: list[str] = []

    def step(state: TrainState, batch: Batch, donate: bool) -> TrainState:
        if compile and not failed:
            try:
                with torch._dynamo.config.patch(trace_autograd_ops=True):
                    return _run(traced, opts, grads_fn, update_fn, state, batch, donate)
            except (ValueError, KeyError):
                raise
            except Exception as err:  # noqa: BLE001 - the eager path re-raises real input errors
                result = _run(plan, opts, _grads, _update, state, batch, donate)
                failed.append(f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:500]}")
                warnings.warn(
                    f"make_ensemble_step(compile=True): compiling failed ({failed[0]}); running eagerly instead",
                    CompileFallbackWarning,
                    stacklevel=2,
                )
                return result
        return _run(plan, opts, _grads, _update, state, batch, donate)

    return with_donation(step)


def _counter(loss: Callable[..., Tensor], label_key: str) -> Callable[[Mapping[str, Tensor]], Tensor]:
    count_labels = counter_for(loss)

    def count(micro: Mapping[str, Tensor]) -> Tensor:
        if label_key not in micro:
            raise KeyError(f"micro-batch has no {label_key!r} key (keys: {sorted(micro)}); pass label_key=")
        return count_labels(micro[label_key])

    return count


def _run(
    plan: _EnsemblePlan,
    opts: list[OptimizerPlan],
    grads_fn: Callable[..., Any],
    update_fn: Callable[..., Any],
    state: TrainState,
    batch: Batch,
    donate: bool = False,
) -> TrainState:
    k = ensemble_size(state)
    if len(batch) == 0:
        raise ValueError("a step's batch must hold at least one micro-batch")
    if len(opts) == 1:
        opts = opts * k
    elif len(opts) != k:
        raise ValueError(f"the step has {len(opts)} optimizers but the state has {k} members")
    _check_batch(batch, k, plan.shared)
    cursor = getattr(batch, "cursor", state.cursor)
    num_items = torch.stack(
        [
            torch.stack(
                [
                    torch.as_tensor(plan.count_items(_select(mb, m, plan.shared))).reshape(()).to(torch.int64).cpu()
                    for m in range(k)
                ]
            )
            for mb in batch
        ]
    ).sum(0)
    active = num_items > 0
    if not bool(active.any()):  # every member's step counts, none learns (as make_step's empty step)
        warn_no_items(int(state.step.max()))
        nan = torch.full((k,), float("nan"))
        metrics = {**state.metrics, "loss": nan, "grad_norm": torch.zeros(k), "num_items": num_items.float()}
        return attrs.evolve(
            state, step=state.step + 1, cursor=cursor, metrics=metrics, nonfinite_losses=state.nonfinite_losses + 1
        )
    keys = list(state.params)
    device = state.params[keys[0]].device
    buffers = dict(state.buffers) if donate else {name: v.clone() for name, v in state.buffers.items()}
    n_dev = num_items.to(device)
    step_no = int(state.step.max())
    seeds = [int(s) for s in state.seed]
    grads: list[Tensor] = []
    total = torch.zeros(k, dtype=torch.float32, device=device)
    with train_mode(plan.model, True), private_rng(device) as generators:
        for i, micro in enumerate(batch):
            seed = derive_seed(*seeds, step_no, i)
            for gen in generators:
                gen.manual_seed(seed)
            try:
                losses, g = grads_fn(plan, k, state.params, buffers, dict(micro), n_dev)
            except RuntimeError as err:
                better = _vmap_error(err, plan.model)
                if better is None:
                    raise
                raise better from err
            if grads:
                torch._foreach_add_(grads, g)
            else:
                grads = g
            total += losses
    adam = opts[0].adam_of(state.opt_state)
    counts = [int(c) for c in adam.count]
    scalars = [o.scalars(c) for o, c in zip(opts, counts)]
    lr, step_size, bc2_sqrt = (
        torch.tensor([s[j] for s in scalars], dtype=torch.float32, device=device) for j in range(3)
    )
    decays = [o.decay(state.params) for o in opts]
    decay = [_to(_uniform([d[name] for d in decays]), device) for name in keys]
    clips = [_to(_uniform([o.clips[j] for o in opts]), device) for j in range(len(opts[0].clips))]
    b1, b2, eps = (_to(_uniform([getattr(o, h) for o in opts]), device) for h in ("b1", "b2", "eps"))
    act = active.to(device)
    norm, new_p, mu, nu = update_fn(
        clips,
        decay,
        [state.params[n] for n in keys],
        grads,
        [adam.mu[n] for n in keys],
        [adam.nu[n] for n in keys],
        lr,
        step_size,
        bc2_sqrt,
        b1,
        b2,
        eps,
        act,
    )
    new_p, mu, nu = list(new_p), list(mu), list(nu)
    if donate:  # the new values go into the donated state's tensors, one at a time
        for olds, news in ((state.params, new_p), (adam.mu, mu), (adam.nu, nu)):
            for i, name in enumerate(keys):
                olds[name].copy_(news[i])
                news[i] = olds[name]
    rates = torch.tensor([s[0] for s in scalars], dtype=torch.float64)
    # A member without items learns nothing (params and moments kept) but its step counts; its loss is NaN.
    idle = torch.tensor(float("nan"))
    fresh = {
        "loss": torch.where(active, total.cpu(), idle),
        "grad_norm": torch.where(active, norm.detach().float().cpu(), 0.0),
        "learning_rate": rates,
        "num_items": num_items.float(),
    }
    metrics = {**state.metrics, **fresh}
    finite = torch.isfinite(fresh["loss"])
    new_adam = AdamState(adam.count + active.to(adam.count.dtype), dict(zip(keys, mu)), dict(zip(keys, nu)))
    return attrs.evolve(
        state,
        params=dict(zip(keys, new_p)),
        buffers=buffers,
        opt_state=opts[0].wrap(state.opt_state, new_adam),
        step=state.step + 1,
        cursor=cursor,
        metrics=metrics,
        loss_total=state.loss_total + torch.where(finite, fresh["loss"].double(), 0.0),
        nonfinite_losses=state.nonfinite_losses + (~finite).long(),
    )


def _to(x: float | Tensor, device: torch.device) -> float | Tensor:
    return x.to(device) if isinstance(x, Tensor) else x


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
