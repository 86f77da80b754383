"""What a run is made of, as plain values: ``shape(plan)`` for comparing two plans (``tests/test_settings.py``).

Functions are compared by name and what they close over, modules by their ``repr``, datasets by their
rows; the arguments object itself and its ``settings`` dict are left out, so a setting shows only
through what ``plan_for`` made of it.
"""

from __future__ import annotations

import functools
import re
import types
from typing import Any

import attrs
import torch

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_SKIP = {"args", "settings", "collective"}


def shape(obj: Any, depth: int = 0, seen: frozenset[int] = frozenset()) -> Any:
    """Return ``obj`` as nested plain values (see the module doc)."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if depth > 14 or id(obj) in seen:
        return "..."
    seen = seen | {id(obj)}
    go = functools.partial(_go, depth=depth + 1, seen=seen)
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), obj.detach().flatten()[:64].tolist())
    if isinstance(obj, (torch.device, torch.dtype)):
        return str(obj)
    if isinstance(obj, torch.nn.Module):
        return ("module", _ADDRESS.sub("", repr(obj)), obj.training, go(getattr(obj, "config", None)))
    if isinstance(obj, type):
        return obj.__qualname__
    if attrs.has(type(obj)):
        return (
            type(obj).__qualname__,
            {f.name: go(getattr(obj, f.name)) for f in attrs.fields(type(obj)) if f.name not in _SKIP},
        )
    if isinstance(obj, dict):
        return {str(k): go(v) for k, v in obj.items() if k not in _SKIP}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else list(obj)
        return [go(x) for x in items[:64]]
    if isinstance(obj, functools.partial):
        return ("partial", go(obj.func), go(obj.args), go(obj.keywords))
    if isinstance(obj, types.MethodType):
        return ("method", obj.__func__.__qualname__, go(obj.__self__))
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        return ("function", obj.__qualname__, go(cells), go(obj.__defaults__), go(obj.__kwdefaults__))
    if type(obj).__module__.startswith("datasets"):
        return ("dataset", [go(r) for r in list(obj)[:64]])
    if hasattr(obj, "__dict__") and not isinstance(obj, types.ModuleType):
        return (type(obj).__qualname__, go(dict(vars(obj))))
    if hasattr(obj, "__slots__"):
        return (type(obj).__qualname__, {s: go(getattr(obj, s, None)) for s in obj.__slots__})
    return _ADDRESS.sub("", repr(obj))


def _go(obj: Any, depth: int, seen: frozenset[int]) -> Any:
    return shape(obj, depth, seen)


def _filled(cell: Any) -> bool:
    try:
        return cell.cell_contents is not _filled  # an empty cell raises
    except ValueError:
        return False


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Return where the plain values ``a`` and ``b`` differ (paths), for an error message."""
    if type(a) is not type(b):
        return [path or "."]
    if isinstance(a, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [path or "."]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "."]
