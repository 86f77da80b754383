"""``trainfold.losses``: :mod:`trainfold.core.losses` under its top-level name.

Loss functions loss(outputs, labels, num_items_in_batch).
"""

from trainfold.aliases import moved_names
from trainfold.core.losses import *  # noqa: F403
from trainfold.core.losses import __all__  # noqa: F401

__getattr__ = moved_names(
    __name__,
    {
        "dpo": ("trainfold.dpo", "dpo_loss"),
        "dpo_loss_errors": ("trainfold.dpo", "dpo_loss_errors"),
        "DPO_LOSS_TYPES": ("trainfold.dpo", "LOSS_TYPES"),
    },
)
