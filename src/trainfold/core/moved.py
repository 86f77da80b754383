"""Old names kept for a while: a module ``__getattr__`` that finds a moved name under its new one, warning.

Lives in ``core`` so that every layer can keep its own old names (``trainfold.aliases`` re-exports it).

>>> import warnings
>>> getattr_ = moved_names("trainfold.x", {"old": ("trainfold.core.moved", "moved_names")})
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     fn = getattr_("old")
>>> fn is moved_names, str(caught[0].message)
(True, 'trainfold.x.old moved: use trainfold.core.moved.moved_names')
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names"]


def moved_names(module: str, moved: Mapping[str, tuple[str, str]]) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` that finds each ``moved`` name (old name -> (new module, new name)), warning."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, new = moved[name]
        warnings.warn(f"{module}.{name} moved: use {home}.{new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), new)

    return __getattr__
