"""``trainfold.compiled``: :mod:`trainfold.step.compiled` under its top-level name.

The compiled step.
"""

from trainfold.aliases import moved_names
from trainfold.step.compiled import *  # noqa: F403
from trainfold.step.compiled import __all__  # noqa: F401

__getattr__ = moved_names(
    __name__,
    {
        "OptimizerPlan": ("trainfold.optim", "OptimizerPlan"),
        "adamw_update": ("trainfold.optim", "adamw_update"),
        "optimizer_plan": ("trainfold.optim", "optimizer_plan"),
    },
)
