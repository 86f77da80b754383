"""``trainfold.reducers``: :mod:`trainfold.eval.reducers` under its top-level name.

Reducers and transducers.
"""

from trainfold.eval.reducers import *  # noqa: F403
from trainfold.eval.reducers import __all__  # noqa: F401
