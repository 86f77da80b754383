"""Reducers and transducers: the pieces evaluation is folded from.

A ``Reducer`` is three pure functions, ``init() -> acc``, ``step(acc, x) -> acc`` and
``complete(acc) -> result``, plus an optional associative ``merge(a, b) -> acc`` that joins the
accumulators of two consecutive runs. A transducer maps a reducer to a reducer; ``compose``
chains them so data flows left to right. A step may return ``Reduced(acc)`` to stop early.

>>> xf = compose(filtering(lambda x: x % 2 == 0), mapping(lambda x: x * 10), taking(2))
>>> transduce(xf, collecting(), range(100))
[0, 20]
>>> transduce(mapping(float), summing(), [1, 2, 3])
6.0
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import toolz
import torch
from torch import Tensor

from trainfold.core.losses import IGNORE_INDEX
from trainfold.evaluation.concat import pad_concat

__all__ = [
    "Reduced",
    "Reducer",
    "Transducer",
    "accuracy",
    "collecting",
    "combine",
    "compose",
    "concatenating",
    "counting",
    "filtering",
    "fold",
    "is_reduced",
    "mapping",
    "mean_loss",
    "merge_all",
    "offloading",
    "pad_concat",
    "summing",
    "taking",
    "transduce",
    "unreduced",
]


@attrs.frozen(eq=False)
class Reduced:
    """An accumulator marked final: a reducer's step returns it to stop the fold early.

    >>> upto_10 = Reducer(init=lambda: 0, step=lambda a, x: Reduced(a + x) if a + x >= 10 else a + x)
    >>> acc = fold(upto_10, range(100))
    >>> is_reduced(acc), acc.value                 # stopped after 0 + 1 + 2 + 3 + 4
    (True, 10)
    """

    value: Any


def is_reduced(acc: Any) -> bool:
    """Return whether ``acc`` is marked final.

    >>> is_reduced(Reduced(1)), is_reduced(1)
    (True, False)
    """
    return isinstance(acc, Reduced)


def unreduced(acc: Any) -> Any:
    """Return ``acc`` without its ``Reduced`` mark, if it has one.

    >>> unreduced(Reduced(3)), unreduced(3)
    (3, 3)
    """
    return acc.value if isinstance(acc, Reduced) else acc


@attrs.frozen
class Reducer:
    """A fold as a value: ``init() -> acc``, ``step(acc, x) -> acc``, ``complete(acc) -> result``.

    ``merge(a, b)``, when given, joins the accumulators of two consecutive parts of the input,
    so that ``complete(merge(fold(xs), fold(ys))) == complete(fold(xs + ys))``.

    >>> r = Reducer(init=lambda: 0, step=lambda a, x: a + x, complete=str, merge=lambda a, b: a + b)
    >>> r.complete(r.merge(fold(r, [1, 2]), fold(r, [3])))
    '6'
    """

    init: Callable[[], Any]
    step: Callable[[Any, Any], Any]
    complete: Callable[[Any], Any] = lambda acc: acc
    merge: Callable[[Any, Any], Any] | None = None


Transducer = Callable[[Reducer], Reducer]


def compose(*xforms: Transducer) -> Transducer:
    """Chain transducers so that items flow through ``xforms`` from left to right.

    >>> transduce(compose(mapping(lambda x: x + 1), mapping(lambda x: x * 2)), collecting(), [1])
    [4]

    Transducers are functions of reducers, so this is function composition (``toolz.compose``): the
    first transducer wraps the others, hence sees each item first.
    """
    return toolz.compose(*xforms)


def mapping(f: Callable[[Any], Any]) -> Transducer:
    """Apply ``f`` to every item before the reducer sees it.

    >>> transduce(mapping(abs), collecting(), [-1, 2])
    [1, 2]
    """

    def xform(r: Reducer) -> Reducer:
        return attrs.evolve(r, step=lambda acc, x: r.step(acc, f(x)))

    return xform


def filtering(pred: Callable[[Any], bool]) -> Transducer:
    """Pass on only the items for which ``pred`` holds.

    >>> transduce(filtering(bool), collecting(), [0, 1, 0, 2])
    [1, 2]
    """

    def xform(r: Reducer) -> Reducer:
        return attrs.evolve(r, step=lambda acc, x: r.step(acc, x) if pred(x) else acc)

    return xform


def taking(n: int) -> Transducer:
    """Pass on the first ``n`` items, then stop the fold without drawing another item.

    >>> transduce(taking(2), collecting(), iter(range(10**9)))
    [0, 1]
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"taking(n) needs a count n >= 0, got {n!r}")

    def xform(r: Reducer) -> Reducer:
        def init() -> Any:
            acc = (n, r.init())
            return Reduced(acc) if n == 0 else acc

        def step(acc: Any, x: Any) -> Any:
            left, inner = acc
            inner = r.step(inner, x)
            if is_reduced(inner):
                return Reduced((left - 1, inner.value))
            return Reduced((0, inner)) if left <= 1 else (left - 1, inner)

        return Reducer(init=init, step=step, complete=lambda acc: r.complete(acc[1]))

    return xform


def offloading(every: int | None, move: Callable[[Any], Any] | None = None) -> Transducer:
    """Hold at most ``every`` items, then move them as one padded chunk to the host.

    Items (tensors or nested tuples/lists/dicts of tensors, e.g. one batch's predictions) wait in
    a buffer on their device; each full buffer, and what is left at completion, is moved piece by
    piece with ``move`` (default: to the CPU), right-padded with -100 and concatenated there, and
    passed on as one item. So the device holds at most ``every`` items, nothing is re-concatenated
    on the device, and every element is copied once per chunk. ``every=None`` moves only at the end.

    >>> chunks = transduce(offloading(2), collecting(), [torch.zeros(1, 2), torch.ones(1, 3), torch.ones(2, 1)])
    >>> [c.shape[0] for c in chunks], chunks[0].tolist()
    ([2, 2], [[0.0, 0.0, -100.0], [1.0, 1.0, 1.0]])
    """
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ValueError(f"offloading needs every >= 1 (or None to move only at the end), got {every!r}")
    move_piece = move or (lambda t: t.to("cpu"))

    def flush(pending: Any) -> Any:
        return pad_concat(_cons_to_list(pending), move=move_piece)

    def xform(r: Reducer) -> Reducer:
        # acc = (items waiting, cons list of them, inner acc): appending is O(1), so no quadratic copying
        def step(acc: Any, x: Any) -> Any:
            waiting, pending, inner = acc
            waiting, pending = waiting + 1, (pending, x)
            if every is None or waiting < every:
                return (waiting, pending, inner)
            inner = r.step(inner, flush(pending))
            return Reduced((0, None, inner.value)) if is_reduced(inner) else (0, None, inner)

        def complete(acc: Any) -> Any:
            waiting, pending, inner = acc
            if waiting:
                inner = unreduced(r.step(inner, flush(pending)))
            return r.complete(inner)

        return Reducer(init=lambda: (0, None, r.init()), step=step, complete=complete)

    return xform


_FRESH = object()  # a marker: "start from reducer.init()" (None is a valid accumulator)


def fold(reducer: Reducer, items: Iterable[Any], acc: Any = _FRESH) -> Any:
    """Step ``reducer`` over ``items`` from ``acc`` (default ``reducer.init()``) without completing.

    The result may be ``Reduced``; folding on from a ``Reduced`` accumulator draws nothing more,
    so ``fold(r, ys, fold(r, xs))`` equals ``fold(r, xs + ys)``.

    >>> fold(summing(), [3], fold(summing(), [1, 2]))
    6
    """
    acc = reducer.init() if acc is _FRESH else acc
    if is_reduced(acc):
        return acc
    for x in items:
        acc = reducer.step(acc, x)
        if is_reduced(acc):
            break
    return acc


def transduce(xform: Transducer, reducer: Reducer, items: Iterable[Any]) -> Any:
    """Fold ``items`` through ``xform(reducer)`` and return the completed result.

    >>> transduce(mapping(lambda x: x * x), summing(), range(4))
    14
    """
    r = xform(reducer)
    return r.complete(unreduced(fold(r, items)))


def merge_all(reducer: Reducer, accs: Iterable[Any]) -> Any:
    """Merge the accumulators of consecutive parts, left to right, with ``reducer.merge``.

    >>> r = summing()
    >>> r.complete(merge_all(r, [fold(r, [1]), fold(r, [2, 3])]))
    6
    """
    if reducer.merge is None:
        raise TypeError("this reducer has no merge: build it from reducers that all define merge")
    out = reducer.init()
    for acc in accs:
        out = reducer.merge(out, acc)
    return out


# Provided reducers ---------------------------------------------------------------------------


def collecting() -> Reducer:
    """Collect items into a list (a persistent cons list while folding, so steps stay pure).

    >>> transduce(mapping(str), collecting(), [1, 2])
    ['1', '2']
    """
    return Reducer(init=lambda: None, step=lambda acc, x: (acc, x), complete=_cons_to_list, merge=_cons_append)


def _cons_to_list(acc: Any) -> list[Any]:
    out = []
    while acc is not None:
        acc, x = acc
        out.append(x)
    out.reverse()
    return out


def _cons_append(a: Any, b: Any) -> Any:
    for x in _cons_to_list(b):
        a = (a, x)
    return a


def summing() -> Reducer:
    """Add the items up (numbers or tensors of one shape).

    >>> transduce(compose(), summing(), [0.5, 0.25])
    0.75
    """
    return Reducer(init=lambda: 0, step=lambda acc, x: acc + x, merge=lambda a, b: a + b)


def counting() -> Reducer:
    """Count the items.

    >>> transduce(filtering(lambda x: x > 1), counting(), [1, 2, 3])
    2
    """
    return Reducer(init=lambda: 0, step=lambda acc, x: acc + 1, merge=lambda a, b: a + b)


def mean_loss() -> Reducer:
    """Average a loss over items: step on ``(loss_sum, item_count)`` pairs; the result is a float.

    The token-level mean ``sum of losses / number of items``, not a mean of per-batch means, so it
    does not depend on how the items were batched. Sums are kept in float64. With no items the
    result is NaN.

    >>> transduce(compose(), mean_loss(), [(torch.tensor(3.0), 1), (torch.tensor(3.0), 3)])
    1.5
    """

    def step(acc: tuple[Tensor, Tensor], x: tuple[Any, Any]) -> tuple[Tensor, Tensor]:
        total, count = acc
        loss_sum, n = x
        loss_sum = torch.as_tensor(loss_sum).detach().reshape(())
        n = torch.as_tensor(n).detach().reshape(())
        return total.to(loss_sum.device) + loss_sum.double(), count.to(n.device) + n.to(torch.int64)

    def complete(acc: tuple[Tensor, Tensor]) -> float:
        total, count = acc
        return float(total) / int(count) if int(count) else float("nan")

    def merge(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return a[0] + b[0].to(a[0].device), a[1] + b[1].to(a[1].device)

    zeros = lambda: (torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64))
    return Reducer(init=zeros, step=step, complete=complete, merge=merge)


def accuracy(ignore_index: int = IGNORE_INDEX) -> Reducer:
    """Share of correct predictions: step on ``(predicted_ids, labels)``; labels equal to ``ignore_index`` do not count.

    >>> transduce(compose(), accuracy(), [(torch.tensor([1, 2, 0]), torch.tensor([1, 0, -100]))])
    0.5
    """

    def step(acc: tuple[int, int], x: tuple[Tensor, Tensor]) -> tuple[Any, Any]:
        preds, labels = (torch.as_tensor(t) for t in x)
        if preds.shape != labels.shape:
            raise ValueError(
                f"accuracy needs predicted ids shaped like the labels, got {tuple(preds.shape)} and "
                f"{tuple(labels.shape)}; reduce logits with argmax(-1) first (preprocess_logits_for_metrics)"
            )
        valid = labels != ignore_index
        return acc[0] + ((preds == labels) & valid).sum().cpu(), acc[1] + valid.sum().cpu()

    def complete(acc: tuple[Any, Any]) -> float:
        return int(acc[0]) / int(acc[1]) if int(acc[1]) else float("nan")

    return Reducer(init=lambda: (0, 0), step=step, complete=complete, merge=lambda a, b: (a[0] + b[0], a[1] + b[1]))


def concatenating(pad_index: float = IGNORE_INDEX) -> Reducer:
    """Concatenate batches along dim 0, right-padding dim 1 with ``pad_index``, once at completion.

    Items are tensors or nested tuples/lists/dicts of tensors of one structure. Steps only link
    the items (no copying); the single padded concatenation happens in ``complete``. No items
    complete to ``None``.

    >>> out = transduce(mapping(torch.tensor), concatenating(), [[[1, 2]], [[3]]])
    >>> out.tolist()
    [[1, 2], [3, -100]]
    """
    cons = collecting()

    def complete(acc: Any) -> Any:
        items = _cons_to_list(acc)
        return pad_concat(items, pad_index) if items else None

    return attrs.evolve(cons, complete=complete)


def combine(reducers: Mapping[str, Reducer]) -> Reducer:
    """Run several reducers over the same items; the result is a dict of their results.

    Stops early only when every part has stopped. ``merge`` exists when every part has one.

    >>> r = combine({"n": counting(), "total": summing()})
    >>> transduce(compose(), r, [1, 2, 3])
    {'n': 3, 'total': 6}
    """
    parts = dict(reducers)

    def step(acc: dict[str, Any], x: Any) -> Any:
        out = {k: a if is_reduced(a) else parts[k].step(a, x) for k, a in acc.items()}
        return Reduced(out) if out and all(is_reduced(a) for a in out.values()) else out

    def complete(acc: dict[str, Any]) -> dict[str, Any]:
        return {k: parts[k].complete(unreduced(a)) for k, a in acc.items()}

    merge = None
    if all(r.merge is not None for r in parts.values()):

        def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
            return {k: parts[k].merge(unreduced(a[k]), unreduced(b[k])) for k in parts}  # type: ignore[misc]

    return Reducer(init=lambda: {k: r.init() for k, r in parts.items()}, step=step, complete=complete, merge=merge)
