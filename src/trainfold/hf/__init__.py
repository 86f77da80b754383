"""The HF-compatible surface: TrainingArguments, train/evaluate/predict, TrainerCallbacks, GRPO runs.

The package's public names (``train`` itself is ``trainfold.hf.train.train``, or ``trainfold.train``: the
name ``trainfold.hf.train`` is the module).
"""

from trainfold.hf.args import TrainingArguments
from trainfold.hf.callbacks import HFCallbacks
from trainfold.hf.evaluating import EvalPlan, evaluate, predict
from trainfold.hf.extras import BEST
from trainfold.hf.optimizer import default_optimizer
from trainfold.hf.plan import Plan
from trainfold.hf.planning import plan_for
from trainfold.hf.train import TrainResult
from trainfold.hf.trainer_methods import (
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
