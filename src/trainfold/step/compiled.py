"""Run the pure step under ``torch.compile``: the same results as the eager step, faster.

``make_step(..., compile=True)`` hands its step to ``compile_step``. The step is split into two
compiled graphs, called from a thin eager driver that keeps every Python-level decision of the
eager step (counting ``num_items`` before the forward, seeding, the learning rate, metrics, the
cursor):

* the *micro-batch graph*: forward, loss and ``torch.autograd.grad`` over leaves made inside
  the graph (``p.detach().requires_grad_()``), one call per micro-batch. Accumulation steps
  reuse it, so compile time does not grow with the accumulation count;
* the *update graph*: pre-clip gradient norm, ``clip_by_global_norm`` and the element-wise
  AdamW update, fused by the compiler. Learning rate and bias corrections come in as 0-d
  tensors, so a schedule never triggers a recompile.

Gradients are summed (and all-reduced by a collective) between the two graphs, exactly as in
the eager step. A donated state (``step(state, batch, donate=True)``) is updated by a twin of the
update graph that writes the new params and moments into the state's own tensors. The optimizer
must be ``adamw(...)`` or ``chain(clip_by_global_norm(...), ..., adamw(...))``; for anything else,
or when ``torch.compile`` is unavailable or fails on the model or objective, the step warns with a
``CompileFallbackWarning`` naming the reason and runs eagerly.

Dropout inside a compiled graph draws from the compiler's own generator, seeded from the same
``(seed, step, micro, rank)`` seed as the eager step: it is deterministic and resumable, but its
masks differ from the eager step's.

>>> sorted(optimizer_plan(__import__("trainfold").adamw(1e-3)).clips)
[]
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from trainfold.core.forward import make_forward, train_mode
from trainfold.core.losses import IGNORE_INDEX, causal_lm, cross_entropy, logits_of
from trainfold.core.rng import derive_seed, private_rng
from trainfold.core.state import TrainState
from trainfold.optim import AdamState, OptimizerPlan, optimizer_plan
from trainfold.step.driver import _count, _micro_loss, _Plan, next_state, no_gradient_error, with_donation
from trainfold.step.recompute import cache_off

__all__ = ["CompileFallbackWarning", "compile_step"]

Step = Callable[[TrainState, Sequence[Mapping[str, Tensor]]], TrainState]


class CompileFallbackWarning(UserWarning):
    """``compile=True`` could not compile the step and runs the eager step instead.

    Turn the fallback into an error with ``warnings.simplefilter("error", CompileFallbackWarning)``.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("no compiler here", CompileFallbackWarning)
    >>> [(w.category.__name__, issubclass(w.category, UserWarning)) for w in caught]
    [('CompileFallbackWarning', True)]
    """


# -- losses that trace ----------------------------------------------------------------------------


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


# -- the compiled step ----------------------------------------------------------------------------


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Copy ``fn`` with its own code object, so its compiled graphs get their own cache."""
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _why_not(plan: _Plan) -> str | None:
    try:
        if not torch._dynamo.is_dynamo_supported():
            return "torch.compile is not supported on this Python or platform"
    except Exception as err:  # noqa: BLE001 - the reason is what matters
        return f"torch.compile is unavailable ({err})"
    try:
        optimizer_plan(plan.optimizer)
    except (TypeError, KeyError, AttributeError) as err:
        return f"optimizer: {err}"
    return None


def _fallback(reason: str) -> None:
    warnings.warn(
        f"make_step(compile=True): {reason}; running the eager step instead (same results, no compile speed-up)",
        CompileFallbackWarning,
        stacklevel=3,
    )


def compile_step(
    step: Step,
    plan: _Plan,
    *,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
) -> Step:
    """Return ``step`` running under ``torch.compile``; the eager ``step`` where it cannot.

    ``step`` and its configuration ``plan`` come from ``make_step`` (use ``make_step(..., compile=True)``).
    ``backend`` and ``mode`` go to ``torch.compile`` (tests use ``"aot_eager"``, which traces the
    same graphs without generating code). Compilation happens on the first call; if it fails, the
    step warns once with a ``CompileFallbackWarning`` and stays eager.

    >>> import torch, warnings
    >>> from trainfold import make_step, sgd
    >>> from trainfold.core.losses import cross_entropy
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     step = make_step(torch.nn.Linear(2, 2), cross_entropy, sgd(0.1), compile=True)
    >>> [type(w.message).__name__ for w in caught]
    ['CompileFallbackWarning']
    """
    reason = _why_not(plan)
    if reason is not None:
        _fallback(reason)
        return step
    opt = optimizer_plan(plan.optimizer)
    traced = attrs.evolve(plan, loss=traceable_loss(plan.loss))
    grad_graph = torch.compile(_fresh(_micro_grads), backend=backend, mode=mode, fullgraph=True)
    update_graph = torch.compile(_fresh(_update), backend=backend, mode=mode, fullgraph=True)
    update_graphs = {False: update_graph}  # True: the in-place twin, compiled on the first donated step
    keys: dict[torch.device, torch.Generator] = {}  # one per device, reseeded per micro-batch
    failed: list[str] = []  # the reason, once compilation has failed

    def compiled_step(state: TrainState, batch: Sequence[Mapping[str, Tensor]], donate: bool) -> TrainState:
        if failed or len(batch) == 0:
            return step(state, batch, donate=donate)
        if donate and True not in update_graphs:
            update_graphs[True] = torch.compile(_fresh(_update_in_place), backend=backend, mode=mode, fullgraph=True)
        try:
            return _run(traced, opt, grad_graph, update_graphs[donate], keys, state, batch, donate)
        except _NoItems:
            return step(state, batch, donate=donate)
        except Exception as err:  # noqa: BLE001 - the eager step re-raises real input errors
            result = step(state, batch, donate=donate)  # nothing was written into a donated state yet
            failed.append(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
            _fallback(f"compiling the step failed ({failed[0][:500]})")
            return result

    return with_donation(compiled_step)


def _micro_grads(
    plan: _Plan,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    micro: dict[str, Tensor],
    num_items: Tensor,
    key: torch.Generator,
) -> tuple[Tensor, dict[str, Tensor], list[Tensor]]:
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    forward = make_forward(plan.model, buffers)
    autocast = (
        torch.autocast(num_items.device.type, dtype=plan.autocast)
        if plan.autocast is not None
        else contextlib.nullcontext()
    )
    with autocast:
        loss, aux = _micro_loss(plan, forward, leaves, micro, num_items, key)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    if all(g is None for g in grads):  # known when tracing: the eager step then raises the error that names it
        raise no_gradient_error(plan.model, -1)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves.values())]
    return loss.detach().float(), {k: v.detach().float() for k, v in aux.items()}, grads


def _update(
    opt: OptimizerPlan,
    decay: list[float],
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    lr: Tensor,
    step_size: Tensor,
    bc2_sqrt: Tensor,
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    return opt.update(decay, params, grads, mu, nu, lr, step_size, bc2_sqrt)


def _update_in_place(
    opt: OptimizerPlan,
    decay: list[float],
    params: list[Tensor],
    grads: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    lr: Tensor,
    step_size: Tensor,
    bc2_sqrt: Tensor,
) -> Tensor:
    """``_update`` written into ``params``, ``mu`` and ``nu`` (the compiler writes its kernels' results there)."""
    norm, new_p, new_mu, new_nu = _update(opt, decay, params, grads, mu, nu, lr, step_size, bc2_sqrt)
    for dst, src in zip([*params, *mu, *nu], [*new_p, *new_mu, *new_nu]):
        dst.copy_(src)
    return norm


def _run(
    plan: _Plan,
    opt: OptimizerPlan,
    grad_graph: Callable[..., Any],
    update_graph: Callable[..., Any],
    keys: dict[torch.device, torch.Generator],
    state: TrainState,
    batch: Sequence[Mapping[str, Tensor]],
    donate: bool = False,
) -> TrainState:
    cursor = getattr(batch, "cursor", state.cursor)
    step_no = int(state.step)
    num_items = _count(plan, batch)
    if int(num_items) == 0:
        raise _NoItems
    adam = opt.adam_of(state.opt_state)
    rank = plan.collective.rank if plan.collective is not None else 0
    names = list(state.params)
    device = state.params[names[0]].device
    if device not in keys:
        keys[device] = torch.Generator(device=device)
    key = keys[device]
    buffers = dict(state.buffers) if donate else {k: v.clone() for k, v in state.buffers.items()}
    n_dev = num_items.to(device)
    grads: list[Tensor] = []
    total = torch.zeros((), dtype=torch.float32, device=device)
    aux_total: dict[str, Tensor] = {}
    with (
        train_mode(plan.model, True),
        private_rng(device) as generators,
        cache_off(plan.cache_configs),
        torch._dynamo.config.patch(trace_autograd_ops=True),
    ):
        for i, micro in enumerate(batch):
            seed = derive_seed(int(state.seed), step_no, i, rank)
            for gen in generators:
                gen.manual_seed(seed)
            key.manual_seed(seed ^ 1)
            loss, aux, g = grad_graph(plan, state.params, buffers, dict(micro), n_dev, key)
            if grads:
                torch._foreach_add_(grads, g)
            else:
                grads = g
            total += loss
            for name, value in aux.items():
                aux_total[name] = aux_total.get(name, 0) + value
    if plan.collective is not None:
        plan.collective.sum_([*grads, total])
    count = int(adam.count)
    lr, step_size, bc2_sqrt = (torch.tensor(x, dtype=torch.float32, device=device) for x in opt.scalars(count))
    decay = opt.decay(state.params)
    learning_rate = float(opt.learning_rate(count))
    inputs = ([state.params[k] for k in names], grads, [adam.mu[k] for k in names], [adam.nu[k] for k in names])
    out = update_graph(opt, [decay[k] for k in names], *inputs, lr, step_size, bc2_sqrt)
    norm, new_p, mu, nu = (out, inputs[0], inputs[2], inputs[3]) if donate else out  # donated: written in place
    new_adam = AdamState(adam.count + 1, dict(zip(names, mu)), dict(zip(names, nu)))
    return next_state(
        plan,
        state,
        dict(zip(names, new_p)),
        buffers,
        opt.wrap(state.opt_state, new_adam),
        cursor,
        total,
        norm,
        num_items,
        aux_total,
        learning_rate=learning_rate,
    )


class _NoItems(Exception):
    """A step without items: the eager step handles it (it warns, counts the step and learns nothing)."""
