"""``trainfold.samplers``: :mod:`trainfold.data.samplers` under its top-level name.

Samplers: pure functions of (seed, epoch).
"""

from trainfold.data.samplers import *  # noqa: F403
from trainfold.data.samplers import __all__  # noqa: F401
