"""The micro-batch driver every step variant composes: count, seed, accumulate, reduce, and the next state.

A step's ``batch`` is one optimizer step's worth of data: a sequence of micro-batches (dicts of
tensors). Every variant (``eager``, ``compiled``, ``differentiable``, ``ensemble.stack``) runs the
same pieces, in this order:

1. :func:`open_step` counts ``num_items_in_batch`` over all micro-batches and all ranks before the
   first forward pass (:func:`trainfold.core.collective.items_in_batch`); a step without items is
   finished there (:func:`empty_step`);
2. :func:`accumulate` runs a variant's ``micro(micro_batch, key) -> (loss, aux, grads)`` on each
   micro-batch, with the default generators seeded from ``(seed, step, micro, rank)``
   (:func:`micro_seed`), and adds up the losses, the ``aux`` metrics and the gradients;
3. :func:`sum_over_ranks` sums what a rank holds over all ranks;
4. :func:`next_state` (over :func:`advanced`) returns the state with the step's metrics,
   ``loss_total`` and ``nonfinite_losses``.

Each micro-batch's loss is its summed loss divided by the global count, so the sum over
micro-batches (and ranks) is the mean over the whole step, whatever the split.

>>> import torch
>>> micro = lambda mb, key: (mb["x"].sum(), {}, [mb["x"] * 2])     # loss, aux, fresh gradients
>>> sums = accumulate(micro, [{"x": torch.ones(2)}] * 3, (0,), 0, 0, torch.device("cpu"))
>>> sums.loss.item(), sums.grads[0].tolist()
(6.0, [6.0, 6.0])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.collective import Collective, item_count, items_in_batch
from trainfold.core.forward import Batch, Forward
from trainfold.core.losses import MICRO_BATCH, aux_reduction_of, count_key, loss_and_metrics, warn_no_items
from trainfold.core.rng import derive_seed, private_rng
from trainfold.core.state import TrainState, check_live, invalidate, refuse_vmapped
from trainfold.step.plan import StepPlan

__all__ = [
    "MicroStep",
    "StepStart",
    "Sums",
    "accumulate",
    "accumulate_step",
    "advanced",
    "aux_weights",
    "batch_items",
    "empty_step",
    "materialized",
    "micro_loss",
    "micro_batch_means",
    "micro_seed",
    "next_state",
    "no_gradient_error",
    "open_step",
    "sum_over_ranks",
    "summed_grads",
    "with_donation",
]

# micro(micro_batch, key) -> (loss, aux, grads): grads None when the variant accumulates them itself (into .grad)
MicroStep = Callable[
    [Mapping[str, Tensor], torch.Generator], tuple[Tensor, Mapping[str, Tensor], Sequence[Tensor | None] | None]
]


# -- before the first forward pass ----------------------------------------------------------------------------


@attrs.frozen(eq=False)
class StepStart:
    """What a step knows before its first forward pass: the cursor after it, its number, its item count."""

    cursor: Any
    number: int
    num_items: Tensor


def batch_items(plan: StepPlan, batch: Batch) -> Tensor:
    """Return the step's ``num_items_in_batch``: ``plan.count_items`` over its micro-batches and every rank."""
    return items_in_batch(lambda micro: item_count(plan.count_items(micro)), batch, plan.collective)


def open_step(plan: StepPlan, state: TrainState, batch: Batch) -> tuple[StepStart, TrainState | None]:
    """Return the step's :class:`StepStart` and ``done``: the finished state of a step with no labelled items
    (:func:`empty_step`), else ``None``. Every step variant starts here."""
    if len(batch) == 0:
        raise ValueError("a step's batch must hold at least one micro-batch")
    refuse_vmapped(state)
    start = StepStart(getattr(batch, "cursor", state.cursor), int(state.step), batch_items(plan, batch))
    if int(start.num_items) == 0:
        warn_no_items(start.number)
        return start, empty_step(plan, state, start)
    return start, None


def empty_step(plan: StepPlan, state: TrainState, start: StepStart) -> TrainState:
    """Return the state after a step with no labelled items: the step and cursor advance, nothing is learned.

    Params, buffers and optimizer state are unchanged; the step's loss is NaN (0 items: no mean),
    so ``state.nonfinite_losses`` counts it and logging windows leave it out of their mean.
    """
    return next_state(plan, state, start, Sums(torch.tensor(float("nan")), {}), torch.zeros(()))


# -- the micro-batches ----------------------------------------------------------------------------------------


def micro_seed(seeds: Sequence[int], step: int, micro: int, rank: int | None) -> int:
    """Return the seed of micro-batch ``micro`` of step ``step`` on ``rank`` (``None``: a step without ranks).

    >>> micro_seed((0,), 3, 1, 0) == micro_seed((0,), 3, 1, 0), micro_seed((0,), 3, 1, 0) == micro_seed((0,), 3, 1, 1)
    (True, False)
    """
    return derive_seed(*seeds, step, micro) if rank is None else derive_seed(*seeds, step, micro, rank)


@attrs.define(eq=False)
class Sums:
    """What a step's micro-batches add up to: the loss, the ``aux`` metrics and the gradients (``None``: kept
    in ``.grad`` by the variant)."""

    loss: Tensor
    aux: dict[str, Tensor]
    grads: list[Tensor | None] | None = None


def accumulate(
    micro: MicroStep,
    batch: Batch,
    seeds: Sequence[int],
    step: int,
    rank: int | None,
    device: torch.device,
    *,
    key: torch.Generator | None = None,
    loss_shape: tuple[int, ...] = (),
    aux_weights: Sequence[float] | None = None,
    per_micro_batch: bool = False,
) -> Sums:
    """Run ``micro(micro_batch, key)`` over ``batch`` and return the :class:`Sums` of what it returns.

    Before each micro-batch the default generators of ``device`` are seeded from
    :func:`micro_seed` (and restored afterwards), and the objective's ``key`` is seeded from it too
    (``key``: one generator reseeded each time; ``None``: a fresh one). Losses and ``aux`` values are
    summed as float32, detached, each micro-batch's ``aux`` times its ``aux_weights`` entry when given
    (:func:`aux_weights`: a mean); gradients with :func:`summed_grads` (into the first micro-batch's, so
    ``micro`` returns gradients it owns). ``per_micro_batch`` (``aux_reduction = "micro_batch"``): each ``aux``
    value is the mean of the micro-batches' values (those whose :func:`~trainfold.core.losses.count_key` entry is
    not 0), with that count under its ``count_key`` (:func:`micro_batch_means`).
    """
    sums = Sums(torch.zeros(loss_shape, dtype=torch.float32, device=device), {})
    if per_micro_batch:
        micro = _counting(micro)
    with private_rng(device) as generators:
        for i, mb in enumerate(batch):
            seed = micro_seed(seeds, step, i, rank)
            for gen in generators:
                gen.manual_seed(seed)
            k = torch.Generator(device=device) if key is None else key
            loss, aux, grads = micro(mb, k.manual_seed(seed ^ 1))
            if grads is not None:
                sums.grads = summed_grads(sums.grads, grads)
            sums.loss += loss.detach().float()
            weight = 1.0 if aux_weights is None else aux_weights[i]
            for name, value in aux.items():
                sums.aux[name] = sums.aux.get(name, 0) + value.detach().float() * weight
    if per_micro_batch:
        sums.aux = micro_batch_means(sums.aux)
    return sums


def _counting(micro: MicroStep) -> MicroStep:
    # Each value's share of its metric (0 where the micro-batch's count_key says 0), and the count summed beside it.
    def counted(mb: Mapping[str, Tensor], key: torch.Generator) -> Any:
        loss, aux, grads = micro(mb, key)
        out = {}
        for name, value in aux.items():
            if name.endswith(count_key("")):
                continue
            n = torch.as_tensor(aux.get(count_key(name), 1.0), dtype=torch.float32, device=value.device)
            out[name] = torch.where(n > 0, value.detach().float(), 0.0) * n
            out[count_key(name)] = n
        return loss, out, grads

    return counted


def micro_batch_means(sums: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return the means of ``{name: sum, count_key(name): count}`` (NaN for a count of 0), with their counts.

    >>> micro_batch_means({"a": torch.tensor(3.0), "a#micro_batches": torch.tensor(2.0)})["a"].item()
    1.5
    """
    return {
        name: value if name.endswith(count_key("")) else value / sums[count_key(name)] for name, value in sums.items()
    }


def accumulate_step(
    plan: StepPlan,
    state: TrainState,
    start: StepStart,
    micro: MicroStep,
    batch: Batch,
    device: torch.device,
    *,
    key: torch.Generator | None = None,
) -> Sums:
    """Return :func:`accumulate` of ``micro`` over the step's ``batch``, seeded from ``state.seed``, the step's
    number and this rank, each micro-batch's ``aux`` weighted by :func:`aux_weights` (every step variant's call).
    """
    rank = plan.collective.rank if plan.collective is not None else 0
    weights, counted = aux_weights(plan, batch), aux_reduction_of(plan.objective, plan.loss) == MICRO_BATCH
    seeds, number = (int(state.seed),), start.number
    return accumulate(micro, batch, seeds, number, rank, device, key=key, aux_weights=weights, per_micro_batch=counted)


def aux_weights(plan: StepPlan, batch: Batch) -> list[float] | None:
    """Return the weight of each micro-batch's ``aux`` metrics in the step's: its share of the step's items on
    this rank (``plan.count_items``), or ``None`` (summed) where they are shares of the step's value already.

    An objective's ``aux`` values are its micro-batch's means (``aux_reduction = "mean"``, the default): the step
    reports their mean weighted by items, the exact mean over the step of a metric per item (the plain mean of
    micro-batches of equally many items). An objective with ``aux_reduction = "sum"`` (the built-in DPO and GRPO
    objectives) divides its ``aux`` as its loss, by ``num_items_in_batch``: they are summed, as the loss is; so are
    a loss's own ``metrics``. With ``aux_reduction = "micro_batch"`` (``sft.sft_loss``, the KTO objective) they are
    each micro-batch's own values: :func:`accumulate` averages them unweighted (``per_micro_batch``).

    >>> from trainfold.optim import sgd
    >>> from trainfold.step.plan import step_plan
    >>> plan = step_plan(torch.nn.Linear(1, 1), optimizer=sgd(0.1), objective=lambda *a: None)
    >>> aux_weights(plan, [{"labels": torch.tensor([1, 2, 3])}, {"labels": torch.tensor([4, -100])}])
    [0.75, 0.25]
    """
    if aux_reduction_of(plan.objective, plan.loss) != "mean":
        return None
    counts = [float(item_count(plan.count_items(mb))) for mb in batch]
    total = sum(counts)
    return [c / total for c in counts] if total > 0 else [1 / len(counts)] * len(counts)


def micro_loss(
    plan: StepPlan,
    forward: Forward,
    leaves: dict[str, Tensor],
    micro: Mapping[str, Tensor],
    num_items: Tensor,
    key: torch.Generator,
) -> tuple[Tensor, Mapping[str, Tensor]]:
    """Return ``(loss, aux)`` of one micro-batch: the plan's objective, else its loss on the model's outputs (``aux``
    from the loss's ``metrics(outputs, labels, num_items)`` when it has one: ``sft.sft_loss``'s)."""
    if plan.objective is not None:
        return plan.objective(forward, leaves, micro, num_items, key)
    if plan.label_key not in micro:
        raise KeyError(
            f"micro-batch has no {plan.label_key!r} key (keys: {sorted(micro)}); the collator must provide "
            f"labels, or pass label_key= to make_step, or an objective that needs none"
        )
    inputs, labels = {k: v for k, v in micro.items() if k != plan.label_key}, micro[plan.label_key]
    return loss_and_metrics(plan.loss, forward(leaves, inputs), labels, num_items)


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
    torch._foreach_add_([g for g in grads if g is not None], [g for g in new if g is not None])  # none is None
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


def no_gradient_error(model: nn.Module, step: int) -> RuntimeError:
    """Return the error for a step in which no trainable parameter received a gradient."""
    return RuntimeError(
        f"no trainable parameter of {type(model).__name__} received a gradient in step {step}: the loss does not "
        "depend on the tensors the step swaps into the model. Likely causes: the model keeps its parameters where "
        "the step cannot see them (FSDP/fully_shard or DTensor parameters, a wrapper holding copies, tensors "
        "stored as plain attributes instead of nn.Parameter), the loss or objective detaches the outputs or runs "
        "under torch.no_grad, or every parameter the forward uses is frozen (requires_grad=False)"
    )


def sum_over_ranks(collective: Collective | None, tensors: list[Tensor]) -> None:
    """Replace each of ``tensors`` by its sum over all ranks (nothing to do without a collective)."""
    if collective is not None:
        collective.sum_(tensors)


# -- after the update -----------------------------------------------------------------------------------------


def next_state(
    plan: StepPlan,
    state: TrainState,
    start: StepStart,
    sums: Sums,
    grad_norm: Tensor,
    learning_rate: float | None = None,
    **fields: Any,
) -> TrainState:
    """Return the state after one update, with the step's metrics (shared by every step flavour): the cursor and
    item count of ``start``, the loss and ``aux`` of ``sums``, ``fields`` (the ``params``, ``buffers`` and
    ``opt_state`` the update made; a field not given stays ``state``'s) replaced.

    ``learning_rate`` is the rate the update used (default: read from ``state.opt_state``).
    """
    if learning_rate is None:
        learning_rate = plan.optimizer.learning_rate(state.opt_state)
    metrics = {
        "loss": sums.loss.detach().cpu(),
        "grad_norm": grad_norm.detach().float().cpu(),
        "learning_rate": torch.tensor(learning_rate, dtype=torch.float64),
        "num_items": start.num_items.float(),
        **{k: v.detach().cpu() for k, v in sums.aux.items()},
    }
    return advanced(state, metrics, cursor=start.cursor, **fields)


def advanced(state: TrainState, metrics: Mapping[str, Tensor], **fields: Any) -> TrainState:
    """Return ``state`` one step on: ``fields`` replaced, ``metrics`` merged in, and ``metrics["loss"]`` added to
    ``loss_total`` where finite, else counted in ``nonfinite_losses``.

    >>> import torch
    >>> from trainfold.core.state import TrainState
    >>> s = advanced(TrainState(params={}, buffers={}, opt_state=None), {"loss": torch.tensor(float("nan"))})
    >>> s.step.item(), s.loss_total.item(), s.nonfinite_losses.item()
    (1, 0.0, 1)
    """
    finite = torch.isfinite(metrics["loss"])
    return attrs.evolve(
        state,
        **fields,
        step=state.step + 1,
        metrics={**state.metrics, **metrics},
        loss_total=state.loss_total + torch.where(finite, metrics["loss"].double(), 0.0),
        nonfinite_losses=state.nonfinite_losses + (~finite).long(),
    )


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
