"""Pure operations on parameter trees: ``dict[str, Tensor]`` and records built from them.

Every function here returns new tensors and leaves its inputs untouched.

>>> import torch
>>> t = {"w": torch.tensor([3.0]), "b": torch.tensor([4.0])}
>>> global_norm(t).item()
5.0
>>> scale(t, 2.0)["w"].tolist()
[6.0]
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

Tree = dict[str, Tensor]

__all__ = [
    "Tree",
    "tree_map",
    "zeros_like",
    "add",
    "scale",
    "global_norm",
    "known_norm",
    "known_or_global_norm",
    "check_keys",
    "flatten",
    "unflatten",
    "map_tensors",
    "map_tensors_with_path",
    "register_record",
]


def tree_map(fn: Callable[..., Tensor], tree: Mapping[str, Tensor], *rest: Mapping[str, Tensor]) -> Tree:
    """Apply ``fn`` leaf-wise over trees that share keys.

    >>> import torch
    >>> tree_map(lambda a, b: a - b, {"x": torch.tensor(3.0)}, {"x": torch.tensor(1.0)})["x"].item()
    2.0
    """
    for other in rest:
        check_keys(tree, other, "first tree", "other tree")
    return {k: fn(v, *(r[k] for r in rest)) for k, v in tree.items()}


def zeros_like(tree: Mapping[str, Tensor]) -> Tree:
    """Return a tree of zeros shaped like ``tree``.

    >>> import torch
    >>> zeros_like({"a": torch.ones(2)})["a"].tolist()
    [0.0, 0.0]
    """
    return {k: torch.zeros_like(v) for k, v in tree.items()}


def add(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tree:
    """Return ``a + b`` leaf-wise.

    >>> import torch
    >>> add({"a": torch.tensor(1.0)}, {"a": torch.tensor(2.0)})["a"].item()
    3.0
    """
    check_keys(a, b, "a", "b")
    keys = list(a)
    return dict(zip(keys, torch._foreach_add([a[k] for k in keys], [b[k] for k in keys])))


def scale(tree: Mapping[str, Tensor], factor: float | Tensor) -> Tree:
    """Return ``tree * factor`` leaf-wise.

    >>> import torch
    >>> scale({"a": torch.tensor(1.5)}, 2)["a"].item()
    3.0
    """
    keys = list(tree)
    if not keys:
        return {}
    return dict(zip(keys, torch._foreach_mul([tree[k] for k in keys], factor)))


# (gradients, their norm) a step computed for its log, for the clipping to reuse (known_norm)
_KNOWN_NORM: contextvars.ContextVar[tuple[object, Tensor] | None] = contextvars.ContextVar("known_norm", default=None)


@contextlib.contextmanager
def known_norm(tree: Mapping[str, Tensor] | None, norm: Tensor | None = None) -> Iterator[None]:
    """Within the block, ``known_or_global_norm(tree)`` of this very mapping is ``norm`` (``tree=None``: none is).

    The step computes the gradients' norm for its log, then lets the optimizer's clipping reuse it. Only
    the built-in clipping asks, and a chain forgets the norm after its first part (which may have changed
    the gradients in place), so nothing can see a stale one.

    >>> import torch
    >>> grads = {"a": torch.tensor([3.0, 4.0])}
    >>> with known_norm(grads, torch.tensor(5.0)):
    ...     known_or_global_norm(grads).item(), known_or_global_norm(dict(grads)).item()
    (5.0, 5.0)
    """
    token = _KNOWN_NORM.set(None if tree is None or norm is None else (tree, norm))
    try:
        yield
    finally:
        _KNOWN_NORM.reset(token)


def known_or_global_norm(tree: Mapping[str, Tensor]) -> Tensor:
    """Return the norm ``known_norm`` gives for this very mapping, else ``global_norm(tree)``."""
    known = _KNOWN_NORM.get()
    return known[1] if known is not None and known[0] is tree else global_norm(tree)


def global_norm(tree: Mapping[str, Tensor] | Iterable[Tensor]) -> Tensor:
    """Return the 2-norm of all leaves taken together, as a 0-d float32 tensor.

    Computed like ``torch.nn.utils.clip_grad_norm_``: the norm of the per-tensor norms.

    >>> import torch
    >>> global_norm([torch.tensor([1.0, 2.0]), torch.tensor([2.0])]).item()
    3.0
    """
    leaves = list(tree.values()) if isinstance(tree, Mapping) else list(tree)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(leaves, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)


def check_keys(got: Mapping[str, Any], expected: Mapping[str, Any], got_name: str, expected_name: str) -> None:
    """Raise ``KeyError`` naming missing and unexpected keys when two trees differ.

    >>> check_keys({"a": 1}, {"a": 2}, "grads", "params")
    >>> check_keys({"w": 1}, {"b": 2}, "grads", "params")
    Traceback (most recent call last):
    ...
    KeyError: "grads and params have different keys: missing ['b'], unexpected ['w']"
    """
    if got.keys() == expected.keys():
        return
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    raise KeyError(f"{got_name} and {expected_name} have different keys: missing {missing}, unexpected {unexpected}")


# -- flattening records to dotted keys (the checkpoint format) ------------------------------------


def flatten(node: Any, prefix: str = "") -> Tree:
    """Flatten a record of tensors, dicts, tuples and attrs records to ``{dotted.key: Tensor}``.

    Keys are ``prefix`` + field names, dict keys and tuple indices joined by dots. ``None``
    leaves are dropped (the template restores them).

    >>> import torch
    >>> sorted(flatten({"a": torch.tensor(1), "b": (torch.tensor(2), {"c": torch.tensor(3)})}))
    ['a', 'b.0', 'b.1.c']
    """
    out: Tree = {}
    _flatten_into(node, prefix, out)
    return out


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _flatten_into(node: Any, prefix: str, out: Tree) -> None:
    if node is None:
        return
    if isinstance(node, Tensor):
        out[prefix] = node
    elif attrs.has(type(node)):
        for field in attrs.fields(type(node)):
            _flatten_into(getattr(node, field.name), _join(prefix, field.name), out)
    elif isinstance(node, Mapping):
        for k, v in node.items():
            _flatten_into(v, _join(prefix, k), out)
    elif isinstance(node, (tuple, list)):
        for i, v in enumerate(node):
            _flatten_into(v, _join(prefix, i), out)
    else:
        raise TypeError(
            f"cannot flatten {type(node).__name__} at {prefix or '<root>'!r}: a state record may hold "
            "only tensors, dicts of tensors, tuples and attrs records; keep configuration in closures"
        )


def unflatten(flat: Mapping[str, Tensor], like: Any, prefix: str = "") -> Any:
    """Rebuild a record shaped like the template ``like`` from ``flat`` (inverse of ``flatten``).

    Raises ``KeyError`` naming every missing and unexpected key, and ``ValueError`` naming
    every tensor whose shape or dtype differs from the template.

    >>> import torch
    >>> like = {"w": torch.zeros(2), "n": (torch.tensor(0),)}
    >>> out = unflatten({"w": torch.ones(2), "n.0": torch.tensor(7)}, like)
    >>> out["w"].tolist(), out["n"][0].item()
    ([1.0, 1.0], 7)
    """
    expected = flatten(like, prefix)
    check_keys(flat, expected, "the loaded tensors", "the template")
    bad = [
        f"{k}: loaded {tuple(flat[k].shape)} {flat[k].dtype}, expected {tuple(v.shape)} {v.dtype}"
        for k, v in expected.items()
        if flat[k].shape != v.shape or flat[k].dtype != v.dtype
    ]
    if bad:
        raise ValueError("loaded tensors do not match the template:\n  " + "\n  ".join(bad))
    return map_tensors_with_path(lambda path, t: flat[path].to(t.device), like, prefix)


def map_tensors(fn: Callable[..., Any], node: Any, *rest: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of a nested record, returning a record of the same shape.

    Dicts, lists, tuples, namedtuples and attrs records are rebuilt (attrs by ``evolve`` on their
    init fields); other leaves (``None``, numbers, strings) are kept. With ``rest``, the records
    must have ``node``'s structure and ``fn`` gets the matching leaves of all of them.

    >>> import torch
    >>> out = map_tensors(lambda t: t * 2, {"a": torch.tensor(1), "b": [torch.tensor(2), None, "x"]})
    >>> out["a"].item(), out["b"][0].item(), out["b"][1:]
    (2, 4, [None, 'x'])
    >>> map_tensors(torch.add, (torch.tensor(1),), (torch.tensor(2),))[0].item()
    3
    """
    return _map(fn, node, rest, None)


def map_tensors_with_path(fn: Callable[[str, Tensor], Any], node: Any, prefix: str = "") -> Any:
    """Apply ``fn(path, tensor)`` to every tensor leaf, ``path`` being its :func:`flatten` key.

    The record is rebuilt as by :func:`map_tensors`; :func:`unflatten` is this with the loaded tensors.

    >>> import torch
    >>> map_tensors_with_path(lambda path, t: path, {"a": torch.tensor(1), "b": (torch.tensor(2),)})
    {'a': 'a', 'b': ('b.0',)}
    """
    return _map(fn, node, (), prefix)


def _map(fn: Callable[..., Any], node: Any, rest: Sequence[Any], path: str | None) -> Any:
    """The one walker of nested records: ``fn(leaf, *rest_leaves)``, or ``fn(path, leaf)`` when ``path`` is a str."""
    if isinstance(node, Tensor):
        return fn(node, *rest) if path is None else fn(path, node)

    def at(key: Any) -> str | None:
        return None if path is None else _join(path, key)

    if attrs.has(type(node)):
        changes = {
            f.name: _map(fn, getattr(node, f.name), [getattr(r, f.name) for r in rest], at(f.name))
            for f in attrs.fields(type(node))
            if f.init
        }
        return attrs.evolve(node, **changes)
    if isinstance(node, Mapping):
        return {k: _map(fn, v, [r[k] for r in rest], at(k)) for k, v in node.items()}
    if isinstance(node, (tuple, list)):
        items = [_map(fn, v, [r[i] for r in rest], at(i)) for i, v in enumerate(node)]
        if hasattr(node, "_fields"):  # namedtuple
            return type(node)(*items)
        return type(node)(items)
    return node


# -- records as pytree nodes (torch.utils._pytree: what torch.func and torch.compile flatten) --------------


def register_record(cls: type) -> type:
    """Register the attrs record class ``cls`` as a pytree node of ``torch.utils._pytree`` and return it.

    Its children are its init fields, in order, keyed by name (``GetAttrKey``), so ``tree_map``,
    ``torch.func`` transforms and ``torch.compile`` reach every tensor inside. Flattening a record
    first registers the attrs records it holds (an optimizer state, the records in ``extras``), so one
    registered root covers the records nested in it. Registering twice is a no-op.

    >>> import attrs, torch
    >>> @register_record
    ... @attrs.frozen(eq=False)
    ... class Pair:
    ...     a: torch.Tensor
    ...     b: dict
    >>> leaves, spec = pytree.tree_flatten(Pair(torch.tensor(1), {"c": torch.tensor(2)}))
    >>> [t.item() for t in leaves], pytree.tree_unflatten([t * 10 for t in leaves], spec).b["c"].item()
    ([1, 2], 20)
    """
    if not attrs.has(cls):
        raise TypeError(f"register_record takes an attrs record class, got {cls!r}")
    if cls in pytree.SUPPORTED_NODES:
        return cls
    names = tuple(f.name for f in attrs.fields(cls) if f.init)

    def flatten_fn(record: Any) -> tuple[list[Any], tuple[str, ...]]:
        children = [getattr(record, n) for n in names]
        for child in children:
            _register_nested(child)
        return children, names

    def flatten_with_keys_fn(record: Any) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
        children, context = flatten_fn(record)
        return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children)], context

    def unflatten_fn(children: Iterable[Any], context: tuple[str, ...]) -> Any:
        return cls(**dict(zip(context, children)))

    pytree.register_pytree_node(
        cls,
        flatten_fn,
        unflatten_fn,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys_fn,
    )
    return cls


def _register_nested(node: Any) -> None:
    """Register every attrs record class reachable from ``node`` through dicts, lists and tuples."""
    if isinstance(node, Tensor) or node is None:
        return
    if attrs.has(type(node)):
        register_record(type(node))  # its own flatten registers what it holds
    elif isinstance(node, Mapping):
        for v in node.values():
            _register_nested(v)
    elif isinstance(node, (tuple, list)):
        for v in node:
            _register_nested(v)
