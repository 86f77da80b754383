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

__all__ = ["GRPOTrainer"]

_EVALUATION = (
    "GRPO scores its eval_dataset during train: set eval_strategy (and eval_steps) and read eval_reward... "
    "in trainer.state.log_history"
)


class GRPOTrainer(PeerTrainer[GRPOArguments]):
    """TRL ``GRPOTrainer``'s constructor and methods over ``trainfold.grpo.train`` (see the module doc)."""

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
    run = staticmethod(grpo_train)  # train_dataset=/eval_dataset=: TRL's names of its prompts and eval prompts
    run_extras = ("reward_funcs",)
    reward_funcs: Any  # kept by _finish

    def loaded(self, args: GRPOArguments) -> GRPOArguments:
        """The arguments the run gets: the model is loaded, and completions are drawn as TRL's are, from torch's
        global generator in TRL's order, unless ``generation_rng`` says otherwise."""
        rng = "global" if args.generation_rng is None else args.generation_rng
        return super().loaded(args).replace(generation_rng=rng)

    def evaluate(self, *positional: Any, **kwargs: Any) -> dict[str, float]:
        """Refused: GRPO evaluates during ``train``."""
        refuse("GRPOTrainer.evaluate", _EVALUATION)

    def predict(self, *positional: Any, **kwargs: Any) -> Any:
        """Refused: GRPO generates; it has no predictions to return."""
        refuse("GRPOTrainer.predict", "generate with trainfold.core.generate, or evaluate during train: " + _EVALUATION)
