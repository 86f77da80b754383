"""``trainfold.compiled``: :mod:`trainfold.step.compiled` under its top-level name.

The compiled step.
"""

from trainfold.step.compiled import *  # noqa: F403
from trainfold.step.compiled import __all__  # noqa: F401
