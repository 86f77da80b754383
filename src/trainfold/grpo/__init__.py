"""GRPO in one place (``trainfold.grpo``): the recipe's pieces, ``GRPOArguments`` and the run ``train``.

The pieces: rewards and advantages (:mod:`trainfold.grpo.rewards`), the objective and its losses
(``objective``, ``loss``), completion rows (``rows``), the generation schedule (``data``) and the stream that runs
it (``schedule``), TRL's metrics (``metrics``); ``GRPOArguments`` (TRL's ``GRPOConfig`` names) from
:mod:`trainfold.grpo.args`; the run, :func:`train`, from :mod:`trainfold.grpo.run`. One driver: :func:`train` runs
the stream of :func:`grpo_stream` through ``trainfold.loop.run``, and so does a research loop,
``loop.run(step, state, grpo_stream(...).stream(), hooks=...)``.

>>> from trainfold import grpo
>>> grpo.GRPOArguments(per_device_train_batch_size=4, num_generations=4).generation_batch
4
>>> grpo.train is grpo.run.train, grpo.grpo_objective("dapo").loss_type
(True, 'dapo')
"""

from trainfold.grpo.args import TRL_ONLY, GRPOArguments, generation_order
from trainfold.grpo.data import GenerationSchedule, Sampling
from trainfold.grpo.objective import (
    GRPO_LOSS_TYPES,
    GRPOObjective,
    chunk_head,
    grpo_objective,
    next_token_logps,
    token_entropy,
)
from trainfold.grpo.rewards import SCALE_REWARDS, RewardFunc, combine_rewards, group_advantages, reward_name
from trainfold.grpo.run import BUFFER, Codec, GenerationBuffer, GRPORun, grpo_stream, train
from trainfold.grpo.trainer import GRPOTrainer  # the facade, for moving a TRL script by its import
from trainfold.rollout.engine import RolloutEngine  # the protocol generation runs on (trainfold.rollout)

__all__ = [
    "GRPOTrainer",
    "RolloutEngine",
    "GenerationSchedule",
    "Sampling",
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
    "GRPOArguments",
    "TRL_ONLY",
    "generation_order",
    "BUFFER",
    "Codec",
    "GenerationBuffer",
    "GRPORun",
    "grpo_stream",
    "train",
]
