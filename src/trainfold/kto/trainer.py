"""``KTOTrainer``: TRL ``KTOTrainer``'s shape over ``trainfold.kto.train``, for moving scripts by their import.

It takes ``KTOTrainer``'s keywords (``model`` a module or a name, ``ref_model``, ``args`` a ``KTOArguments``
or the script's own ``trl.KTOConfig``, ``peft_config``...) and has ``trainfold.Trainer``'s methods. As TRL's,
the reference is fixed when the trainer is built (``ref_model``, else the model as given), so ``evaluate``
after ``train`` scores against it. No logic of its own: new code calls ``trainfold.kto.train``.
"""

from __future__ import annotations

from typing import Any

from trainfold.kto.args import KTOArguments
from trainfold.kto.run import kto_model, kto_reference_objective, prepare_unpaired_dataset, unpaired_collator
from trainfold.kto.run import train as kto_train
from trainfold.trainer.facade import PeerTrainer, peer_keywords

__all__ = ["KTOTrainer"]


class KTOTrainer(PeerTrainer):
    """TRL ``KTOTrainer``'s constructor and methods over ``trainfold.kto.train`` (see the module doc)."""

    arguments_class = KTOArguments
    keywords = peer_keywords(
        before_args=("ref_model",),
        without=("compute_loss_func", "optimizer_cls_and_kwargs", "preprocess_logits_for_metrics"),
    )
    own_collator = "the run pads unpaired rows itself (max_length and pad_to_multiple_of in KTOArguments)"
    run_name = "KTO"
    run = staticmethod(kto_train)
    load_model = staticmethod(kto_model)

    def _finish(self, given: Any, **rest: Any) -> None:
        ref_model = rest["ref_model"]
        if isinstance(ref_model, str):
            ref_model = kto_model(ref_model, self._loading(self.args, ref_model, given))
        self.ref_model = ref_model
        self.objective = kto_reference_objective(
            self.model, self.args, ref_model
        )  # the reference as the trainer is built

    def _eval_rows(self, dataset: Any) -> Any:
        return prepare_unpaired_dataset(dataset, self.processing_class, self.args)

    def _scoring(self) -> dict[str, Any]:
        collate = unpaired_collator(self.args, self.processing_class)
        return {**super()._scoring(), "data_collator": collate, "objective": self.objective}
