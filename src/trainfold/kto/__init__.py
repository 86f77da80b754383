"""KTO in one place (``trainfold.kto``): TRL 1.16 ``KTOTrainer``'s semantics as a recipe and a run.

The pieces: unpaired rows and their tokenization (:mod:`trainfold.kto.rows`), the collator
(:mod:`trainfold.kto.collate`), the loss and the KL estimate (:mod:`trainfold.kto.loss`), the objective
(:mod:`trainfold.kto.objective`), the precomputed reference (:mod:`trainfold.kto.reference`);
``KTOArguments`` (TRL's ``KTOConfig`` names, :mod:`trainfold.kto.args`) and the run :func:`train`.

>>> from trainfold import kto
>>> kto.kto_objective(0.1, "apo_zero_unpaired").calculate_kl, kto.KTO_LOSS_TYPES
(False, ('kto', 'apo_zero_unpaired'))
"""

from trainfold.kto.args import KTOArguments
from trainfold.kto.collate import REF_COLUMNS, UnpairedCollate, unpaired_collate
from trainfold.kto.loss import KTO_LOSS_TYPES, kl_estimate, kto_loss, kto_loss_errors
from trainfold.kto.objective import KTOObjective, kto_objective
from trainfold.kto.reference import unpaired_logps, unpaired_reference_logps, with_reference_logps
from trainfold.kto.rows import KL_COLUMN, UNPAIRED_COLUMNS, unpair, unpaired_row, unpaired_rows, with_kl_completions
from trainfold.kto.run import prepare_unpaired_dataset, train
from trainfold.kto.trainer import KTOTrainer  # the facade, for moving a TRL script by its import

__all__ = [
    "KL_COLUMN",
    "KTO_LOSS_TYPES",
    "REF_COLUMNS",
    "UNPAIRED_COLUMNS",
    "KTOArguments",
    "KTOObjective",
    "KTOTrainer",
    "UnpairedCollate",
    "kl_estimate",
    "kto_loss",
    "kto_loss_errors",
    "kto_objective",
    "prepare_unpaired_dataset",
    "unpaired_reference_logps",
    "unpaired_logps",
    "train",
    "unpair",
    "unpaired_collate",
    "unpaired_row",
    "unpaired_rows",
    "with_kl_completions",
    "with_reference_logps",
]
