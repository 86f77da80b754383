"""``trainfold.generate``: :mod:`trainfold.recipes.generate` under its top-level name.

Sampling completions from a causal LM.
"""

from trainfold.recipes.generate import *  # noqa: F403
from trainfold.recipes.generate import __all__  # noqa: F401
