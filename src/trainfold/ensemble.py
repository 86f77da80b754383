"""``trainfold.ensemble``: :mod:`trainfold.recipes.ensemble` under its top-level name.

Ensembles: many models trained by one vectorised step.
"""

from trainfold.recipes.ensemble import *  # noqa: F403
from trainfold.recipes.ensemble import __all__  # noqa: F401
