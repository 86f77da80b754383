"""``trainfold.checkpoint``: :mod:`trainfold.ckpt` under its top-level name.

Checkpoints: save, load, rotation, the run directory.
"""

from trainfold.ckpt import *  # noqa: F403
from trainfold.ckpt import __all__  # noqa: F401
