"""DPO in one place (``trainfold.dpo``): the recipe's pieces, ``DPOArguments`` and the run ``train``.

The pieces (collator, losses, objective, reference precompute) come from :mod:`trainfold.dpo.objective`,
TRL's tokenization from :mod:`trainfold.dpo.data`; ``DPOArguments`` (TRL's ``DPOConfig`` names)
from :mod:`trainfold.dpo.args`; the run, :func:`train`, from :mod:`trainfold.dpo.run`.

>>> from trainfold import dpo
>>> dpo.train is dpo.run.train, dpo.dpo_objective(0.1, ["sigmoid", "sft"]).loss_type
(True, ('sigmoid', 'sft'))
"""

from trainfold.dpo import args as dpo_args
from trainfold.dpo import run as dpo_run
from trainfold.dpo.args import DPOArguments
from trainfold.dpo.data import preference_row, preference_rows
from trainfold.dpo.loss import dpo_loss_errors
from trainfold.dpo.objective import (
    LOSS_TYPES,
    PREFERENCE_COLUMNS,
    DPOObjective,
    PreferenceCollate,
    dpo_loss,
    dpo_objective,
    precompute_ref_logps,
    preference_collate,
)
from trainfold.dpo.run import prepare_preference_dataset, train
from trainfold.dpo.trainer import DPOTrainer  # the facade, for moving a TRL script by its import

__all__ = [
    "DPOTrainer",
    "LOSS_TYPES",
    "PREFERENCE_COLUMNS",
    "DPOArguments",
    "DPOObjective",
    "PreferenceCollate",
    "dpo_args",
    "dpo_loss",
    "dpo_loss_errors",
    "dpo_objective",
    "dpo_run",
    "precompute_ref_logps",
    "preference_collate",
    "preference_row",
    "preference_rows",
    "prepare_preference_dataset",
    "train",
]
