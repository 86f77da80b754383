"""SFT in one place: TRL's row preparation and collator (``data``), ``SFTArguments`` (``args``) and the run (``run``).

>>> from trainfold import sft
>>> sft.train is sft.run.train, sft.SFTArguments().completion_only_loss is None
(True, True)
"""

from trainfold.sft.args import SFTArguments
from trainfold.sft.data import SFTCollate, sft_collate, sft_loss, sft_row, sft_rows
from trainfold.sft.run import default_collator, prepare_dataset, prepare_eval_dataset, train
from trainfold.sft.trainer import SFTTrainer

__all__ = [
    "SFTArguments",
    "SFTTrainer",
    "SFTCollate",
    "default_collator",
    "prepare_dataset",
    "prepare_eval_dataset",
    "sft_collate",
    "sft_loss",
    "sft_row",
    "sft_rows",
    "train",
]
