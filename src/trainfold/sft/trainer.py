"""``SFTTrainer``: TRL ``SFTTrainer``'s shape over ``trainfold.sft.train``, for moving scripts by their import.

It takes ``SFTTrainer``'s keywords (``model`` a module or a name, loaded with ``args.model_init_kwargs`` and
wrapped by ``peft_config`` when it is built, as TRL does; ``args`` an ``SFTArguments`` or the script's own
``trl.SFTConfig``; ``formatting_func``...) and has ``trainfold.Trainer``'s methods: ``train`` is
``trainfold.sft.train``, ``evaluate``/``predict`` score rows prepared as the run prepares them. No logic of
its own: new code calls ``trainfold.sft.train``.
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold.sft.args import SFTArguments
from trainfold.sft.data import sft_loss
from trainfold.sft.run import default_collator, prepare_eval_dataset
from trainfold.sft.run import train as sft_train
from trainfold.trainer.facade import Trainer, arguments_for, init_kwargs, model_name_of, refused_keywords
from trainfold.trainer.model_source import model_from, processing_class_for
from trainfold.trainer.train import TrainResult

__all__ = ["SFTTrainer"]

_INIT = attrs.fields(SFTArguments).model_init_kwargs  # the from_pretrained keywords of a model given by name


class SFTTrainer(Trainer):
    """TRL ``SFTTrainer``'s constructor and methods over ``trainfold.sft.train`` (see the module doc)."""

    arguments_class = SFTArguments

    def __init__(
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Any = None,
    ) -> None:
        refused_keywords(
            dict(
                optimizers=optimizers,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                quantization_config=quantization_config,
            )
        )
        given, args = args, arguments_for(args, SFTArguments, f"{model_name_of(model)}-SFT")
        module = model_from(model, init_kwargs(model, given, _INIT), peft_config, args.seed)
        super().__init__(
            module,
            args,
            data_collator,
            train_dataset,
            eval_dataset,
            processing_class_for(module, processing_class),  # as TRL: the tokenizer saved with the model
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.formatting_func = formatting_func

    def _run(self, resume_from_checkpoint: Any) -> TrainResult:
        given = dict(
            compute_loss_func=self.compute_loss_func,
            compute_metrics=self.compute_metrics,
            preprocess_logits_for_metrics=self.preprocess_logits_for_metrics,
        )
        return sft_train(
            self.model,
            self.args.replace(model_init_kwargs=None),  # the model was loaded with them
            self.train_dataset,
            self.eval_dataset,
            self.processing_class,
            data_collator=self.data_collator,
            callbacks=self.callbacks,
            formatting_func=self.formatting_func,
            resume_from_checkpoint=resume_from_checkpoint,
            **{k: v for k, v in given.items() if v is not None},  # None: the run's own (sft_loss)
        )

    def _eval_rows(self, dataset: Any) -> Any:
        return prepare_eval_dataset(dataset, self.processing_class, self.args, self.formatting_func)

    def _scoring(self) -> dict[str, Any]:
        return {
            **super()._scoring(),
            "data_collator": default_collator(self.processing_class, self.args, self.data_collator),
            "compute_loss_func": self.compute_loss_func or sft_loss,
        }
