"""``trainfold.tree``: :mod:`trainfold.core.tree` under its top-level name.

Pure operations on dicts of tensors.
"""

from trainfold.core.tree import *  # noqa: F403
from trainfold.core.tree import __all__  # noqa: F401
