"""``trainfold.grpo``: :mod:`trainfold.hf.grpo` under its top-level name.

GRPO in one place: the recipe's pieces, GRPOArguments and the run train.
"""

from trainfold.hf.grpo import *  # noqa: F403
from trainfold.hf.grpo import __all__ as _hf_all
from trainfold.hf.grpo_trainer import GRPOTrainer  # the facade, for moving a TRL script by its import

__all__ = [*_hf_all, "GRPOTrainer"]
