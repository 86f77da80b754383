"""How ``trainfold.step.sharded`` gathers: one transformer block's full params at a time, freed after use.

``find_layout`` finds where each param lives in the module: the root's slots (embeddings, head, final
norm: gathered for the whole forward) and each block's (``recompute.checkpoint_blocks``; gathered
when the block runs). A group's ``Shard(0)`` DTensor shards travel in one collective: each local
shard is padded to DTensor's chunk size, the group's are joined into one buffer and all-gathered;
the backward pass reduce-scatters (sums) the full gradients the same way, so the gradients arrive
as this rank's ``Shard(0)`` part of their sum over ranks. Without activation checkpointing the
full tensors autograd saves are replaced by handles (``saved_tensors_hooks``) and gathered again
in the backward pass, one group at a time. With ``ahead`` (``Sharding(prefetch=True)``) the all-gather
of the block expected next (in backward, the previous one) is started (``async_op=True``, :func:`prefetch`)
before the current one runs, so at most two blocks are gathered at once; a wrong guess is finished
and dropped, alike on every rank. The reduce-scatter stays synchronous: autograd adds its result
into the gradients as soon as it returns.

>>> _chunk(5, 2), _chunk(1, 4)   # rows per rank of a Shard(0) over 2 and 4 ranks
(3, 1)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from trainfold.step.recompute import checkpoint_blocks

__all__ = ["Gatherer", "Layout", "find_layout", "gathered_bytes", "swapped"]

# -- where each param lives in the module, and which block gathers it -------------------------------------------


Place = tuple[dict[str, Any], str, str]  # (a module's _parameters or _buffers, attribute, canonical name)


@attrs.frozen(eq=False)
class Layout:
    """The module's slots: the root's (gathered for the whole forward), each block's, and the buffers'."""

    root: list[Place]
    blocks: list[tuple[nn.Module, list[Place]]]
    buffers: list[Place]

    def names(self, places: list[Place]) -> list[str]:
        """Return the distinct canonical names of ``places``, in order."""
        return list(dict.fromkeys(name for _, _, name in places))


def find_layout(model: nn.Module, params: frozenset[str], per_block: bool) -> Layout:
    """Return where each of ``params`` lives in ``model``: the root's slots, each block's, and the buffers'."""
    canonical = {id(t): n for n, t in model.named_parameters()}
    canonical.update({id(t): n for n, t in model.named_buffers()})
    blocks = checkpoint_blocks(model) if per_block else []
    owner: dict[int, int] = {}  # id(module) -> block index
    for i, (_, block) in enumerate(blocks):
        for m in block.modules():
            owner[id(m)] = i
    slots: list[tuple[int, Place]] = []
    seen: set[int] = set()
    for m in model.modules():
        if id(m) in seen:
            continue
        seen.add(id(m))
        for d in (m._parameters, m._buffers):
            slots += [(owner.get(id(m), -1), (d, a, canonical[id(t)])) for a, t in d.items() if t is not None]
    homes: dict[str, set[int]] = {}
    for where, (_, _, name) in slots:
        homes.setdefault(name, set()).add(where)
    home = {n: next(iter(w)) if len(w) == 1 else -1 for n, w in homes.items()}  # shared across blocks: the root's
    trained = [(home[p[2]], p) for _, p in slots if p[2] in params]
    return Layout(
        root=[p for h, p in trained if h == -1],
        blocks=[(b, [p for h, p in trained if h == i]) for i, (_, b) in enumerate(blocks)],
        buffers=[p for _, p in slots if p[2] not in params],
    )


@contextlib.contextmanager
def swapped(places: list[Place], values: Mapping[str, Tensor]) -> Iterator[None]:
    """Put ``values`` (by canonical name) into ``places`` for the duration; restore the old tensors afterwards."""
    saved = []
    try:
        for d, attr, name in places:
            saved.append(d[attr])
            d[attr] = values[name]
        yield
    finally:
        for (d, attr, _), old in zip(reversed(places[: len(saved)]), reversed(saved)):
            d[attr] = old


# -- gathering ------------------------------------------------------------------------------------------------


_live: dict[int, int] = {}  # id -> bytes of the gathered full params alive now (gathered_bytes measures it)
_peak = [0]


def _track(t: Tensor) -> None:
    key, nbytes = id(t), t.numel() * t.element_size()
    _live[key] = nbytes
    _peak[0] = max(_peak[0], sum(_live.values()))
    weakref.finalize(t, _live.pop, key, None)


@contextlib.contextmanager
def gathered_bytes() -> Iterator[list[int]]:
    """Measure the most bytes of gathered full params alive at once while the block runs: ``[peak]`` after it."""
    _peak[0] = sum(_live.values())
    out = [0]
    try:
        yield out
    finally:
        out[0] = _peak[0]


def _gather(leaf: Tensor, grad: bool = True) -> Tensor:
    if not isinstance(leaf, DTensor):
        return leaf
    n = leaf.device_mesh.ndim
    full = leaf.redistribute(leaf.device_mesh, [Replicate()] * n)
    local = full.to_local(grad_placements=[Partial()] * n) if grad else full.to_local()
    if hasattr(local, "wait") and type(local) is not Tensor:  # an AsyncCollectiveTensor: wait, keep the autograd edge
        local = local * 1 if grad else local.wait()
    _track(local)
    return local


Spec = tuple[Any, int, tuple[torch.Size, ...]]  # (process group, world size, each param's full shape)


def _chunk(rows: int, world: int) -> int:
    return -(-rows // world)  # DTensor's Shard(0): ceil-sized chunks, the last ones short or empty


class Pending:
    """An all-gather in flight (a prefetch): its work handle, its output and the input it reads until done."""

    def __init__(self, work: Any, out: Tensor, flat: Tensor) -> None:
        self.work, self.out, self.flat = work, out, flat

    def wait(self) -> Tensor:
        """Return the gathered buffer once the collective is done (then this record lets go of it)."""
        self.work.wait()
        out, self.out, self.flat, self.work = self.out, None, None, None
        return out


def _start(spec: Spec, locals_: Sequence[Tensor], async_op: bool) -> tuple[Any, Tensor, Tensor]:
    """Start the all-gather of a group's ``Shard(0)`` locals: each padded to its chunk, flattened, joined."""
    group, world, shapes = spec
    pieces = []
    for t, shape in zip(locals_, shapes):
        padded = t.new_zeros((_chunk(shape[0], world), *shape[1:]))
        padded[: t.shape[0]] = t
        pieces.append(padded.reshape(-1))
    flat = torch.cat(pieces)
    out = flat.new_empty(world * flat.numel())
    return dist.all_gather_single(out, flat, group=group, async_op=async_op), out, flat


def _all_gather(spec: Spec, locals_: Sequence[Tensor], pending: Pending | None = None) -> list[Tensor]:
    """All-gather the ``Shard(0)`` locals of a group in one collective (``pending``: the prefetch already started)."""
    _, world, shapes = spec
    out = pending.wait() if pending is not None else _start(spec, locals_, async_op=False)[1]
    rows, fulls, offset = out.view(world, -1), [], 0
    for shape in shapes:
        n = _chunk(shape[0], world) * shape[1:].numel()
        fulls.append(rows[:, offset : offset + n].reshape(-1, *shape[1:])[: shape[0]].contiguous())
        offset += n
    _live.pop(id(out), None)  # a prefetch's buffer is done with (the backend's worker may let go of it later)
    return fulls


class _AllGather(torch.autograd.Function):
    """Forward: one all-gather of a group's shards. Backward: one reduce-scatter (sum) of their full gradients."""

    @staticmethod
    def forward(ctx: Any, spec: Spec, pending: Pending | None, *locals_: Tensor) -> tuple[Tensor, ...]:
        ctx.spec, ctx.rows = spec, [t.shape[0] for t in locals_]
        return tuple(_all_gather(spec, locals_, pending))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        group, world, shapes = ctx.spec
        parts = []
        for g, shape in zip(grads, shapes):
            padded = torch.zeros(
                (world * _chunk(shape[0], world), *shape[1:]), dtype=grads_dtype(grads), device=grads_device(grads)
            )
            if g is not None:
                padded[: shape[0]] = g
            parts.append(padded.view(world, -1))
        flat = torch.cat(parts, dim=1).contiguous()
        out = flat.new_empty(flat.shape[1])
        dist.reduce_scatter_single(out, flat.view(-1), op=dist.ReduceOp.SUM, group=group)
        local, offset = [], 0
        for shape, rows in zip(shapes, ctx.rows):
            n = _chunk(shape[0], world) * shape[1:].numel()
            local.append(out[offset : offset + n].view(-1, *shape[1:])[:rows])
            offset += n
        return (None, None, *local)


def grads_dtype(grads: Sequence[Tensor | None]) -> torch.dtype:
    return next(g.dtype for g in grads if g is not None)


def grads_device(grads: Sequence[Tensor | None]) -> torch.device:
    return next(g.device for g in grads if g is not None)


def _coalesced(leaves: Sequence[Tensor]) -> tuple[list[int], Spec | None]:
    """Return which of ``leaves`` travel in one collective (the 1-D ``Shard(0)`` ones of one dtype) and its spec."""
    idx = [
        i
        for i, t in enumerate(leaves)
        if isinstance(t, DTensor) and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),)
    ]
    if not idx or len({leaves[i].dtype for i in idx}) > 1:
        return [], None
    mesh = leaves[idx[0]].device_mesh
    return idx, (mesh.get_group(), mesh.size(), tuple(leaves[i].shape for i in idx))


def prefetch(leaves: Sequence[Tensor]) -> Pending | None:
    """Start the all-gather of ``leaves`` (a group's) without waiting: ``_gather_group(leaves, ..., pending)``
    finishes it. ``None`` when no leaf travels in the group's collective."""
    idx, spec = _coalesced(leaves)
    if spec is None:
        return None
    with torch.no_grad():  # the gradient flows through the _AllGather that finishes it
        work, out, flat = _start(spec, [leaves[i].to_local().detach() for i in idx], async_op=True)
    _track(out)  # gathered bytes while in flight
    return Pending(work, out, flat)


def _gather_group(leaves: Sequence[Tensor], grad: bool, pending: Pending | None = None) -> list[Tensor]:
    """Return the full tensors of ``leaves``: the ``Shard(0)`` ones of one dtype in one collective (``pending``:
    already started by :func:`prefetch`), others singly."""
    coalesced, spec = _coalesced(leaves)
    out: list[Tensor | None] = [None] * len(leaves)
    if spec is not None:
        locals_ = [leaves[i].to_local() for i in coalesced]
        fulls = _AllGather.apply(spec, pending, *locals_) if grad else _all_gather(spec, locals_, pending)
        for i, full in zip(coalesced, fulls):
            _track(full)
            out[i] = full
    for i, t in enumerate(leaves):
        if out[i] is None:
            out[i] = _gather(t, grad)
    return out  # type: ignore[return-value]


class Gatherer:
    """Gathers a group's full params when it runs; drops them after, re-gathering in backward what autograd saved."""

    def __init__(
        self,
        layout: Layout,
        leaves: Mapping[str, Tensor],
        free: bool,
        compute: Callable[[nn.Module], Callable[..., Any]] | None = None,
        ahead: bool = False,
    ) -> None:
        self.layout, self.leaves, self.free = layout, leaves, free
        self.compute = compute  # compute(block): what runs the block's forward (default: its own forward)
        self.ahead = ahead  # prefetch: start the next block's all-gather before this one runs
        self.pending: tuple[int, Pending] | None = None
        self.groups = [layout.names(layout.root)] + [layout.names(p) for _, p in layout.blocks]
        self.registry: dict[int, tuple[int, str, int]] = {}  # storage address -> (group, name, its offset)
        self.cache: tuple[int, dict[str, Tensor]] | None = None  # the group regathered for backward
        self.bypass = False  # True while the model runs on other params than the shards

    def gather(self, group: int) -> dict[str, Tensor]:
        """Return the full params of ``group`` (0: the root), registered so that autograd saves handles to them."""
        names = self.groups[group]
        full = dict(zip(names, _gather_group([self.leaves[n] for n in names], grad=True, pending=self._take(group))))
        if self.free:
            for n, t in full.items():
                self.registry[t.untyped_storage().data_ptr()] = (group, n, t.storage_offset())
        self._prefetch(group, backward=torch._C._current_graph_task_id() != -1)  # a recomputation runs in backward
        return full

    def _prefetch(self, group: int, backward: bool) -> None:
        """With ``ahead``: start gathering the block expected next (the next one; in backward, the previous one)."""
        following = group - 1 if backward else group + 1
        if not self.ahead or not 1 <= following < len(self.groups):
            return
        names = self.groups[following]
        started = prefetch([self.leaves[n] for n in names])
        if started is not None:
            self.pending = (following, started)

    def _take(self, group: int) -> Pending | None:
        """Return the prefetch of ``group``; a prefetch of another group is finished and dropped (every rank guessed
        alike, so the collectives still match)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if pending[0] != group:
            pending[1].wait()
            return None
        return pending[1]

    def drain(self) -> None:
        """Finish and drop a prefetch still in flight (the micro-batch is done)."""
        self._take(-1)

    def forget(self, full: Mapping[str, Tensor]) -> None:
        """Stop tracking the full params ``full`` (their group has run)."""
        for t in full.values():
            self.registry.pop(t.untyped_storage().data_ptr(), None)

    def pack(self, t: Tensor) -> Any:
        """``saved_tensors_hooks`` pack: a handle in place of a gathered full param, other tensors as they are."""
        if type(t) is not Tensor or not self.registry:
            return t
        hit = self.registry.get(t.untyped_storage().data_ptr())
        if hit is None:
            return t
        group, name, base = hit
        return (group, name, tuple(t.shape), t.stride(), t.storage_offset() - base)

    def unpack(self, saved: Any) -> Tensor:
        """``saved_tensors_hooks`` unpack: gather a handle's group again (one group cached at a time)."""
        if isinstance(saved, Tensor):
            return saved
        group, name, shape, stride, offset = saved
        if self.cache is None or self.cache[0] != group:
            self.cache = None  # drop the previous group before gathering the next
            with torch.no_grad():
                names, pending = self.groups[group], self._take(group)
                full = _gather_group([self.leaves[n] for n in names], grad=False, pending=pending)
                self.cache = (group, dict(zip(names, full)))
            self._prefetch(group, backward=True)
        full = self.cache[1][name]
        return full.as_strided(shape, stride, full.storage_offset() + offset)

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """For the duration: each block's forward gathers its params around the block's own forward."""
        done: list[tuple[nn.Module, Any]] = []
        try:
            for i, (block, places) in enumerate(self.layout.blocks, start=1):
                if places:
                    done.append((block, vars(block).get("forward")))
                    forward = block.forward if self.compute is None else self.compute(block)
                    block.forward = self._block_forward(forward, i, places)
            yield
        finally:
            for block, previous in reversed(done):
                if previous is None:
                    del block.forward
                else:
                    block.forward = previous

    def _block_forward(self, forward: Callable[..., Any], group: int, places: list[Place]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.bypass:  # a forward on other params (a frozen reference): functional_call swapped them in
                return forward(*args, **kwargs)
            full = self.gather(group)
            try:
                with swapped(places, full):
                    return forward(*args, **kwargs)
            finally:
                self.forget(full)

        return run
