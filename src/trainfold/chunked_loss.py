"""``trainfold.chunked_loss``: :mod:`trainfold.core.chunked_loss` under its top-level name.

The chunked causal-LM cross-entropy.
"""

from trainfold.core.chunked_loss import *  # noqa: F403
from trainfold.core.chunked_loss import __all__  # noqa: F401
