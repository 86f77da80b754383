"""``RewardTrainer``: TRL ``RewardTrainer``'s shape over ``trainfold.reward.train``, for moving scripts by their import.

It takes ``RewardTrainer``'s keywords (``model`` a module or a name, loaded for sequence classification with
one label; ``args`` a ``RewardArguments`` or the script's own ``trl.RewardConfig``; ``peft_config``...) and
has ``trainfold.Trainer``'s methods: ``evaluate``/``predict`` score rows prepared as the run prepares them.
No logic of its own: new code calls ``trainfold.reward.train``.
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold.reward.args import RewardArguments
from trainfold.reward.data import reward_collate
from trainfold.reward.loss import reward_objective
from trainfold.reward.run import pad_id_for, prepare_reward_dataset, reward_model
from trainfold.reward.run import train as reward_train
from trainfold.trainer.facade import Trainer, arguments_for, init_kwargs, model_name_of, refused_keywords
from trainfold.trainer.model_source import processing_class_for
from trainfold.trainer.train import TrainResult

__all__ = ["RewardTrainer"]

_INIT = attrs.fields(RewardArguments).model_init_kwargs  # the from_pretrained keywords of a model given by name


class RewardTrainer(Trainer):
    """TRL ``RewardTrainer``'s constructor and methods over ``trainfold.reward.train`` (see the module doc)."""

    arguments_class = RewardArguments

    def __init__(
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        refused_keywords(
            dict(
                optimizers=optimizers,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                quantization_config=quantization_config,
            )
        )
        given, args = args, arguments_for(args, RewardArguments, f"{model_name_of(model)}-Reward")
        module = reward_model(model, args.replace(model_init_kwargs=init_kwargs(model, given, _INIT)), peft_config)
        tok = processing_class_for(module, processing_class)
        collate = data_collator or reward_collate(pad_id_for(module, tok, args), args.pad_to_multiple_of)
        super().__init__(
            module,
            args,
            collate,
            train_dataset,
            eval_dataset,
            tok,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.objective = reward_objective(args.center_rewards_coefficient)

    def _run(self, resume_from_checkpoint: Any) -> TrainResult:
        return reward_train(
            self.model,
            self.args.replace(model_init_kwargs=None, disable_dropout=False),  # loaded (and dropout off) already
            self.train_dataset,
            self.eval_dataset,
            self.processing_class,
            data_collator=self.data_collator,
            callbacks=self.callbacks,
            objective=self.objective,
            compute_metrics=self.compute_metrics,
            preprocess_logits_for_metrics=self.preprocess_logits_for_metrics,
            resume_from_checkpoint=resume_from_checkpoint,
        )

    def _eval_rows(self, dataset: Any) -> Any:
        return prepare_reward_dataset(dataset, self.processing_class, self.args)

    def _scoring(self) -> dict[str, Any]:
        return {**super()._scoring(), "objective": self.objective}
