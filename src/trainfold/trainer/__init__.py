"""The HF-compatible surface: TrainingArguments, train/evaluate/predict, TrainerCallbacks, GRPO runs.

The package's public names (``train`` itself is ``trainfold.trainer.train.train``, or ``trainfold.train``: the
name ``trainfold.trainer.train`` is the module).
"""

from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.callbacks import HFCallbacks
from trainfold.trainer.evaluating import EvalPlan, evaluate, predict
from trainfold.trainer.extras import BEST
from trainfold.trainer.optimizer import default_optimizer
from trainfold.trainer.plan import Plan
from trainfold.trainer.planning import TrainCall, plan_for
from trainfold.trainer.train import TrainResult
from trainfold.trainer.trainer_methods import (
    create_model_card,
    is_world_process_zero,
    log_metrics,
    save_metrics,
    save_model,
    save_state,
)

__all__ = [
    "TrainingArguments",
    "TrainResult",
    "evaluate",
    "predict",
    "default_optimizer",
    "Plan",
    "plan_for",
    "TrainCall",
    "EvalPlan",
    "HFCallbacks",
    "BEST",
    "save_model",
    "log_metrics",
    "save_metrics",
    "save_state",
    "create_model_card",
    "is_world_process_zero",
]
