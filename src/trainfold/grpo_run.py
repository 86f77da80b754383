"""``trainfold.grpo_run``: :mod:`trainfold.hf.grpo_run` under its top-level name.

The GRPO run.
"""

from trainfold.hf.grpo_run import *  # noqa: F403
from trainfold.hf.grpo_run import (
    __all__,  # noqa: F401
    __getattr__,  # noqa: F401  (the names that moved, with a DeprecationWarning)
)
