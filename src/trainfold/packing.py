"""``trainfold.packing``: :mod:`trainfold.data.packing` under its top-level name.

Packing documents into rows, and the padding-free collators.
"""

from trainfold.data.packing import *  # noqa: F403
from trainfold.data.packing import __all__  # noqa: F401
