"""``trainfold.sft``: :mod:`trainfold.hf.sft` under its top-level name.

SFT in one place: TRL's row preparation and collator, ``SFTArguments`` and the run ``train``.
"""

from trainfold.hf.sft import *  # noqa: F403
from trainfold.hf.sft import __all__  # noqa: F401
