"""``GRPOTrainer``: TRL ``GRPOTrainer``'s shape over ``trainfold.grpo.train``, for moving scripts by their import.

It takes ``GRPOTrainer``'s keywords (``model`` a module or a name, ``reward_funcs``, ``args`` a
``GRPOArguments`` or the script's own ``trl.GRPOConfig``, ``train_dataset``/``eval_dataset`` of prompts,
``peft_config``...) and has ``trainfold.Trainer``'s methods after training. The run evaluates its
``eval_dataset`` during ``train`` (``eval_strategy``); ``evaluate``/``predict`` after it are refused by name.
No logic of its own: new code calls ``trainfold.grpo.train``.
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold.grpo.args import GRPOArguments
from trainfold.grpo.run import train as grpo_train
from trainfold.trainer.facade import Trainer, arguments_for, init_kwargs, model_name_of, refuse, refused_keywords
from trainfold.trainer.model_source import model_from, processing_class_for
from trainfold.trainer.train import TrainResult

__all__ = ["GRPOTrainer"]

_INIT = attrs.fields(GRPOArguments).model_init_kwargs  # the from_pretrained keywords of a model given by name

_EVALUATION = (
    "GRPO scores its eval_dataset during train: set eval_strategy (and eval_steps) and read eval_reward... "
    "in trainer.state.log_history"
)


class GRPOTrainer(Trainer):
    """TRL ``GRPOTrainer``'s constructor and methods over ``trainfold.grpo.train`` (see the module doc)."""

    arguments_class = GRPOArguments

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        refused_keywords(
            dict(
                optimizers=optimizers,
                quantization_config=quantization_config,
                reward_processing_classes=reward_processing_classes,
                tools=tools,
                rollout_func=rollout_func,
                environment_factory=environment_factory,
            )
        )
        given, args = args, arguments_for(args, GRPOArguments, f"{model_name_of(model)}-GRPO")
        module = model_from(model, init_kwargs(model, given, _INIT), peft_config, seed=args.seed)
        tok = processing_class_for(module, processing_class)
        super().__init__(module, args, None, train_dataset, eval_dataset, tok, callbacks=callbacks)
        self.reward_funcs = reward_funcs

    def _run(self, resume_from_checkpoint: Any) -> TrainResult:
        return grpo_train(
            self.model,
            self.args,
            self.train_dataset,
            self.reward_funcs,
            eval_prompts=self.eval_dataset,
            processing_class=self.processing_class,
            callbacks=self.callbacks,
            resume_from_checkpoint=resume_from_checkpoint,
        )

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Refused: GRPO evaluates during ``train``."""
        refuse("GRPOTrainer.evaluate", _EVALUATION)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: GRPO generates; it has no predictions to return."""
        refuse("GRPOTrainer.predict", "generate with trainfold.core.generate, or evaluate during train: " + _EVALUATION)
