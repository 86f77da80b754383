"""``GRPOTrainer``: TRL ``GRPOTrainer``'s shape over ``trainfold.grpo.train``, for moving scripts by their import.

It takes ``GRPOTrainer``'s keywords (``model`` a module or a name, ``reward_funcs``, ``args`` a
``GRPOArguments`` or the script's own ``trl.GRPOConfig``, ``train_dataset``/``eval_dataset`` of prompts,
``peft_config``...) and has ``trainfold.Trainer``'s methods after training. It samples completions as TRL's
does, from torch's global generator in TRL's order (``generation_rng=None`` becomes ``"global"``;
``trainfold.grpo.global_rng``), so a script's completions and losses are TRL's. The run evaluates its
``eval_dataset`` during ``train`` (``eval_strategy``); ``evaluate``/``predict`` after it are refused by name.
No logic of its own: new code calls ``trainfold.grpo.train``.
"""

from __future__ import annotations

from typing import Any

from trainfold.grpo.args import GRPOArguments
from trainfold.grpo.run import train as grpo_train
from trainfold.trainer.facade import PeerTrainer, refuse
from trainfold.trainer.train import TrainResult

__all__ = ["GRPOTrainer"]

_EVALUATION = (
    "GRPO scores its eval_dataset during train: set eval_strategy (and eval_steps) and read eval_reward... "
    "in trainer.state.log_history"
)


class GRPOTrainer(PeerTrainer):
    """TRL ``GRPOTrainer``'s constructor and methods over ``trainfold.grpo.train`` (see the module doc)."""

    arguments_class = GRPOArguments
    keywords = (
        "model",
        "reward_funcs",
        "args",
        "train_dataset",
        "eval_dataset",
        "processing_class",
        "reward_processing_classes",
        "callbacks",
        "optimizers",
        "quantization_config",
        "peft_config",
        "tools",
        "rollout_func",
        "environment_factory",
    )
    required = ("model", "reward_funcs")
    refused = (*PeerTrainer.refused, "reward_processing_classes", "tools", "rollout_func", "environment_factory")
    run_name = "GRPO"
    reward_funcs: Any  # kept by _finish

    def _run(self, resume_from_checkpoint: Any) -> TrainResult:
        args = self.args
        if args.generation_rng is None:  # TRL's: completions drawn from torch's global generator, in TRL's order
            args = args.replace(generation_rng="global")
        return grpo_train(
            self.model,
            args,
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
