"""DPO in one place (``trainfold.dpo``): the recipe's pieces, ``DPOArguments`` and the run ``train``.

The pieces (collator, losses, objective, reference precompute) come from :mod:`trainfold.recipes.dpo`,
TRL's tokenization from :mod:`trainfold.recipes.dpo_data`; ``DPOArguments`` (TRL's ``DPOConfig`` names)
from :mod:`trainfold.hf.dpo_args`; the run, :func:`train`, from :mod:`trainfold.hf.dpo_run`.

>>> from trainfold.hf import dpo
>>> dpo.train is dpo.dpo_run.train, dpo.dpo_objective(0.1, ["sigmoid", "sft"]).loss_type
(True, ('sigmoid', 'sft'))
"""

from trainfold.core.moved import moved_names
from trainfold.hf import dpo_args, dpo_run
from trainfold.hf.dpo_args import DPOArguments
from trainfold.hf.dpo_run import prepare_preference_dataset, train
from trainfold.recipes.dpo import (
    LOSS_TYPES,
    PREFERENCE_COLUMNS,
    DPOObjective,
    PreferenceCollate,
    count_pairs,
    dpo_loss,
    dpo_objective,
    precompute_ref_logps,
    preference_collate,
    sequence_logps,
)
from trainfold.recipes.dpo_data import preference_row, preference_rows
from trainfold.recipes.dpo_loss import dpo_loss_errors

__all__ = [
    "LOSS_TYPES",
    "PREFERENCE_COLUMNS",
    "DPOArguments",
    "DPOObjective",
    "PreferenceCollate",
    "count_pairs",
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
    "sequence_logps",
    "train",
]

__getattr__ = moved_names(__name__, {"prepare_dataset": ("trainfold.hf.dpo_run", "prepare_preference_dataset")})
