"""``make_step`` builds the pure training step ``step(state, batch) -> state``.

``batch`` is one optimizer step's worth of data: a sequence of micro-batches (dicts of tensors).
Gradient accumulation happens inside the step: ``num_items_in_batch`` is counted over all
micro-batches (and all ranks) before the first forward pass, each micro-batch's loss is its
summed loss divided by that count, and the gradients of the micro-batches are added. So the
update is the same whatever the split of the same samples.

The step never changes the state it is given, nor the model, unless the caller *donates* the state
(``step(state, batch, donate=True)``, or ``step.donating``; ``fit`` does): then params, buffers and
optimizer state are updated in place with the fused kernels, the returned state holds the same
tensors, and the donated record raises ``DonatedStateError`` on any later use. Donated or not, the
results are bitwise equal. The model only supplies its forward function, called on the state's
tensors (swapped in for the duration of the step, as ``torch.func.functional_call`` does, and
swapped back even if the step raises — so one module must not serve two steps running at the same
time in different threads).
Every random draw (dropout, noise) comes from a seed derived from ``(seed, step, micro, rank)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module  # what functional_call uses

from trainfold.core.collective import Collective
from trainfold.core.forward import Batch, Forward, Objective, make_forward, train_mode, training_flags
from trainfold.core.losses import counter_for, default_loss_for, warn_no_items
from trainfold.core.rng import derive_seed, private_rng
from trainfold.core.state import TrainState, check_live, invalidate
from trainfold.core.tree import global_norm
from trainfold.optim import GradientTransformation
from trainfold.step.amp import SCALER, LossScaling, ScalerState, unscale_, updated
from trainfold.step.recompute import cache_configs, cache_off, recomputing

__all__ = [
    "make_step",
    "make_forward",
    "derive_seed",
    "Collective",
    "train_mode",
    "Objective",
    "refuse_sharded",
    "no_gradient_error",
    "summed_grads",
    "materialized",
    "empty_step",
    "with_donation",
]


class _Slots:
    """Where a module keeps each of its named tensors, found once and reused while the tree is unchanged.

    ``functional_call`` walks the module tree to find every slot on each call (about 0.3 ms on a
    two-layer Llama); a step swaps the same names in every time, so the walk is cached here and
    redone only when the module list or any module's parameter or buffer count changes.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 1)
    >>> slots, buffers = _Slots(lin), {}
    >>> params = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
    >>> with slots.bound(list(lin.modules()), params, buffers) as forward:
    ...     forward(params, {"input": torch.ones(1, 2)}).item()
    2.0
    >>> lin.weight is params["weight"]                   # swapped back afterwards
    False
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules: list[nn.Module] = []  # held, so that the ids in ``key`` stay theirs
        self.key: list[tuple[int, int, int]] = []
        self.names: frozenset[str] = frozenset()
        self.places: list[tuple[str, dict[str, Any], str]] = []  # (name, the module's slot dict, attribute)

    def _find(self, modules: list[nn.Module], key: list[tuple[int, int, int]]) -> None:
        canonical = {id(t): n for n, t in self.model.named_parameters()}
        canonical.update({id(t): n for n, t in self.model.named_buffers()})
        places = []
        for module in modules:  # a module reachable twice holds its slots once
            for slots in (module._parameters, module._buffers):
                places += [(canonical[id(t)], slots, a) for a, t in slots.items() if t is not None]
        self.modules, self.key, self.places, self.names = modules, key, places, frozenset(canonical.values())

    @contextlib.contextmanager
    def bound(
        self, modules: list[nn.Module], params: dict[str, Tensor], buffers: dict[str, Tensor]
    ) -> Iterator[Forward]:
        """Yield ``forward(params, inputs)`` with ``params`` and ``buffers`` swapped in for the duration.

        Other params (a frozen reference, say) go through ``functional_call``. A buffer the module
        reassigns (rather than updates in place) is written back into ``buffers``.
        """
        other = make_forward(self.model, buffers)

        def forward(p: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Any:
            return self.model(**inputs) if p is params else other(p, inputs)

        key = [(id(m), len(m._parameters), len(m._buffers)) for m in modules]
        if key != self.key:
            self._find(modules, key)
        if self.names != params.keys() | buffers.keys():  # alias names or a mismatch: functional_call's rules
            with _reparametrize_module(self.model, {**params, **buffers}, tie_weights=True, strict=True):
                yield forward
            return
        saved = []
        try:
            for name, slots, attr in self.places:  # frozen parameters travel with the buffers
                saved.append(slots[attr])
                slots[attr] = params[name] if name in params else buffers[name]
            yield forward
        finally:
            for (name, slots, attr), old in zip(reversed(self.places[: len(saved)]), reversed(saved)):
                if name in buffers and slots[attr] is not buffers[name]:
                    buffers[name] = slots[attr]
                slots[attr] = old


@attrs.frozen
class _Plan:
    """The configuration a step closes over."""

    model: nn.Module
    optimizer: GradientTransformation
    loss: Callable[..., Tensor]
    objective: Objective | None
    count_items: Callable[[Mapping[str, Tensor]], Tensor]
    label_key: str
    collective: Collective | None
    autocast: torch.dtype | None
    recompute: int = 0  # 0: off; n: checkpoint every n-th block
    loss_scaling: LossScaling | None = None
    cache_configs: tuple[Any, ...] = ()  # configs whose KV cache the step turns off (recompute.cache_off)
    slots: _Slots = attrs.field(default=attrs.Factory(lambda plan: _Slots(plan.model), takes_self=True))


def _default_counter(
    loss: Callable[..., Tensor], objective: Any, label_key: str
) -> Callable[[Mapping[str, Tensor]], Tensor]:
    if objective is not None and hasattr(objective, "count_items"):
        return objective.count_items
    count_labels = counter_for(loss)

    def count(micro: Mapping[str, Tensor]) -> Tensor:
        if label_key in micro:
            return count_labels(micro[label_key])
        first = next(iter(micro.values()))
        return torch.tensor(first.shape[0])

    return count


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
) -> Callable[[TrainState, Batch], TrainState]:
    """Return ``step(state, batch) -> state`` for ``model``.

    ``loss(outputs, labels, num_items_in_batch)`` scores the model's outputs (default: the loss of
    the model's task, ``losses.default_loss_for``); the labels are
    taken out of each micro-batch (``label_key``) before the forward pass. To replace the forward
    pass and loss together, pass ``objective(forward, params, micro_batch, num_items, key) ->
    (loss, aux)``; ``aux`` values are summed over micro-batches into ``state.metrics``, so scale
    them like the loss. ``count_items(micro_batch)`` counts a micro-batch's items (default: the
    loss's ``count_items`` on the labels). ``collective`` sums counts and gradients across ranks.
    ``compile=True`` runs the step under ``torch.compile`` (a string or callable picks the backend,
    ``compile_mode`` the mode);
    where that cannot work it warns and stays eager (``trainfold.step.compiled``).
    ``gradient_checkpointing=True`` recomputes each transformer block in the backward pass instead
    of keeping its activations (``trainfold.step.recompute``; same gradients, about one more forward);
    an int ``n`` checkpoints every n-th block. ``loss_scaling`` (with ``autocast=torch.float16``)
    scales the loss dynamically, skipping updates whose gradients overflow (``trainfold.step.amp``; the
    scaler lives in ``state.extras[amp.SCALER]``). ``sharding`` (a ``DeviceMesh``, ``trainfold.step.sharded.Sharding``
    or ``"full_shard"``) steps a state of ``trainfold.step.sharded.shard_state``: params and optimizer state as DTensor
    shards, gathered one block at a time (``trainfold.step.sharded``).
    scaler lives in ``state.extras[amp.SCALER]``).
    ``step(state, batch, donate=True)`` (or ``step.donating(state, batch)``) donates ``state``: the
    update runs in place on its tensors (no second copy of params and optimizer state) and ``state``
    must not be used again (``DonatedStateError``); results are bitwise those of ``step(state, batch)``.

    >>> import torch
    >>> from trainfold.optim.base import sgd
    >>> from trainfold.core.state import init_state
    >>> from trainfold.core.losses import cross_entropy
    >>> model = torch.nn.Linear(3, 2)
    >>> step = make_step(model, cross_entropy, sgd(0.1))
    >>> state = init_state(model, sgd(0.1), seed=0)
    >>> batch = [{"input": torch.ones(4, 3), "labels": torch.tensor([0, 1, 1, 0])}]
    >>> step(state, batch).step.item()
    1
    """
    if optimizer is None:
        raise TypeError("make_step needs an optimizer, e.g. optimizer=trainfold.optim.base.adamw(1e-3)")
    refuse_sharded(model, dtensor_params=sharding is not None)
    if loss is None:
        loss = default_loss_for(model, defer=objective is not None)
    if gradient_checkpointing and compile:
        raise ValueError("gradient_checkpointing with compile is not supported yet; choose one of the two")
    if loss_scaling is not None and compile:
        raise ValueError("loss_scaling (fp16) with compile is not supported yet; use bf16 autocast, or the eager step")
    plan = _Plan(
        model=model,
        optimizer=optimizer,
        loss=loss,
        objective=objective,
        count_items=count_items or _default_counter(loss, objective, label_key),
        label_key=label_key,
        collective=collective,
        autocast=autocast,
        recompute=int(gradient_checkpointing),
        loss_scaling=loss_scaling,
        cache_configs=tuple(cache_configs(model.modules())),
    )

    step = with_donation(lambda state, batch, donate: _step(plan, state, batch, donate))
    if sharding is not None:
        from trainfold.step.sharded import make_sharded_step

        sharded_step = make_sharded_step(plan, sharding, compile=compile, compile_mode=compile_mode)
        return with_donation(lambda state, batch, donate: sharded_step(state, batch))  # fresh shards each step
    if compile:
        from trainfold.step.compiled import compile_step

        return compile_step(step, plan, backend="inductor" if compile is True else compile, mode=compile_mode)
    return step


def with_donation(run: Callable[[TrainState, Batch, bool], TrainState]) -> Callable[..., TrainState]:
    """Return ``step(state, batch, *, donate=False)`` over ``run(state, batch, donate)``, with ``step.donating``.

    A donated state is refused if it was donated before, and invalidated once ``run`` returns or
    raises (``run`` may have started writing into it).

    >>> from trainfold.core.state import TrainState, is_donated
    >>> step = with_donation(lambda state, batch, donate: state)
    >>> s = TrainState(params={}, buffers={}, opt_state=None)
    >>> _ = step(s, []); is_donated(s)
    False
    >>> _ = step.donating(s, []); is_donated(s)
    True
    """

    def step(state: TrainState, batch: Batch, *, donate: bool = False) -> TrainState:
        if not donate:
            return run(state, batch, False)
        check_live(state)
        number = int(state.step.max()) + 1  # an ensemble state counts per member
        try:
            return run(state, batch, True)
        finally:
            invalidate(state, number)

    def donating(state: TrainState, batch: Batch) -> TrainState:
        return step(state, batch, donate=True)

    step.donating = donating  # type: ignore[attr-defined]
    donating.donating = donating  # type: ignore[attr-defined]
    return step


def _sharded_kind(cls: type) -> str | None:
    names = {c.__name__ for c in cls.__mro__}
    if "FSDPModule" in names:
        return "an FSDP2 module (torch.distributed.fsdp.fully_shard)"
    if "FullyShardedDataParallel" in names:
        return "an FSDP module (FullyShardedDataParallel)"
    return None


def refuse_sharded(model: nn.Module, dtensor_params: bool = False) -> None:
    """Raise ``TypeError`` when ``model`` is FSDP-wrapped or (unless ``dtensor_params``) holds DTensor parameters.

    The step swaps its own tensors into the model's parameter slots; FSDP gathers its sharded
    parameters into other tensors for the forward pass, so the step would see no gradient and
    leave the parameters unchanged. trainfold shards the state itself (``trainfold.step.sharded``).

    >>> import torch
    >>> refuse_sharded(torch.nn.Linear(2, 2)) is None
    True
    """
    fix = (
        "trainfold shards the state itself: pass the unwrapped module with TrainingArguments(fsdp='full_shard') "
        "under torchrun, or make_step(..., sharding=trainfold.step.sharded.make_mesh()) on a state of "
        "trainfold.step.sharded.shard_state"
    )
    for name, module in model.named_modules():
        kind = _sharded_kind(type(module))
        if kind is not None:
            where = f"its submodule {name!r}" if name else "it"
            raise TypeError(f"cannot train {type(model).__name__}: {where} is {kind}; {fix}")
    for name, p in [] if dtensor_params else model.named_parameters():
        if any(c.__name__ == "DTensor" for c in type(p).__mro__):
            raise TypeError(
                f"cannot train {type(model).__name__}: parameter {name!r} is a DTensor "
                f"(sharded by torch.distributed.tensor); {fix}"
            )


def no_gradient_error(model: nn.Module, step: int) -> RuntimeError:
    """Return the error for a step in which no trainable parameter received a gradient."""
    return RuntimeError(
        f"no trainable parameter of {type(model).__name__} received a gradient in step {step}: the loss does not "
        "depend on the tensors the step swaps into the model. Likely causes: the model keeps its parameters where "
        "the step cannot see them (FSDP/fully_shard or DTensor parameters, a wrapper holding copies, tensors "
        "stored as plain attributes instead of nn.Parameter), the loss or objective detaches the outputs or runs "
        "under torch.no_grad, or every parameter the forward uses is frozen (requires_grad=False)"
    )


def summed_grads(grads: list[Tensor | None] | None, new: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Add a micro-batch's gradients (``None``: unused) into the running sum ``grads`` (changed in place).

    >>> import torch
    >>> summed_grads(summed_grads(None, [torch.ones(1), None]), [torch.ones(1), None])
    [tensor([2.]), None]
    """
    if grads is None:
        return list(new)
    if any(g is None for g in new) or any(g is None for g in grads):
        return [a if b is None else b if a is None else a.add_(b) for a, b in zip(grads, new)]
    torch._foreach_add_(grads, list(new))
    return grads


def materialized(grads: Sequence[Tensor | None], leaves: Sequence[Tensor], model: nn.Module, step: int) -> list[Tensor]:
    """Return ``grads`` with zeros for unused parameters; raise when no parameter received a gradient.

    >>> import torch
    >>> materialized([torch.ones(1), None], [torch.ones(1), torch.ones(2)], torch.nn.Identity(), 0)
    [tensor([1.]), tensor([0., 0.])]
    """
    if all(g is None for g in grads):
        raise no_gradient_error(model, step)
    # A gradient may be a broadcast view (d sum(w) / dw): give it its own memory, since clipping writes in place.
    return [
        torch.zeros_like(leaf) if g is None else g.clone() if torch._debug_has_internal_overlap(g) == 1 else g
        for g, leaf in zip(grads, leaves)
    ]


def empty_step(plan: _Plan, state: TrainState, cursor: Any, num_items: Tensor) -> TrainState:
    """Return the state after a step with no labelled items: the step and cursor advance, nothing is learned.

    Params, buffers and optimizer state are unchanged; the step's loss is NaN (0 items: no mean),
    so ``state.nonfinite_losses`` counts it and logging windows leave it out of their mean.
    """
    nan = torch.tensor(float("nan"))
    return next_state(
        plan, state, state.params, state.buffers, state.opt_state, cursor, nan, torch.zeros(()), num_items, {}
    )


def _count(plan: _Plan, batch: Batch) -> Tensor:
    """Count the step's items over its micro-batches and over every rank, before any forward pass."""
    counts = torch.stack([torch.as_tensor(plan.count_items(mb)).reshape(()).to(torch.int64).cpu() for mb in batch])
    num_items = counts.sum()
    if plan.collective is not None:
        plan.collective.sum_([num_items])
    return num_items


def _micro_loss(
    plan: _Plan,
    forward: Forward,
    leaves: dict[str, Tensor],
    micro: Mapping[str, Tensor],
    num_items: Tensor,
    key: torch.Generator,
) -> tuple[Tensor, Mapping[str, Tensor]]:
    if plan.objective is not None:
        return plan.objective(forward, leaves, micro, num_items, key)
    if plan.label_key not in micro:
        raise KeyError(
            f"micro-batch has no {plan.label_key!r} key (keys: {sorted(micro)}); the collator must provide "
            f"labels, or pass label_key= to make_step, or an objective that needs none"
        )
    inputs = {k: v for k, v in micro.items() if k != plan.label_key}
    outputs = forward(leaves, inputs)
    return plan.loss(outputs, micro[plan.label_key], num_items), {}


def open_step(plan: _Plan, state: TrainState, batch: Batch) -> tuple[Any, int, Tensor, TrainState | None]:
    """Return ``(cursor, step number, num_items, done)`` for a step's batch; ``done`` is the finished state of
    a step with no labelled items (:func:`empty_step`), else ``None``. Every step variant starts here."""
    if len(batch) == 0:
        raise ValueError("a step's batch must hold at least one micro-batch")
    cursor = getattr(batch, "cursor", state.cursor)
    step_no = int(state.step)
    num_items = _count(plan, batch)
    if int(num_items) == 0:
        warn_no_items(step_no)
        return cursor, step_no, num_items, empty_step(plan, state, cursor, num_items)
    return cursor, step_no, num_items, None


def _step(plan: _Plan, state: TrainState, batch: Batch, donate: bool = False) -> TrainState:
    cursor, step_no, num_items, done = open_step(plan, state, batch)
    if done is not None:
        return done

    rank = plan.collective.rank if plan.collective is not None else 0
    device = next(iter(state.params.values())).device
    keys = list(state.params)
    leaves = {k: state.params[k].detach().requires_grad_() for k in keys}
    leaf_list = [leaves[k] for k in keys]
    # running stats update copies; a donated state's own buffers are updated in place
    buffers = dict(state.buffers) if donate else {k: v.clone() for k, v in state.buffers.items()}
    n_dev = num_items.to(device)
    scaler = _scaler_of(plan, state)

    total = torch.zeros((), dtype=torch.float32, device=device)
    aux_total: dict[str, Tensor] = {}
    autocast = (
        torch.autocast(device.type, dtype=plan.autocast) if plan.autocast is not None else contextlib.nullcontext()
    )
    modules = list(plan.model.modules())
    recompute = (
        recomputing(plan.model, every=plan.recompute, modules=modules, configs=plan.cache_configs)
        if plan.recompute
        else contextlib.nullcontext()
    )
    with (
        training_flags(modules, True),
        private_rng(device) as generators,
        plan.slots.bound(modules, leaves, buffers) as forward,
        cache_off(plan.cache_configs),
        recompute,
    ):
        for i, micro in enumerate(batch):
            seed = derive_seed(int(state.seed), step_no, i, rank)
            for gen in generators:
                gen.manual_seed(seed)
            key = torch.Generator(device=device).manual_seed(seed ^ 1)
            with autocast:
                loss, aux = _micro_loss(plan, forward, leaves, micro, n_dev, key)
            scaled = loss if scaler is None else loss * scaler.scale.to(loss.device)
            if not scaled.requires_grad:
                raise no_gradient_error(plan.model, step_no)
            # each gradient is added into its leaf's .grad as backward produces it (as .backward() does), so a
            # second micro-batch never holds a whole second set of gradients
            torch.autograd.backward(scaled, inputs=leaf_list)
            total += loss.detach().float()
            for name, value in aux.items():
                aux_total[name] = aux_total.get(name, 0) + value.detach().float()

    grads = materialized([leaf.grad for leaf in leaf_list], leaf_list, plan.model, step_no)
    if plan.collective is not None:
        plan.collective.sum_([*grads, total])
    if scaler is not None:
        assert plan.loss_scaling is not None
        found_inf = unscale_(grads, scaler)
        state = attrs.evolve(state, extras={**state.extras, SCALER: updated(scaler, found_inf, plan.loss_scaling)})
    grad_tree = dict(zip(keys, grads))
    grad_norm = global_norm(grad_tree)
    if scaler is not None and bool(found_inf):  # overflow: skip the update, keep the params and optimizer state
        return next_state(
            plan, state, state.params, buffers, state.opt_state, cursor, total, grad_norm, num_items, aux_total
        )
    learning_rate = _learning_rate(plan, state)  # before a donated update reuses the state's tensors
    params, opt_state = plan.optimizer.apply_owned(
        grad_tree, state.opt_state, state.params, norm=grad_norm, donate=donate
    )
    return next_state(
        plan,
        state,
        {k: params[k].detach() for k in keys},
        buffers,
        opt_state,
        cursor,
        total,
        grad_norm,
        num_items,
        aux_total,
        learning_rate=learning_rate,
    )


def _learning_rate(plan: _Plan, state: TrainState) -> float:
    optimizer = plan.optimizer
    return optimizer.learning_rate(state.opt_state) if optimizer.learning_rate else float("nan")


def _scaler_of(plan: _Plan, state: TrainState) -> ScalerState | None:
    if plan.loss_scaling is None:
        return None
    scaler = state.extras.get(SCALER)
    if scaler is None:
        raise KeyError(
            f"loss_scaling needs the scaler in state.extras[{SCALER!r}]: "
            "init_state(..., extras={trainfold.step.amp.SCALER: trainfold.step.amp.initial_scaler(scaling)})"
        )
    return scaler


def next_state(
    plan: _Plan,
    state: TrainState,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    opt_state: Any,
    cursor: Any,
    loss: Tensor,
    grad_norm: Tensor,
    num_items: Tensor,
    aux: Mapping[str, Tensor],
    learning_rate: float | None = None,
) -> TrainState:
    """Return the state after one update, with the step's metrics (shared by every step flavour).

    ``learning_rate`` is the rate the update used (default: read from ``state.opt_state``).
    """
    if learning_rate is None:
        learning_rate = _learning_rate(plan, state)
    metrics = {
        **state.metrics,
        "loss": loss.detach().cpu(),
        "grad_norm": grad_norm.detach().float().cpu(),
        "learning_rate": torch.tensor(learning_rate, dtype=torch.float64),
        "num_items": num_items.float(),
        **{k: v.detach().cpu() for k, v in aux.items()},
    }
    finite = torch.isfinite(metrics["loss"])
    return attrs.evolve(
        state,
        params=params,
        buffers=buffers,
        opt_state=opt_state,
        step=state.step + 1,
        cursor=cursor,
        metrics=metrics,
        loss_total=state.loss_total + torch.where(finite, metrics["loss"].double(), 0.0),
        nonfinite_losses=state.nonfinite_losses + (~finite).long(),
    )
