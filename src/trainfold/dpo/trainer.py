"""``DPOTrainer``: TRL ``DPOTrainer``'s shape over ``trainfold.dpo.train``, for moving scripts by their import.

It takes ``DPOTrainer``'s keywords (``model`` a module or a name, ``ref_model``, ``args`` a ``DPOArguments``
or the script's own ``trl.DPOConfig``, ``peft_config``...) and has ``trainfold.Trainer``'s methods. As TRL's,
the reference is fixed when the trainer is built (``ref_model``, else the model as given), so ``evaluate``
after ``train`` scores against it. No logic of its own: new code calls ``trainfold.dpo.train``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainfold.dpo.args import DPOArguments
from trainfold.dpo.run import preference_collator, prepare_preference_dataset, reference_objective
from trainfold.dpo.run import train as dpo_train
from trainfold.trainer.facade import ReferenceTrainer
from trainfold.trainer.trl_runs import policy_model

__all__ = ["DPOTrainer"]


def _collator(model: nn.Module, args: DPOArguments, processing_class: Any) -> Any:
    return preference_collator(model, args, processing_class)[0]


class DPOTrainer(ReferenceTrainer[DPOArguments]):
    """TRL ``DPOTrainer``'s constructor and methods over ``trainfold.dpo.train`` (see the module doc)."""

    own_collator = (
        "the run pads preference rows itself (pad_token, max_length, pad_to_multiple_of, padding_free in DPOArguments)"
    )
    run = staticmethod(dpo_train)
    load_model = staticmethod(policy_model)
    reference_objective = staticmethod(reference_objective)
    prepare = staticmethod(prepare_preference_dataset)
    scoring_collator = staticmethod(_collator)
