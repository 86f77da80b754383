"""``trainfold.sft``: :mod:`trainfold.hf.sft` under its top-level name.

SFT in one place: TRL's row preparation and collator, ``SFTArguments`` and the run ``train``.
"""

from trainfold.hf.sft import *  # noqa: F403
from trainfold.hf.sft import __all__ as _hf_all
from trainfold.hf.sft_trainer import SFTTrainer  # the facade, for moving a TRL script by its import

__all__ = [*_hf_all, "SFTTrainer"]
