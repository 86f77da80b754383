"""Run the pure step under ``torch.compile``: the same results as the eager step, faster.

``compile_step(step)`` wraps a step of ``make_step`` (``make_step(..., compile=True)`` does it). The
micro-batch driver (``trainfold.step.driver``) keeps every Python-level decision of the eager step
(counting ``num_items`` before the forward, seeding, the learning rate, metrics, the cursor) and calls
one compiled graph per micro-batch: forward, loss and ``torch.autograd.grad`` over leaves made inside
the graph (``p.detach().requires_grad_()``). Accumulation steps reuse it, so compile time does not grow
with the accumulation count. Gradients are summed (and all-reduced by a collective) after it, and the
optimizer's own ``apply`` runs on them as in the eager step: any transformation works (``adamw`` runs
torch's fused or foreach kernels), and a donated state is updated in place. When ``torch.compile`` is
unavailable or fails on the model or objective, the step warns with a ``CompileFallbackWarning``
naming the reason and runs eagerly.

Dropout inside a compiled graph draws from the compiler's own generator, seeded from the same
``(seed, step, micro, rank)`` seed as the eager step: it is deterministic and resumable, but its
masks differ from the eager step's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from trainfold.core.forward import cache_off, train_mode
from trainfold.core.state import TrainState
from trainfold.core.tree import global_norm, known_norm
from trainfold.step.driver import (
    StepStart,
    Sums,
    accumulate_step,
    next_state,
    open_step,
    sum_over_ranks,
    with_donation,
)
from trainfold.step.fallback import CompileFallbackWarning, fall_back, refuse_uncompilable
from trainfold.step.plan import StepPlan
from trainfold.step.traced import fresh_function, micro_grads

__all__ = ["CompileFallbackWarning", "compile_step", "refuse_uncompilable"]

Step = Callable[..., TrainState]  # a step of make_step: step(state, batch, *, donate=False)


# -- the compiled step ----------------------------------------------------------------------------


def _why_not(plan: StepPlan) -> str | None:
    try:
        if not torch._dynamo.is_dynamo_supported():
            return "torch.compile is not supported on this Python or platform"
    except Exception as err:
        return f"torch.compile is unavailable ({err})"
    return None


def compile_step(step: Step, *, backend: str | Callable[..., Any] = "inductor", mode: str | None = None) -> Step:
    """Return ``step`` (a step of ``make_step``) running under ``torch.compile``; ``step`` itself where it cannot.

    ``backend`` and ``mode`` go to ``torch.compile`` (tests use ``"aot_eager"``, which traces the
    same graphs without generating code). Compilation happens on the first call; if it fails, the
    step warns once with a ``CompileFallbackWarning`` and stays eager.

    >>> import torch, warnings
    >>> from trainfold import make_step, sgd
    >>> from trainfold.core.losses import cross_entropy
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     step = compile_step(make_step(torch.nn.Linear(2, 2), cross_entropy, sgd(0.1)), backend="aot_eager")
    >>> [type(w.message).__name__ for w in caught], step.plan.optimizer.name
    ([], 'sgd')
    """
    plan = getattr(step, "plan", None)
    if not isinstance(plan, StepPlan):
        raise TypeError(f"compile_step wraps a step of make_step (it reads step.plan); got {step!r}")
    refuse_uncompilable(plan)
    reason = _why_not(plan)
    if reason is not None:
        fall_back(reason)
        return step
    run = _compiled_run(plan, backend, mode)
    failed: list[str] = []  # the reason, once compilation has failed

    def compiled_step(state: TrainState, batch: Sequence[Mapping[str, Tensor]], donate: bool) -> TrainState:
        if failed or len(batch) == 0:
            return step(state, batch, donate=donate)
        try:
            return run(state, batch, donate)
        except Exception as err:
            result = step(state, batch, donate=donate)  # nothing was written into a donated state yet
            failed.append(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
            fall_back(f"compiling the step failed ({failed[0][:500]})")
            return result

    wrapped = with_donation(compiled_step)
    wrapped.plan = plan  # type: ignore[attr-defined]
    return wrapped


def _compiled_run(plan: StepPlan, backend: Any, mode: str | None) -> Callable[[TrainState, Any, bool], TrainState]:
    """Return ``run(state, batch, donate)`` over the step's micro-batch graph (compiled on first use)."""
    grad_graph = torch.compile(fresh_function(micro_grads), backend=backend, mode=mode, fullgraph=True)
    keys: dict[torch.device, torch.Generator] = {}  # one per device, reseeded per micro-batch

    def run(state: TrainState, batch: Sequence[Mapping[str, Tensor]], donate: bool) -> TrainState:
        return _run(plan, grad_graph, keys, state, batch, donate)

    return run


def _run(
    plan: StepPlan,
    grad_graph: Callable[..., Any],
    keys: dict[torch.device, torch.Generator],
    state: TrainState,
    batch: Sequence[Mapping[str, Tensor]],
    donate: bool = False,
) -> TrainState:
    start, done = open_step(plan, state, batch)
    if done is not None:  # no items: the eager step's empty step (it warned, counts the step, learns nothing)
        return done
    device = next(iter(state.params.values())).device
    buffers = dict(state.buffers) if donate else {k: v.clone() for k, v in state.buffers.items()}
    n_dev = start.num_items.to(device)

    def micro(mb: Mapping[str, Tensor], key: torch.Generator) -> tuple[Tensor, Mapping[str, Tensor], list[Tensor]]:
        return grad_graph(plan, state.params, buffers, dict(mb), n_dev, key)

    with (
        train_mode(plan.model, True),
        cache_off(plan.cache_configs),
        torch._dynamo.config.patch(trace_autograd_ops=True),
    ):
        sums = accumulate_step(plan, state, start, micro, batch, device, key=_key(keys, device))
    assert sums.grads is not None
    grads = cast(list[Tensor], sums.grads)  # micro_grads zero-fills unused gradients: none is None
    sum_over_ranks(plan.collective, [*grads, sums.loss])
    return _apply(plan, state, start, buffers, sums, donate)


def _key(keys: dict[torch.device, torch.Generator], device: torch.device) -> torch.Generator:
    if device not in keys:
        keys[device] = torch.Generator(device=device)
    return keys[device]


def _apply(
    plan: StepPlan, state: TrainState, start: StepStart, buffers: dict[str, Tensor], sums: Sums, donate: bool
) -> TrainState:
    """Apply the optimizer to the summed gradients (in place when donated) and return the next state."""
    grads = dict(zip(state.params, cast(list[Tensor], sums.grads)))  # zero-filled: none is None
    norm = global_norm(grads)
    learning_rate = plan.optimizer.learning_rate(state.opt_state)  # before a donated update reuses the tensors
    with torch.no_grad(), known_norm(grads, norm):  # a lent state's params are the module's, written in place
        params, opt_state = plan.optimizer.apply(grads, state.opt_state, state.params, donate=donate)
    return next_state(
        plan, state, start, sums, norm, learning_rate, params=params, buffers=buffers, opt_state=opt_state
    )
