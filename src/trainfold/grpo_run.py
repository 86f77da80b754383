"""``trainfold.grpo_run``: :mod:`trainfold.hf.grpo_run` under its top-level name.

The GRPO run.
"""

from trainfold.hf.grpo_run import *  # noqa: F403
from trainfold.hf.grpo_run import __all__  # noqa: F401
