"""Data parallelism on ``torch.distributed``: the ``Collective`` the step sums with, torchrun, shards of data.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set), ``collective_from_env()`` joins
the process group (NCCL on GPUs, gloo on CPUs) and yields a ``ProcessGroupCollective``; alone it
yields ``None`` and everything runs in one process. A lent step's gradients are summed by torch's
``DistributedDataParallel`` during backward (``trainfold.step.data_parallel``); the collective sums
what else the ranks share (item counts, losses, the pure path's gradients).

Evaluation is sharded: each rank evaluates a contiguous slice of the eval set
(:func:`shard_bounds`, :func:`shard`); ``trainfold.evaluation.evaluate_batches(..., collective=)`` merges
the ranks' results.

>>> with collective_from_env() as c:
...     print(c)
None
>>> [shard_bounds(7, r, 2) for r in range(2)]
[(0, 3), (3, 7)]
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from trainfold.distributed import quiesce as _quiesce  # noqa: F401  (registers the exit hook: see its docstring)
from trainfold.distributed.shards import shard, shard_bounds

__all__ = [
    "GatherCollective",
    "ProcessGroupCollective",
    "SingleProcess",
    "agreed_stop",
    "failure_of",
    "named_failures",
    "group_timeout",
    "collective_from_env",
    "joins_torchrun",
    "launched_by_torchrun",
    "join_torchrun_group",
    "process_group_collective",
    "shard",
    "shard_bounds",
]


@attrs.frozen
class ProcessGroupCollective:
    """Sums and gathers over the ranks of a ``torch.distributed`` process group.

    ``device`` is where tensors travel (a CUDA device for NCCL, the CPU for gloo); tensors
    elsewhere are copied there and back. Build one with :func:`process_group_collective`;
    its fields need no process group:

    >>> c = ProcessGroupCollective(rank=1, world_size=4)
    >>> c.rank, c.world_size, str(c.device)
    (1, 4, 'cpu')
    """

    rank: int
    world_size: int
    group: Any = None
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))

    def sum_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its sum over all ranks, in place (one ``all_reduce`` each)."""
        self._all_reduce(tensors, dist.ReduceOp.SUM)

    def max_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its maximum over all ranks, in place."""
        self._all_reduce(tensors, dist.ReduceOp.MAX)

    def _all_reduce(self, tensors: list[Tensor], op: Any) -> None:
        with named_failures(self.rank, self.world_size):
            for t in tensors:
                buf = t.to(self.device)
                dist.all_reduce(buf, op=op, group=self.group)
                if buf is not t:
                    t.copy_(buf)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Return every rank's ``tensor`` (same shape and dtype on all ranks), in rank order."""
        buf = tensor.to(self.device).contiguous()
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
        with named_failures(self.rank, self.world_size):
            dist.all_gather(out, buf, group=self.group)
        return [t.to(tensor.device) for t in out]


@attrs.frozen
class SingleProcess:
    """The collective of a world of one process: sums and gathers return what they are given.

    >>> c = SingleProcess()
    >>> t = torch.tensor([2.0])
    >>> c.sum_([t]); t.tolist(), [x.tolist() for x in c.all_gather(t)]
    ([2.0], [[2.0]])
    """

    rank: int = 0
    world_size: int = 1

    def sum_(self, tensors: list[Tensor]) -> None:
        """Leave each tensor as it is: it is already the sum over the one rank."""

    def max_(self, tensors: list[Tensor]) -> None:
        """Leave each tensor as it is: it is already the maximum over the one rank."""

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Return ``[tensor]``."""
        return [tensor]


class GatherCollective(Protocol):
    """What sharded evaluation needs from a process group: sums, maxima and gathers in rank order.

    >>> c: GatherCollective = SingleProcess()
    >>> [t.tolist() for t in c.all_gather(torch.tensor([1, 2]))], c.world_size
    ([[1, 2]], 1)
    """

    rank: int
    world_size: int

    def sum_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its sum over all ranks, in place."""

    def max_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its maximum over all ranks, in place."""

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Return every rank's tensor, in rank order."""


def process_group_collective(group: Any = None) -> ProcessGroupCollective:
    """Return the collective of an already initialised process group (default: the world).

    NCCL groups communicate on ``cuda:LOCAL_RANK``; others on the CPU.

    >>> try:
    ...     process_group_collective()
    ... except RuntimeError as e:
    ...     print(str(e)[:52])
    process_group_collective() needs an initialised proc
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "process_group_collective() needs an initialised process group: call "
            "torch.distributed.init_process_group first, or use collective_from_env() under torchrun"
        )
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return ProcessGroupCollective(dist.get_rank(group), dist.get_world_size(group), group=group, device=device)


def _init_group(backend: str | None) -> None:
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=group_timeout())
    atexit.register(_close_group_at_exit)


def _close_group_at_exit() -> None:
    """Destroy the group trainfold opened before the interpreter tears down: left to static
    destruction, gloo's threads can abort the process ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def group_timeout() -> Any:
    """Return how long a collective waits for the other ranks: ``TRAINFOLD_DIST_TIMEOUT`` seconds, else torch's default.

    A rank whose peer raised and lives on (its process does not end) waits this long before its
    collective fails and it names that peer (:func:`failure_of`).

    >>> group_timeout() is None or group_timeout().total_seconds() > 0
    True
    """
    import datetime

    value = os.environ.get("TRAINFOLD_DIST_TIMEOUT")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"TRAINFOLD_DIST_TIMEOUT={value!r} must be a number of seconds > 0")
    return datetime.timedelta(seconds=seconds)


@contextlib.contextmanager
def collective_from_env(backend: str | None = None) -> Iterator[ProcessGroupCollective | None]:
    """Join the torchrun process group for the block (and leave it after); ``None`` when alone.

    An already initialised process group is used as it is (and left open). After the block the
    ranks meet at a barrier before the group is destroyed, so no rank leaves while another still
    writes (rank 0's last checkpoint); after an exception the group is destroyed without waiting.

    Outside torchrun (no ``WORLD_SIZE``) the block runs alone:

    >>> with collective_from_env() as c:
    ...     c is None
    True
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not dist.is_initialized():
        yield None
        return
    owned = not dist.is_initialized()
    if owned:
        _init_group(backend)
    try:
        yield process_group_collective()
    except BaseException:
        if owned:
            dist.destroy_process_group()
        raise
    if owned:
        dist.barrier()
        dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """Say whether torchrun started this process: its rendezvous is in the environment, on any number of ranks
    (``--nproc_per_node=1`` included).

    >>> launched_by_torchrun() == all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    True
    """
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def join_torchrun_group() -> None:
    """Join torchrun's process group (of any world size, one included) unless one is open; it stays open until
    the interpreter exits, as a group ``joins_torchrun`` opens. Raise ``RuntimeError`` outside torchrun."""
    if dist.is_initialized():
        return
    if not launched_by_torchrun():
        raise RuntimeError("join_torchrun_group() needs torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)")
    _init_group(None)


def _under_torchrun() -> bool:
    """Return whether this process is one rank of several: ``WORLD_SIZE > 1``, or a process group of several is open."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def joins_torchrun(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``fn(..., collective=None)`` join the torchrun process group itself when it runs as one of several ranks.

    Under ``torchrun`` (``WORLD_SIZE > 1``) a call without ``collective=`` runs inside
    the process group (joined now, or the one already open), and the ranks meet at a barrier when
    it returns. A group it joined stays open for later calls, as after HF's ``Trainer``: creating a
    group again in one torchrun job races on torchrun's store (a rank can read the old group's
    address and fail to connect). An explicit ``collective=`` is used as given; alone nothing changes.

    >>> @joins_torchrun
    ... def world(*, collective=None):
    ...     return None if collective is None else collective.world_size
    >>> world() is None   # alone: no collective
    True
    """

    @functools.wraps(fn)
    def joined(*positional: Any, **kwargs: Any) -> Any:
        if kwargs.get("collective") is not None or not _under_torchrun():
            return fn(*positional, **kwargs)
        if not dist.is_initialized():
            _init_group(None)
        collective = process_group_collective()
        result = fn(*positional, **{**kwargs, "collective": collective})
        with named_failures(collective.rank, collective.world_size):
            dist.barrier()  # no rank goes on while another still writes (rank 0's last checkpoint)
        return result

    return joined


def agreed_stop(stop: Callable[[Any], bool], collective: Any) -> Callable[[Any], bool]:
    """Return a stop predicate that is true on every rank as soon as ``stop`` is true on any rank.

    A predicate that can differ between ranks (a time limit, a file that appears, a user's
    condition) must be agreed on, or one rank leaves the loop while the others wait in its next
    all-reduce. The returned predicate sums the local flags (one all-reduce per call); every rank
    must call it at the same points, as ``fit``/``trajectory`` do.

    >>> agreed_stop(lambda state: state > 2, SingleProcess())(3)
    True
    """

    def agreed(state: Any) -> bool:
        flag = torch.tensor([int(bool(stop(state)))], dtype=torch.int64)
        collective.sum_([flag])
        return int(flag.item()) > 0

    return agreed


# -- a failure on one rank, named on the others ---------------------------------------------------

_FAILED = "trainfold/failed/"
_LOST_PEER = ("Connection closed by peer", "Timed out", "timed out", "pair closure", "Connection reset", "NCCL")


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def named_failures(rank: int, world_size: int) -> Iterator[None]:
    """Raise a collective's lost-peer error (gloo's "Connection closed by peer", a timeout) as ``failure_of`` names it.

    >>> with named_failures(0, 1):
    ...     pass
    """
    try:
        yield
    except RuntimeError as exc:
        failure = failure_of(exc, rank, world_size)
        if failure is exc:
            raise
        raise failure from exc


def failure_of(exc: BaseException, rank: int, world_size: int) -> BaseException:
    """Return the error to raise on ``rank`` for ``exc`` in a step: a lost peer is named by the rank that failed.

    A rank's own error is recorded in the process group's store (then returned as it is), so that
    the other ranks, whose next collective times out or loses its peer, raise a ``RuntimeError``
    naming that rank and its error instead of the transport's message. Alone nothing is recorded:

    >>> failure_of(KeyError("x"), 0, 1)
    KeyError('x')
    """
    store = _store() if world_size > 1 else None
    text = str(exc)
    if store is None or text.startswith(f"rank {rank} stopped: "):  # alone, or named already (inside the step)
        return exc
    if not any(marker in text for marker in _LOST_PEER):
        try:
            store.set(f"{_FAILED}{rank}", f"{type(exc).__name__}: {text}"[:2000])
        except RuntimeError:
            pass
        return exc
    failed = {}
    for other in (r for r in range(world_size) if r != rank):
        try:
            if store.check([f"{_FAILED}{other}"]):
                failed[other] = store.get(f"{_FAILED}{other}").decode()
        except RuntimeError:
            continue
    if failed:
        named = "; ".join(f"rank {r} raised {why}" for r, why in sorted(failed.items()))
        return RuntimeError(f"rank {rank} stopped: {named} (this rank's collective then failed: {text[:300]})")
    return RuntimeError(
        f"rank {rank} stopped: a collective timed out or lost its peer and no other rank recorded an "
        f"error (a rank was killed, or hangs outside the step); torchrun's error summary names the rank that exited "
        "(exitcode -9: killed); the checkpoints are intact: start every rank again with resume_from_checkpoint=True "
        f"to go on from the latest. The transport said: {text[:300]}"
    )
