"""``trainfold.dpo``: :mod:`trainfold.hf.dpo` under its top-level name.

DPO in one place: the objective, the preference collator, the reference log-probs, ``DPOArguments``
and the run ``train``.
"""

from trainfold.hf.dpo import *  # noqa: F403
from trainfold.hf.dpo import (
    __all__ as _hf_all,
)
from trainfold.hf.dpo import (
    __getattr__,  # noqa: F401  (the names that moved, with a DeprecationWarning)
)
from trainfold.hf.dpo_trainer import DPOTrainer  # the facade, for moving a TRL script by its import

__all__ = [*_hf_all, "DPOTrainer"]
