"""``KTOTrainer``: TRL ``KTOTrainer``'s shape over ``trainfold.kto.train``, built as ``trainfold.dpo.DPOTrainer``
(``trainfold.trainer.facade.ReferenceTrainer``) with KTO's pieces: ``args`` a ``KTOArguments`` or a ``trl.KTOConfig``,
unpaired rows, the reference fixed when the trainer is built. New code calls ``trainfold.kto.train``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainfold.kto.args import KTOArguments
from trainfold.kto.run import kto_reference_objective, prepare_unpaired_dataset, unpaired_collator
from trainfold.kto.run import train as kto_train
from trainfold.trainer.facade import ReferenceTrainer
from trainfold.trainer.trl_runs import policy_model

__all__ = ["KTOTrainer"]


def _collator(model: nn.Module, args: KTOArguments, processing_class: Any) -> Any:
    return unpaired_collator(args, processing_class)


class KTOTrainer(ReferenceTrainer[KTOArguments]):
    """TRL ``KTOTrainer``'s constructor and methods over ``trainfold.kto.train`` (see the module doc)."""

    own_collator = "the run pads unpaired rows itself (max_length and pad_to_multiple_of in KTOArguments)"
    run = staticmethod(kto_train)
    load_model = staticmethod(policy_model)  # loaded by name, wrapped by PEFT, dropout off
    reference_objective = staticmethod(kto_reference_objective)
    prepare = staticmethod(prepare_unpaired_dataset)
    scoring_collator = staticmethod(_collator)
