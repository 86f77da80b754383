"""``trainfold.distributed``: :mod:`trainfold.dist` under its top-level name.

The process group and the collectives of the pure path.
"""

from trainfold.aliases import moved_names
from trainfold.dist import *  # noqa: F403
from trainfold.dist import __all__  # noqa: F401

__getattr__ = moved_names(
    __name__,
    {
        "evaluate_sharded": ("trainfold.evaluation", "evaluate_sharded"),
        "predict_sharded": ("trainfold.evaluation", "predict_sharded"),
        "gather_rows": ("trainfold.evaluation", "gather_rows"),
    },
)
