"""GRPO-style online RL as plain functions: the recipe's public names, from the modules that hold them.

* :mod:`~trainfold.recipes.grpo_rewards`: reward functions ``reward(prompts, completions, **columns)
  -> list[float]`` combined with weights, and :func:`group_advantages` per group of ``num_generations``
  completions of one prompt;
* :mod:`~trainfold.recipes.grpo_objective`: :func:`grpo_objective`, the clipped surrogate plus
  ``beta``·KL(k3) to the reference, normalised as ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo``;
* :mod:`~trainfold.recipes.grpo_loop`: ``make_rollout`` and ``grpo_trajectory``, a hand-written loop
  for research code;
* :mod:`~trainfold.recipes.grpo_metrics`: what TRL's ``GRPOTrainer`` logs, by its formulas.

The run with TRL's ``GRPOConfig`` names and generation schedule is ``trainfold.grpo.train``
(``trainfold.hf.grpo``: these names plus ``GRPOArguments`` and ``train``).

>>> import torch
>>> [round(a, 4) for a in group_advantages(torch.tensor([5.0, 2.0, 4.0, 4.0]), 4).tolist()]
[0.9933, -1.3906, 0.1987, 0.1987]
"""

from trainfold.recipes.grpo_loop import Rollout, grpo_trajectory, make_rollout, rollout_metrics
from trainfold.recipes.grpo_objective import (
    GRPO_LOSS_TYPES,
    GRPOObjective,
    chunk_head,
    grpo_objective,
    next_token_logps,
    token_entropy,
)
from trainfold.recipes.grpo_rewards import SCALE_REWARDS, RewardFunc, combine_rewards, group_advantages, reward_name

__all__ = [
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
]
