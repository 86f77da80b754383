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

from trainfold.core.moved import moved_names

__all__ = ["moved_names"]
