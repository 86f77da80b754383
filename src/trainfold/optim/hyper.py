"""Tensor hyperparameters: find the ones an optimizer holds that require grad (what only a differentiable step keeps).

A hyperparameter may be a tensor (``sgd(torch.tensor(0.1, requires_grad=True))``): the update then
computes with it, and a step built with ``make_step(..., differentiable=True)`` keeps the graph
through the update, so a later loss has a gradient with respect to it. Any other step detaches the
update from the graph; :func:`grad_hyperparameters` lets it refuse such an optimizer by name instead.

>>> import torch
>>> from trainfold.optim import sgd
>>> grad_hyperparameters(sgd(torch.tensor(0.1, requires_grad=True), momentum=0.9))
['sgd.schedule.<value>']
>>> grad_hyperparameters(sgd(0.1))
[]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from torch import Tensor

__all__ = ["grad_hyperparameters"]


def grad_hyperparameters(optimizer: Any) -> list[str]:
    """Return where ``optimizer`` holds tensors that require grad: its fields, and the values its schedules close over.

    Each place is named by the path from the optimizer (``sgd.schedule.<value>``: the
    ``value`` a constant schedule closes over). A schedule's globals are not searched: pass a tensor
    hyperparameter in (a closure, an argument) rather than reading it from a module's namespace.

    >>> import torch
    >>> from trainfold.optim import chain, scale_by_learning_rate, trace
    >>> def halving(lr):
    ...     return lambda step: lr * 0.5**step
    >>> grad_hyperparameters(chain(trace(), scale_by_learning_rate(halving(torch.tensor(0.1, requires_grad=True)))))
    ['chain.parts[1].schedule.<lr>']
    """
    found: list[str] = []
    _walk(optimizer, getattr(optimizer, "name", type(optimizer).__name__), found, set())
    return found


def _walk(node: Any, path: str, found: list[str], seen: set[int]) -> None:
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, Tensor):
        if node.requires_grad:
            found.append(path)
        return
    if attrs.has(type(node)):
        for field in attrs.fields(type(node)):
            if field.init:
                _walk(getattr(node, field.name), f"{path}.{field.name}", found, seen)
    elif isinstance(node, Mapping):
        for key, value in node.items():
            _walk(value, f"{path}[{key!r}]", found, seen)
    elif isinstance(node, (tuple, list)):
        for i, value in enumerate(node):
            _walk(value, f"{path}[{i}]", found, seen)
    elif hasattr(node, "update") and hasattr(node, "init") and not isinstance(node, type):  # a custom transformation
        for name, value in vars(node).items():
            _walk(value, f"{path}.{name}", found, seen)
    elif callable(node):  # a schedule or a custom update: the values its closure holds
        code = getattr(node, "__code__", None)
        cells = getattr(node, "__closure__", None) or ()
        names = code.co_freevars if code is not None else ()
        for name, cell in zip(names, cells):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            _walk(value, f"{path}.<{name}>", found, seen)
