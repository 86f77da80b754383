"""Data parallelism on ``torch.distributed``: the ``Collective`` the step sums with, and sharded evaluation.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set), ``collective_from_env()`` joins
the process group (NCCL on GPUs, gloo on CPUs) and yields a ``ProcessGroupCollective``; alone it
yields ``None`` and everything runs in one process. Gradients are summed in buckets: tensors of
one dtype are flattened into a few large buffers, one ``all_reduce`` each, then copied back.

Evaluation is sharded: each rank evaluates a contiguous slice of the eval set
(:func:`shard_bounds`, :func:`shard`), and :func:`evaluate_sharded` / :func:`predict_sharded`
merge the ranks' loss accumulators (sums and counts, with ``mean_loss``'s ``merge``) and gather
the predictions back in dataset order, so every rank returns what one process would.

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
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainfold.eval.evaluation import (
    EvalPrediction,
    PredictionOutput,
    evaluate,
    final_metrics,
    predict,
    resolve_forward,
    throughput,
    to_numpy,
)
from trainfold.core.losses import IGNORE_INDEX, causal_lm, counter_for, logits_of
from trainfold.eval.reducers import fold, mean_loss, merge_all, pad_concat
from trainfold.core.forward import train_mode

__all__ = [
    "BUCKET_BYTES",
    "GatherCollective",
    "ProcessGroupCollective",
    "SingleProcess",
    "agreed_stop",
    "failure_of",
    "group_timeout",
    "collective_from_env",
    "evaluate_sharded",
    "gather_rows",
    "joins_torchrun",
    "predict_sharded",
    "process_group_collective",
    "shard",
    "shard_bounds",
]

BUCKET_BYTES = 25 * 2**20


@attrs.frozen
class ProcessGroupCollective:
    """Sums and gathers over the ranks of a ``torch.distributed`` process group, bucketed.

    ``device`` is where tensors travel (a CUDA device for NCCL, the CPU for gloo); tensors
    elsewhere are copied there and back. Build one with :func:`process_group_collective`;
    its fields need no process group:

    >>> c = ProcessGroupCollective(rank=1, world_size=4)
    >>> c.rank, c.world_size, str(c.device), c.bucket_bytes == BUCKET_BYTES
    (1, 4, 'cpu', True)
    """

    rank: int
    world_size: int
    group: Any = None
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    bucket_bytes: int = BUCKET_BYTES

    def sum_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its sum over all ranks, in place: one ``all_reduce`` per bucket."""
        for bucket in _buckets(tensors, self.bucket_bytes):
            flat = torch.cat([t.reshape(-1).to(self.device) for t in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            offset = 0
            for t in bucket:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n

    def max_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its maximum over all ranks, in place."""
        for t in tensors:
            buf = t.to(self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
            t.copy_(buf)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Return every rank's ``tensor`` (same shape and dtype on all ranks), in rank order."""
        buf = tensor.to(self.device).contiguous()
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
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


def _buckets(tensors: list[Tensor], limit: int) -> Iterator[list[Tensor]]:
    """Group tensors by dtype into lists of at most ``limit`` bytes (a larger tensor goes alone)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        bucket: list[Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def process_group_collective(group: Any = None, bucket_bytes: int = BUCKET_BYTES) -> ProcessGroupCollective:
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
    return ProcessGroupCollective(dist.get_rank(group), dist.get_world_size(group), group=group, device=device,
                                  bucket_bytes=bucket_bytes)


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
    def joined(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("collective") is not None or not _under_torchrun():
            return fn(*args, **kwargs)
        if not dist.is_initialized():
            _init_group(None)
        result = fn(*args, **{**kwargs, "collective": process_group_collective()})
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


def failure_of(exc: BaseException, rank: int, world_size: int) -> BaseException:
    """Return the error to raise on ``rank`` for ``exc`` in a step: a lost peer is named by the rank that failed.

    A rank's own error is recorded in the process group's store (then returned as it is), so that
    the other ranks, whose next collective times out or loses its peer, raise a ``RuntimeError``
    naming that rank and its error instead of the transport's message. Alone nothing is recorded:

    >>> failure_of(KeyError("x"), 0, 1)
    KeyError('x')
    """
    store = _store() if world_size > 1 else None
    if store is None:
        return exc
    text = str(exc)
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
    return RuntimeError(f"rank {rank} stopped: a collective timed out or lost its peer and no other rank recorded an "
                        f"error (a rank was killed, or hangs outside the step): {text[:300]}")


# -- sharded evaluation -------------------------------------------------------------------------


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return ``(start, stop)`` of ``rank``'s contiguous slice of ``n`` items (sizes differ by at most 1).

    Slices in rank order cover ``range(n)`` exactly once, so gathering in rank order is dataset order.

    >>> [shard_bounds(5, r, 3) for r in range(3)]
    [(0, 1), (1, 3), (3, 5)]
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size}) with world_size >= 1")
    if n < 0:
        raise ValueError(f"n={n} items must be >= 0")
    return n * rank // world_size, n * (rank + 1) // world_size


@attrs.frozen
class _Shard:
    """A contiguous slice of a dataset, indexable like a dataset."""

    dataset: Any
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of this shard of {len(self)} items")
        return self.dataset[self.start + index]


def shard(dataset: Any, rank: int, world_size: int, multiple_of: int = 1) -> Sequence[Any]:
    """Return ``rank``'s contiguous slice of ``dataset`` (a sized, indexable dataset) as a dataset.

    Every rank must get at least one item, so ``len(dataset) >= world_size``. With ``multiple_of``
    only the first ``len(dataset)`` rounded down to a multiple of it are split (HF's eval
    ``dataloader_drop_last`` under several ranks drops the last global batch that is not whole:
    pass the eval batch times the world size).

    >>> [list(shard(list("abcde"), r, 2)) for r in range(2)]
    [['a', 'b'], ['c', 'd', 'e']]
    >>> [list(shard(list("abcde"), r, 2, multiple_of=2)) for r in range(2)]
    [['a', 'b'], ['c', 'd']]
    """
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"cannot shard a {type(dataset).__name__} without __len__ and __getitem__; evaluate it whole on "
            "every rank, or give a map-style dataset"
        )
    if len(dataset) < world_size:
        raise ValueError(
            f"an eval set of {len(dataset)} items cannot give each of {world_size} ranks one; "
            "evaluate it on every rank unsharded, or use more eval data"
        )
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of={multiple_of!r} must be a positive int")
    n = len(dataset) // multiple_of * multiple_of
    if n < world_size:
        raise ValueError(
            f"an eval set of {len(dataset)} items, cut to a multiple of {multiple_of} (drop_last), leaves {n}: it "
            f"cannot give each of {world_size} ranks one; use more eval data, a smaller eval batch or drop_last=False"
        )
    return _Shard(dataset, *shard_bounds(n, rank, world_size))


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8


def _meta(t: Tensor | None) -> Tensor:
    """Encode presence, dtype and shape of ``t`` in a fixed-size int64 vector."""
    meta = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64)
    if t is None:
        return meta
    if t.dim() == 0 or t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(f"cannot gather a {t.dtype} tensor of shape {tuple(t.shape)}: it needs 1 to {_MAX_DIMS} "
                         f"dims (rows first) and one of the dtypes {[str(d) for d in _DTYPES]}")
    meta[0], meta[1], meta[2] = 1, _DTYPES.index(t.dtype), t.dim()
    meta[3 : 3 + t.dim()] = torch.tensor(t.shape)
    return meta


def gather_rows(tensor: Tensor | None, collective: GatherCollective, pad_index: float = IGNORE_INDEX) -> Tensor | None:
    """Concatenate every rank's rows in rank order, right-padding dim 1 with ``pad_index``; the same on every rank.

    Like ``reducers.pad_concat`` of the ranks' tensors. A rank with nothing passes ``None``; the
    result is ``None`` when every rank does. Dtypes and dims after the first two must agree.

    >>> gather_rows(torch.tensor([[1, 2], [3, 4]]), SingleProcess()).tolist()
    [[1, 2], [3, 4]]
    """
    metas = collective.all_gather(_meta(tensor))
    present = [m for m in metas if int(m[0])]
    if not present:
        return None
    kinds = {(int(m[1]), int(m[2]), tuple(m[5 : 3 + int(m[2])].tolist())) for m in present}
    if len(kinds) > 1:
        shown = sorted((str(_DTYPES[d]), n, rest) for d, n, rest in kinds)
        raise ValueError(
            f"ranks hold tensors that cannot be concatenated (dtype, dims, trailing shape): {shown}; "
            "make every rank return the same dtype and trailing dims"
        )
    dtype_index, ndim, _ = kinds.pop()
    dims = torch.stack([m[3 : 3 + ndim] for m in present]).amax(0)
    rows = [int(m[3]) if int(m[0]) else 0 for m in metas]
    full = (max(rows), *dims[1:].tolist())
    local = tensor if tensor is not None else torch.empty((0, *full[1:]), dtype=_DTYPES[dtype_index])
    padded = local.new_full(full, pad_index) if ndim >= 2 else local.new_zeros(full)
    padded[tuple(slice(0, s) for s in local.shape)] = local
    pieces = collective.all_gather(padded)
    return torch.cat([p[:n] for p, n in zip(pieces, rows)])


@attrs.frozen(eq=False)
class _Outputs:
    """One rank's evaluation of its shard: the loss accumulator and the concatenated tensors."""

    loss_acc: Any
    labelled: int
    samples: int
    batches: int
    predictions: Any
    label_ids: Tensor | None


def _run_shard(model_or_forward: Any, params: Any, batches: Iterable[Mapping[str, Any]], *, loss: Callable[..., Tensor],
               gather: bool, preprocess: Any, label_key: str, buffers: Any, predictions_of: Callable[[Any], Any]) -> _Outputs:
    forward, params = resolve_forward(model_or_forward, params, buffers)
    count_items = counter_for(loss)
    first = next(iter(params.values()), None)
    device = first.device if isinstance(first, Tensor) else None
    pairs, preds, labels, samples, batch_count = [], [], [], 0, 0
    mode = train_mode(model_or_forward, False) if isinstance(model_or_forward, nn.Module) else contextlib.nullcontext()
    with mode, torch.inference_mode():
        for batch in batches:
            batch = {k: v.to(device) if device is not None and isinstance(v, Tensor) else v for k, v in batch.items()}
            y = batch.get(label_key)
            outputs = forward(params, {k: v for k, v in batch.items() if k != label_key})
            batch_count += 1
            samples += next((int(v.shape[0]) for v in batch.values() if isinstance(v, Tensor) and v.dim() > 0), 0)
            if y is not None:
                n = torch.as_tensor(count_items(y)).reshape(()).to(torch.int64)
                pairs.append((loss(outputs, y, n).detach().double() * n.double(), n))  # the exact sum, as evaluate does
            if gather:
                p = predictions_of(outputs)
                preds.append(preprocess(p, y) if preprocess is not None else p)
                if y is not None:
                    labels.append(y)
    acc = fold(mean_loss(), [(s.cpu(), n.cpu()) for s, n in pairs])
    return _Outputs(acc, len(pairs), samples, batch_count, pad_concat(preds) if preds else None,
                    pad_concat(labels) if labels else None)


def _merge(out: _Outputs, collective: GatherCollective, gather: bool, runtime: float) -> dict[str, Any]:
    """Merge the ranks' outputs: loss accumulators with ``mean_loss().merge``, tensors gathered in rank order."""
    total, count = out.loss_acc
    row = torch.tensor([total.item()], dtype=torch.float64)
    counts = torch.tensor([int(count), out.labelled, out.samples, out.batches], dtype=torch.int64)
    sums = [r.reshape(()) for r in collective.all_gather(row)]
    parts = collective.all_gather(counts)
    reducer = mean_loss()
    merged = merge_all(reducer, [(s, p[0]) for s, p in zip(sums, parts)])
    labelled, samples, batches = (int(sum(int(p[i]) for p in parts)) for i in (1, 2, 3))
    slowest = torch.tensor([runtime], dtype=torch.float64)
    collective.max_([slowest])
    merged_out: dict[str, Any] = {"loss": reducer.complete(merged), "labelled": labelled, "samples": samples,
                                  "batches": batches, "runtime": float(slowest)}
    if gather:
        merged_out["predictions"] = _gather_tree(out.predictions, collective)
        merged_out["label_ids"] = gather_rows(out.label_ids, collective)
    return merged_out


def _gather_tree(tree: Any, collective: GatherCollective) -> Any:
    if tree is None or isinstance(tree, Tensor):
        return gather_rows(tree, collective)
    if isinstance(tree, Mapping):
        return {k: _gather_tree(v, collective) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_gather_tree(v, collective) for v in tree)
    raise TypeError(f"cannot gather predictions of type {type(tree).__name__}: return tensors or tuples/dicts of them")


def _sharded(model_or_forward: Any, params: Any, batches: Iterable[Mapping[str, Any]], collective: GatherCollective,
             *, gather: bool, compute_metrics: Any, prefix: str, as_numpy: bool, speed_metrics: bool,
             **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    # What evaluate_sharded and predict_sharded share: run this rank's shard, merge the ranks, make the metrics.
    start = time.perf_counter()
    out = _run_shard(model_or_forward, params, batches, gather=gather, **options)
    merged = _merge(out, collective, gather, time.perf_counter() - start)
    speed = throughput(merged["runtime"], merged["samples"], merged["batches"]) if speed_metrics else None
    loss = merged["loss"] if merged["labelled"] else None
    return merged, final_metrics(merged, loss, compute_metrics, prefix=prefix, as_numpy=as_numpy, speed=speed)


def evaluate_sharded(
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    collective: GatherCollective | None,
    loss: Callable[..., Tensor] = causal_lm,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    prediction_loss_only: bool = False,
    metric_key_prefix: str = "eval",
    label_key: str = "labels",
    buffers: Mapping[str, Tensor] | None = None,
    predictions_of: Callable[[Any], Any] = logits_of,
    as_numpy: bool = True,
    speed_metrics: bool = True,
    eval_accumulation_steps: int | None = None,
) -> dict[str, float]:
    """Evaluate this rank's shard (``batches``, from :func:`shard`) and return the whole eval set's metrics.

    Every rank must call it, with the batches of its own contiguous shard. The eval loss is the
    token-level mean over all ranks: each rank's ``(loss sum, item count)`` accumulator is merged
    with ``mean_loss``'s ``merge``, never an average of averages. With ``compute_metrics``, the
    (preprocessed) predictions and labels are gathered in rank order, i.e. dataset order, and
    ``compute_metrics`` sees the whole set on every rank, so every rank returns the same metrics.
    ``collective=None`` is one process: it is ``evaluation.evaluate`` (which also takes
    ``eval_accumulation_steps``; sharded predictions stay on their device until gathered).

    >>> forward = lambda params, inputs: torch.nn.functional.embedding(inputs["input"], params["weight"])
    >>> params = {"weight": torch.zeros(5, 5)}
    >>> batches = [{"input": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}]
    >>> m = evaluate_sharded(forward, params, batches, collective=SingleProcess(), speed_metrics=False)
    >>> round(m["eval_loss"], 4)  # ln 5, over the 2 labels left after the causal shift
    1.6094
    """
    if collective is None:
        return evaluate(model_or_forward, params, batches, loss=loss, compute_metrics=compute_metrics,
                        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                        eval_accumulation_steps=eval_accumulation_steps, prediction_loss_only=prediction_loss_only,
                        metric_key_prefix=metric_key_prefix, label_key=label_key, buffers=buffers,
                        predictions_of=predictions_of, as_numpy=as_numpy, speed_metrics=speed_metrics)
    if prediction_loss_only and compute_metrics is not None:
        raise ValueError("prediction_loss_only=True gathers no predictions, so compute_metrics would never run; "
                         "drop one of them")
    _, metrics = _sharded(model_or_forward, params, batches, collective, gather=compute_metrics is not None,
                          compute_metrics=compute_metrics, prefix=metric_key_prefix, as_numpy=as_numpy,
                          speed_metrics=speed_metrics, loss=loss, preprocess=preprocess_logits_for_metrics,
                          label_key=label_key, buffers=buffers, predictions_of=predictions_of)
    return metrics


def predict_sharded(
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    collective: GatherCollective | None,
    loss: Callable[..., Tensor] = causal_lm,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    metric_key_prefix: str = "test",
    label_key: str = "labels",
    buffers: Mapping[str, Tensor] | None = None,
    predictions_of: Callable[[Any], Any] = logits_of,
    as_numpy: bool = True,
    speed_metrics: bool = True,
) -> PredictionOutput:
    """Return the whole set's predictions and labels in dataset order, and its metrics, from this rank's shard.

    As :func:`evaluate_sharded`, but predictions are always gathered (on every rank);
    ``collective=None`` is ``evaluation.predict``.

    >>> forward = lambda params, inputs: params["weight"][inputs["input"]]
    >>> batches = [{"input": torch.tensor([[0, 1]]), "labels": torch.tensor([[0, 1]])}]
    >>> out = predict_sharded(forward, {"weight": torch.eye(2)}, batches, collective=SingleProcess(), speed_metrics=False)
    >>> out.predictions.tolist(), out.label_ids.tolist()
    ([[[1.0, 0.0], [0.0, 1.0]]], [[0, 1]])
    """
    if collective is None:
        return predict(model_or_forward, params, batches, loss=loss, compute_metrics=compute_metrics,
                       preprocess_logits_for_metrics=preprocess_logits_for_metrics, metric_key_prefix=metric_key_prefix,
                       label_key=label_key, buffers=buffers, predictions_of=predictions_of, as_numpy=as_numpy,
                       speed_metrics=speed_metrics)
    merged, metrics = _sharded(model_or_forward, params, batches, collective, gather=True,
                               compute_metrics=compute_metrics, prefix=metric_key_prefix, as_numpy=as_numpy,
                               speed_metrics=speed_metrics, loss=loss, preprocess=preprocess_logits_for_metrics,
                               label_key=label_key, buffers=buffers, predictions_of=predictions_of)
    conv = to_numpy if as_numpy else (lambda x: x)
    return PredictionOutput(conv(merged["predictions"]), conv(merged["label_ids"]), metrics)
