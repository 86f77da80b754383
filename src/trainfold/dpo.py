"""``trainfold.dpo``: :mod:`trainfold.recipes.dpo` under its top-level name.

DPO: the objective, the preference collator, the reference log-probs.
"""

from trainfold.recipes.dpo import *  # noqa: F403
from trainfold.recipes.dpo import __all__  # noqa: F401
from trainfold.recipes.dpo_loss import dpo_loss_errors  # noqa: F401  (offered here before the restructure)
