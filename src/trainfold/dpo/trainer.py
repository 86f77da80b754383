"""``DPOTrainer``: TRL ``DPOTrainer``'s shape over ``trainfold.dpo.train``, for moving scripts by their import.

It takes ``DPOTrainer``'s keywords (``model`` a module or a name, ``ref_model``, ``args`` a ``DPOArguments``
or the script's own ``trl.DPOConfig``, ``peft_config``...) and has ``trainfold.Trainer``'s methods. As TRL's,
the reference is fixed when the trainer is built (``ref_model``, else the model as given), so ``evaluate``
after ``train`` scores against it. No logic of its own: new code calls ``trainfold.dpo.train``.
"""

from __future__ import annotations

from typing import Any

from trainfold.dpo.args import DPOArguments
from trainfold.dpo.run import policy_model, preference_collator, prepare_preference_dataset, reference_objective
from trainfold.dpo.run import train as dpo_train
from trainfold.trainer.facade import PeerTrainer, peer_keywords

__all__ = ["DPOTrainer"]


class DPOTrainer(PeerTrainer):
    """TRL ``DPOTrainer``'s constructor and methods over ``trainfold.dpo.train`` (see the module doc)."""

    arguments_class = DPOArguments
    keywords = peer_keywords(
        before_args=("ref_model",),
        without=("compute_loss_func", "optimizer_cls_and_kwargs", "preprocess_logits_for_metrics"),
    )
    own_collator = (
        "the run pads preference rows itself (pad_token, max_length, pad_to_multiple_of, padding_free in DPOArguments)"
    )
    run_name = "DPO"
    run = staticmethod(dpo_train)
    load_model = staticmethod(policy_model)

    def _finish(self, given: Any, **rest: Any) -> None:
        ref_model = rest["ref_model"]
        if isinstance(ref_model, str):
            ref_model = policy_model(ref_model, self._loading(self.args, ref_model, given))
        self.ref_model = ref_model
        self.objective = reference_objective(self.model, self.args, ref_model)  # the reference as the trainer is built

    def _eval_rows(self, dataset: Any) -> Any:
        return prepare_preference_dataset(dataset, self.processing_class, self.args)

    def _scoring(self) -> dict[str, Any]:
        collate, _ = preference_collator(self.model, self.args, self.processing_class)
        return {**super()._scoring(), "data_collator": collate, "objective": self.objective}
