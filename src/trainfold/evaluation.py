"""``trainfold.evaluation``: :mod:`trainfold.eval` under its top-level name.

Evaluate and predict as reducer pipelines.
"""

from trainfold.eval import *  # noqa: F403
from trainfold.eval import __all__  # noqa: F401
