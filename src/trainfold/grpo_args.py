"""``trainfold.grpo_args``: :mod:`trainfold.hf.grpo_args` under its top-level name.

GRPOArguments (TRL's GRPOConfig names).
"""

from trainfold.hf.grpo_args import *  # noqa: F403
from trainfold.hf.grpo_args import __all__  # noqa: F401
