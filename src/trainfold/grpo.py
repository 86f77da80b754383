"""``trainfold.grpo``: :mod:`trainfold.hf.grpo` under its top-level name.

GRPO in one place: the recipe's pieces, GRPOArguments and the run train.
"""

from trainfold.hf.grpo import *  # noqa: F403
from trainfold.hf.grpo import __all__  # noqa: F401
