"""GRPO in one place (``trainfold.grpo``): the recipe's pieces, ``GRPOArguments`` and the run ``train``.

The pieces come from :mod:`trainfold.recipes.grpo` (rewards, advantages, the objective, the hand
loop); ``GRPOArguments`` (TRL's ``GRPOConfig`` names) from :mod:`trainfold.hf.grpo_args`; the run,
:func:`train`, from :mod:`trainfold.hf.grpo_run`.

>>> from trainfold.hf import grpo
>>> grpo.GRPOArguments(per_device_train_batch_size=4, num_generations=4).generation_batch
4
>>> from trainfold.hf import grpo_run
>>> grpo.train is grpo_run.train, grpo.grpo_objective("dapo").loss_type
(True, 'dapo')
"""

from trainfold.hf.grpo_args import TRL_ONLY, GRPOArguments, generation_order
from trainfold.hf.grpo_run import BUFFER, GenerationBuffer, GRPORun, grpo_stream, train
from trainfold.recipes.grpo import (
    GRPO_LOSS_TYPES,
    SCALE_REWARDS,
    GRPOObjective,
    RewardFunc,
    Rollout,
    chunk_head,
    combine_rewards,
    group_advantages,
    grpo_objective,
    grpo_trajectory,
    make_rollout,
    next_token_logps,
    reward_name,
    rollout_metrics,
    token_entropy,
)
from trainfold.recipes.grpo_data import generation_batches

__all__ = [
    "generation_batches",
    "GRPO_LOSS_TYPES",
    "SCALE_REWARDS",
    "GRPOObjective",
    "RewardFunc",
    "combine_rewards",
    "reward_name",
    "group_advantages",
    "grpo_objective",
    "chunk_head",
    "next_token_logps",
    "token_entropy",
    "Rollout",
    "make_rollout",
    "grpo_trajectory",
    "rollout_metrics",
    "GRPOArguments",
    "TRL_ONLY",
    "generation_order",
    "BUFFER",
    "GenerationBuffer",
    "GRPORun",
    "grpo_stream",
    "train",
]
