"""``trainfold.reducers``: :mod:`trainfold.evaluation.reducers` under its top-level name.

Reducers and transducers.
"""

from trainfold.evaluation.reducers import *  # noqa: F403
from trainfold.evaluation.reducers import __all__  # noqa: F401
