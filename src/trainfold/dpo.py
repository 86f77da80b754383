"""``trainfold.dpo``: :mod:`trainfold.hf.dpo` under its top-level name.

DPO in one place: the objective, the preference collator, the reference log-probs, ``DPOArguments``
and the run ``train``.
"""

from trainfold.hf.dpo import *  # noqa: F403
from trainfold.hf.dpo import (
    __all__,  # noqa: F401
    __getattr__,  # noqa: F401  (the names that moved, with a DeprecationWarning)
)
