"""``trainfold.reporters``: :mod:`trainfold.observe.reporters` under its top-level name.

The reporters: jsonl, tensorboard, trackio, wandb, the console.
"""

from trainfold.observe.reporters import *  # noqa: F403
from trainfold.observe.reporters import __all__  # noqa: F401
