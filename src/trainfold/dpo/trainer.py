"""``DPOTrainer``: TRL ``DPOTrainer``'s shape over ``trainfold.dpo.train``, for moving scripts by their import.

It takes ``DPOTrainer``'s keywords (``model`` a module or a name, ``ref_model``, ``args`` a ``DPOArguments``
or the script's own ``trl.DPOConfig``, ``peft_config``...) and has ``trainfold.Trainer``'s methods. As TRL's,
the reference is fixed when the trainer is built (``ref_model``, else the model as given), so ``evaluate``
after ``train`` scores against it. No logic of its own: new code calls ``trainfold.dpo.train``.
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold.dpo.args import DPOArguments
from trainfold.dpo.run import policy_model, preference_collator, prepare_preference_dataset, reference_objective
from trainfold.dpo.run import train as dpo_train
from trainfold.trainer.facade import Trainer, arguments_for, init_kwargs, model_name_of, refused_keywords
from trainfold.trainer.model_source import processing_class_for
from trainfold.trainer.train import TrainResult

__all__ = ["DPOTrainer"]

_INIT = attrs.fields(DPOArguments).model_init_kwargs  # the from_pretrained keywords of a model given by name


class DPOTrainer(Trainer):
    """TRL ``DPOTrainer``'s constructor and methods over ``trainfold.dpo.train`` (see the module doc)."""

    arguments_class = DPOArguments

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        refused_keywords(dict(optimizers=optimizers, quantization_config=quantization_config))
        if data_collator is not None:
            raise TypeError(
                "DPOTrainer(data_collator=...) is not supported by trainfold's facade: the run pads preference rows "
                "itself (pad_token, max_length, pad_to_multiple_of, padding_free in DPOArguments)"
            )
        given, args = args, arguments_for(args, DPOArguments, f"{model_name_of(model)}-DPO")
        module = policy_model(model, args.replace(model_init_kwargs=init_kwargs(model, given, _INIT)), peft_config)
        if isinstance(ref_model, str):
            ref_model = policy_model(ref_model, args.replace(model_init_kwargs=init_kwargs(ref_model, given, _INIT)))
        tok = processing_class_for(module, processing_class)
        super().__init__(
            module, args, None, train_dataset, eval_dataset, tok, compute_metrics=compute_metrics, callbacks=callbacks
        )
        self.ref_model = ref_model
        self.objective = reference_objective(module, args, ref_model)  # the reference as the trainer is built

    def _run(self, resume_from_checkpoint: Any) -> TrainResult:
        return dpo_train(
            self.model,
            self.args.replace(model_init_kwargs=None),  # the model was loaded with them
            self.train_dataset,
            self.eval_dataset,
            self.processing_class,
            callbacks=self.callbacks,
            objective=self.objective,
            compute_metrics=self.compute_metrics,
            resume_from_checkpoint=resume_from_checkpoint,
        )

    def _eval_rows(self, dataset: Any) -> Any:
        return prepare_preference_dataset(dataset, self.processing_class, self.args)

    def _scoring(self) -> dict[str, Any]:
        collate, _ = preference_collator(self.model, self.args, self.processing_class)
        return {**super()._scoring(), "data_collator": collate, "objective": self.objective}
