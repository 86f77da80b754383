"""Sharded training (FSDP-style) on torch's own engine: the state's tensors are ``DTensor`` shards on a ``DeviceMesh``.

Data parallelism replicates params, gradients and optimizer moments on every rank; here each rank
holds ``1/world`` of them. The API (stable; ``trainfold.ckpt`` and resume build on it):

* ``make_mesh(device_type=None)`` — the 1-D ``DeviceMesh`` over the open process group (``"cuda"`` under
  NCCL, else ``"cpu"``);
* ``shard_state(state, mesh)`` — the state with ``params`` and every param-keyed dict of
  ``opt_state`` (AdamW's ``mu``/``nu``, SGD's momentum) as ``DTensor`` s: ``Shard(0)`` (0-d ones
  ``Replicate()``); everything else (buffers, counters, cursor, metrics) stays plain and replicated;
* ``gather_state(state)`` — the inverse: every DTensor as its full plain tensor (a collective: every
  rank must call it), the record a one-process run holds;
* ``is_sharded(state)`` — whether ``state.params`` holds DTensors; ``full_params(params)`` — the
  params gathered (plain ones as they are; evaluation and ``TrainResult.apply_to`` use it);
* ``gathered_bytes()`` — measures the most bytes of gathered full params alive at once;
* ``make_step(model, ..., sharding=mesh)`` (or ``Sharding(mesh)``, or ``"full_shard"``) builds the
  step over a sharded state; ``TrainingArguments(fsdp="full_shard")`` does all of it under torchrun.

The step keeps the module plain (never ``fully_shard``-wrapped). For each micro-batch it gathers
the params of the model's root (embeddings, head, final norm) and each transformer block's
(``recompute.checkpoint_blocks``) only when that block runs, one all-gather per group of the
shards' local tensors (``sharded_gather``; other placements go through
``redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])``); after the block the full
tensors are dropped: autograd keeps a handle in their place (``saved_tensors_hooks``) and gathers
the block again in the backward pass (with activation checkpointing the recomputation does). So
beyond the shards at most the root's and one block's full params are alive. ``torch.autograd.grad``
w.r.t. the shards returns ``Shard(0)`` DTensor gradients already summed over ranks (one reduce-scatter
per group: exact sums, no PREMUL_SUM needed since the loss is divided by the global item count); the optimizer
updates the shards (an element-wise one, clipping and AdamW, on their local tensors: ``sharded_update``;
others through DTensor's ops), and the global gradient norm (logging, ``clip_by_global_norm``) is
DTensor's norm over all shards. ``compile`` compiles each block's forward (``sharded_compiled``);
``Sharding(mesh, prefetch=True)`` starts the next block's all-gather before the current block runs.

Alone (a world of one) the same code runs on a one-rank mesh:

>>> from trainfold.core.state import TrainState
>>> is_sharded(TrainState(params={"w": torch.zeros(2)}, buffers={}, opt_state=None))
False
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from trainfold.core.forward import make_forward, training_flags
from trainfold.core.state import TrainState
from trainfold.core.tree import global_norm
from trainfold.step.driver import (
    MicroStep,
    StepStart,
    accumulate,
    materialized,
    micro_loss,
    next_state,
    no_gradient_error,
    open_step,
    sum_over_ranks,
)
from trainfold.step.plan import StepPlan
from trainfold.step.recompute import cache_off
from trainfold.step.sharded_compiled import BlockCompiler, refuse_uncompilable_sharded
from trainfold.step.sharded_gather import Gatherer, Layout, find_layout, gathered_bytes, swapped
from trainfold.step.sharded_update import Update, map_param_dicts, shard_update

__all__ = [
    "Sharding",
    "make_mesh",
    "shard_state",
    "gather_state",
    "is_sharded",
    "as_sharding",
    "make_sharded_step",
    "gathered_bytes",
]

_SCALAR_NAMES = ("count",)


@attrs.frozen
class Sharding:
    """How the step shards: over ``mesh`` (1-D), gathering one block at a time (``per_block``) or the whole model.

    ``prefetch``: start the next block's all-gather before the current block runs (in backward, the
    previous block's), so that communication overlaps compute; at most two blocks are gathered at
    once. Off by default: on CPU gloo it measured no faster (README, sharded training).
    """

    mesh: DeviceMesh
    per_block: bool = True
    prefetch: bool = False


def make_mesh(device_type: str | None = None) -> DeviceMesh:
    """Return the 1-D ``DeviceMesh`` over every rank of the open process group.

    ``device_type`` defaults to ``"cuda"`` when the group's backend is NCCL, else ``"cpu"`` (gloo).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "make_mesh() needs an initialised process group: run under torchrun (train joins it), "
            "or call torch.distributed.init_process_group first"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def as_sharding(sharding: Sharding | DeviceMesh | str) -> Sharding:
    """Return ``sharding`` as a ``Sharding``: a mesh is wrapped, ``"full_shard"`` makes the mesh of the open group."""
    if isinstance(sharding, Sharding):
        return sharding
    if isinstance(sharding, DeviceMesh):
        return Sharding(sharding)
    if sharding == "full_shard":
        return Sharding(make_mesh())
    raise ValueError(
        f"sharding={sharding!r} is not a trainfold.step.sharded.Sharding, a DeviceMesh or 'full_shard'; "
        "pass make_step(..., sharding=trainfold.step.sharded.make_mesh())"
    )


def _placements(t: Tensor) -> list[Any]:
    return [Shard(0)] if t.dim() > 0 else [Replicate()]


def _distribute(t: Tensor, mesh: DeviceMesh) -> Tensor:
    if isinstance(t, DTensor):
        return t
    return distribute_tensor(t.detach().to(mesh.device_type), mesh, _placements(t))


def shard_state(state: TrainState, mesh: DeviceMesh) -> TrainState:
    """Return ``state`` with its params and param-keyed optimizer tensors as DTensor shards on ``mesh``.

    Every rank must call it with the same full state (``distribute_tensor`` takes rank 0's values).
    """
    keys = frozenset(state.params)
    return attrs.evolve(
        state,
        params={k: _distribute(v, mesh) for k, v in state.params.items()},
        opt_state=map_param_dicts(state.opt_state, keys, lambda t: _distribute(t, mesh)),
    )


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_state(state: TrainState) -> TrainState:
    """Return ``state`` with every DTensor as its full plain tensor (every rank must call it)."""
    keys = frozenset(state.params)
    return attrs.evolve(
        state,
        params={k: _full(v) for k, v in state.params.items()},
        opt_state=map_param_dicts(state.opt_state, keys, _full),
    )


def is_sharded(state: TrainState) -> bool:
    """Return whether ``state.params`` holds DTensors (a state of ``shard_state``)."""
    return any(isinstance(v, DTensor) for v in state.params.values())


def full_params(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return ``params`` with every DTensor gathered into its full tensor (plain ones as they are).

    >>> full_params({"w": torch.ones(1)})
    {'w': tensor([1.])}
    """
    return {k: _full(v) for k, v in params.items()}


def sharding_for(full_shard: bool, collective: Any) -> Sharding | None:
    """Return the run's ``Sharding`` for ``TrainingArguments(fsdp="full_shard")`` (``None`` when it is off)."""
    if not full_shard:
        return None
    if collective is None or not dist.is_initialized():
        raise ValueError(
            "fsdp='full_shard' shards over the ranks of a torchrun job: run it under torchrun "
            "(python -m torch.distributed.run --nproc_per_node N your_script.py), or drop fsdp to train "
            "in one process"
        )
    return Sharding(make_mesh())


# -- the step -------------------------------------------------------------------------------------------------


def make_sharded_step(
    plan: StepPlan,
    sharding: Sharding | DeviceMesh | str,
    *,
    compile: bool | str | Callable[..., Any] = False,
    compile_mode: str | None = None,
) -> Callable[[TrainState, Any], TrainState]:
    """Return the step of ``plan`` over a sharded state (``make_step(..., sharding=...)`` calls it).

    ``compile`` (``True``: inductor; a string or callable: that backend) compiles each block's forward
    (``sharded_compiled``); the collectives and the driver stay eager.
    """
    sharding = as_sharding(sharding)
    if plan.loss_scaling is not None:
        raise ValueError("loss_scaling (fp16) with sharding is not supported; use bf16 autocast (bf16=True)")
    compiler = _compiler(plan, sharding, compile, compile_mode)
    if plan.collective is None:
        from trainfold.distributed.distributed import process_group_collective

        plan = attrs.evolve(plan, collective=process_group_collective(sharding.mesh.get_group()))
    layouts: dict[frozenset[str], Layout] = {}
    update = shard_update(plan.optimizer)

    def step(state: TrainState, batch: Sequence[Mapping[str, Tensor]]) -> TrainState:
        if not is_sharded(state):
            raise ValueError(
                "make_step(..., sharding=...) needs a sharded state: "
                "state = trainfold.step.sharded.shard_state(state, mesh)"
            )
        names = frozenset(state.params)
        if names not in layouts:
            layouts[names] = find_layout(plan.model, names, sharding.per_block)
        try:
            return _step(plan, layouts[names], state, batch, compiler, update, sharding.prefetch)
        except Exception as exc:  # another rank's error, named here; ours, recorded for the others
            from trainfold.distributed.distributed import failure_of

            assert plan.collective is not None
            failure = failure_of(exc, plan.collective.rank, sharding.mesh.size())
            if failure is exc:
                raise
            raise failure from exc

    return step


def _compiler(plan: StepPlan, sharding: Sharding, compile: Any, mode: str | None) -> BlockCompiler | None:
    """Return the step's ``BlockCompiler`` (``None``: eager), refusing by name what it cannot compile."""
    if not compile:
        return None
    refuse_uncompilable_sharded(plan.model, sharding.per_block)
    try:
        supported = torch._dynamo.is_dynamo_supported()
    except Exception:
        supported = False
    if not supported:
        from trainfold.step.fallback import fall_back

        fall_back("torch.compile is not supported on this Python or platform")
        return None
    return BlockCompiler("inductor" if compile is True else compile, mode)


def _step(
    plan: StepPlan,
    layout: Layout,
    state: TrainState,
    batch: Sequence[Mapping[str, Tensor]],
    compiler: BlockCompiler | None,
    update: Update,
    ahead: bool = False,
) -> TrainState:
    start, done = open_step(plan, state, batch)
    if done is not None:
        return done
    assert plan.collective is not None
    device = torch.device(next(iter(state.params.values())).device_mesh.device_type)
    leaves = {k: v.detach().requires_grad_() for k, v in state.params.items()}
    buffers = {k: v.clone() for k, v in state.buffers.items()}
    modules = list(plan.model.modules())
    gatherer = Gatherer(layout, leaves, free=not plan.recompute, compute=compiler, ahead=ahead)
    with (
        training_flags(modules, True),
        swapped(layout.buffers, buffers),
        cache_off(plan.cache_configs),
        gatherer.patched(),
        plan.recompute_scope(modules),
    ):
        micro = _micro(plan, layout, gatherer, leaves, buffers, start, device)
        sums = accumulate(micro, batch, (int(state.seed),), start.number, plan.collective.rank, device)
        for d, attr, name in layout.buffers:  # a buffer the module reassigned (not updated in place) is kept
            if name in buffers and d[attr] is not buffers[name]:
                buffers[name] = d[attr]
    assert sums.grads is not None
    leaf_list = list(leaves.values())
    grads = [
        _as_leaf(g, leaf) for g, leaf in zip(materialized(sums.grads, leaf_list, plan.model, start.number), leaf_list)
    ]
    sum_over_ranks(plan.collective, [sums.loss])  # the gradients are summed already (reduce-scatter)
    grad_tree = dict(zip(leaves, grads))
    grad_norm = _full(global_norm(grad_tree))
    params, opt_state = update(grad_tree, state, grad_norm)
    params = {k: params[k].detach() for k in leaves}
    return next_state(
        plan, state, params, buffers, opt_state, start.cursor, sums.loss, grad_norm, start.num_items, sums.aux
    )


def _micro(
    plan: StepPlan,
    layout: Layout,
    gatherer: Gatherer,
    leaves: dict[str, Tensor],
    buffers: dict[str, Tensor],
    start: StepStart,
    device: torch.device,
) -> MicroStep:
    """Return the sharded ``micro``: the root gathered for the forward, blocks as they run, gradients by
    ``torch.autograd.grad`` (reduce-scattered into shards)."""
    leaf_list = list(leaves.values())
    n_dev = start.num_items.to(device)
    autocast = plan.autocast_scope(device.type)

    def micro(mb: Mapping[str, Tensor], key: torch.Generator) -> tuple[Tensor, Mapping[str, Tensor], Any]:
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(gatherer.pack, gatherer.unpack)
            if gatherer.free
            else contextlib.nullcontext()
        )
        root = gatherer.gather(0)
        try:
            with swapped(layout.root, root), hooks, autocast:
                forward = _forward(plan.model, leaves, buffers, gatherer)
                loss, aux = micro_loss(plan, forward, leaves, mb, n_dev, key)
        finally:
            gatherer.forget(root)
        del root
        if not loss.requires_grad:
            raise no_gradient_error(plan.model, start.number)
        grads = torch.autograd.grad(loss, leaf_list, allow_unused=True)
        gatherer.cache = None
        gatherer.drain()  # a prefetch no block took (every rank started it alike)
        return loss, aux, grads

    return micro


def _forward(
    model: nn.Module, leaves: Mapping[str, Tensor], buffers: Mapping[str, Tensor], gatherer: Gatherer
) -> Callable[..., Any]:
    other = make_forward(model, buffers)

    def forward(p: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Any:
        if p is leaves:
            return model(**inputs)
        gatherer.bypass = True  # other params (DPO's frozen reference): no block gathers the shards
        try:
            return other(p, inputs)
        finally:
            gatherer.bypass = False

    return forward


def _as_leaf(grad: Tensor, leaf: Tensor) -> Tensor:
    """Return ``grad`` placed like ``leaf`` (a replicated leaf's gradient comes back as a ``Partial`` sum)."""
    if isinstance(grad, DTensor) and isinstance(leaf, DTensor) and tuple(grad.placements) != tuple(leaf.placements):
        return grad.redistribute(leaf.device_mesh, leaf.placements)
    return grad
