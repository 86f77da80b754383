"""``trainfold.schedules``: :mod:`trainfold.optim.schedules` under its top-level name.

Learning-rate schedules as functions of the step.
"""

from trainfold.optim.schedules import *  # noqa: F403
from trainfold.optim.schedules import __all__  # noqa: F401
