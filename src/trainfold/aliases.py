"""The top-level module names (``trainfold.losses``, ``trainfold.checkpoint`` ...) and the names that moved out of them.

Each top-level module name is a real module that re-exports the module which owns its names, so
``from trainfold.losses import causal_lm`` and ``import trainfold.samplers`` work. A name that moved
up to the layer it belongs to is still found under its old module, with a ``DeprecationWarning``
naming its new home.

>>> import warnings
>>> getattr_ = moved_names("trainfold.losses", {"dpo": ("trainfold.dpo", "dpo_loss")})
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     fn = getattr_("dpo")
>>> fn.__name__, str(caught[0].message)
('dpo', 'trainfold.losses.dpo moved: use trainfold.dpo.dpo_loss')
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
