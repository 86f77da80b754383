"""Reward modelling in one place (``trainfold.reward``): TRL 1.16 ``RewardTrainer``'s semantics as a run.

The pieces: preference rows and their collator (``data``), the Bradley–Terry objective with ``margin`` and
``center_rewards_coefficient`` (``loss``), ``RewardArguments`` (``RewardConfig``'s names and defaults), the
run :func:`train`, and ``RewardTrainer``, TRL's constructor over it for moving a script by its import.
"""

from trainfold.reward.args import RewardArguments
from trainfold.reward.data import (
    REWARD_COLUMNS,
    RewardCollate,
    is_preference_conversational,
    reward_collate,
    reward_row,
    reward_rows,
)
from trainfold.reward.loss import RewardObjective, bradley_terry, reward_objective
from trainfold.reward.run import pad_id_for, prepare_reward_dataset, reward_model, train
from trainfold.reward.trainer import RewardTrainer

__all__ = [
    "REWARD_COLUMNS",
    "RewardArguments",
    "RewardCollate",
    "RewardObjective",
    "RewardTrainer",
    "bradley_terry",
    "is_preference_conversational",
    "pad_id_for",
    "prepare_reward_dataset",
    "reward_collate",
    "reward_model",
    "reward_objective",
    "reward_row",
    "reward_rows",
    "train",
]
