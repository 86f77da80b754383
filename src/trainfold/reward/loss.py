"""The Bradley–Terry objective of a reward model, as TRL 1.16 ``RewardTrainer.compute_loss`` computes it.

Each pair's loss is ``-logsigmoid(r_chosen - r_rejected - margin)`` plus, with
``center_rewards_coefficient`` c, ``c * (r_chosen + r_rejected)**2`` (TRL's ``c * mean((rc + rr)**2)``
taken per pair, so the pair mean is TRL's). The objective returns the pair losses summed over the
step's pair count: TRL's batch mean divided by the accumulation steps when micro-batches hold as many
pairs (with a shorter last micro-batch, the exact mean over pairs rather than TRL's mean of means). It
logs TRL's ``accuracy``, ``margin``, ``min_reward``, ``mean_reward`` and ``max_reward`` (the last three
per micro-batch, weighted by its pairs: TRL averages them over micro-batches). Evaluated, each metric is
the mean over eval batches of the batch's value, as TRL's (a short last batch weighs as much as a full one).

>>> import torch
>>> batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "attention_mask": torch.ones(4, 3)}
>>> scores = lambda params, inputs: {"logits": torch.tensor([[2.0], [0.0], [1.0], [1.0]])}
>>> loss, aux = reward_objective()(scores, {}, batch, torch.tensor(2))
>>> round(loss.item(), 4), aux["accuracy"].item(), aux["margin"].item(), aux["max_reward"].item()
(0.8133, 0.5, 0.0, 2.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.nn import functional as F

from trainfold.core.counting import count_pairs
from trainfold.core.forward import Forward, LossAux, ModelInputsObjective, Tensors
from trainfold.reward.data import REWARD_COLUMNS

__all__ = ["RewardObjective", "bradley_terry", "reward_objective"]


def bradley_terry(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_rewards_coefficient: float | None = None
) -> Tensor:
    """Return each pair's Bradley–Terry loss (``-logsigmoid(chosen - rejected - margin)``, centred as TRL).

    >>> bradley_terry(torch.tensor([0.0]), torch.tensor([0.0])).tolist()  # ln 2
    [0.6931471824645996]
    """
    diff = chosen - rejected if margin is None else chosen - rejected - margin.to(chosen)
    losses = -F.logsigmoid(diff)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def _logits(outputs: Any) -> Tensor:
    return outputs["logits"] if isinstance(outputs, Mapping) or hasattr(outputs, "keys") else outputs.logits


@attrs.frozen(eq=False)
class RewardObjective(ModelInputsObjective):
    """The reward model's objective for ``trainfold.train(objective=...)``; see the module doc."""

    center_rewards_coefficient: float | None = None
    columns = REWARD_COLUMNS
    aux_reduction = "sum"  # its metrics are shares of the step's pairs, as its loss: the step sums them
    eval_metrics_per_batch = True  # eval: TRL averages each batch's metrics over the batches, unweighted

    def count_items(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count the pairs of ``micro_batch`` (half its rows)."""
        return count_pairs(micro_batch)

    def count_samples(self, micro_batch: Mapping[str, Tensor]) -> Tensor:
        """Count the dataset rows of ``micro_batch``: its pairs."""
        return count_pairs(micro_batch)

    def loss_of(self, forward: Forward, params: Tensors, inputs: Tensors, micro: Tensors, n: Tensor) -> LossAux:
        logits = _logits(forward(params, inputs))
        chosen, rejected = torch.chunk(logits.squeeze(-1), chunks=2)
        losses = bradley_terry(chosen, rejected, micro.get("margin"), self.center_rewards_coefficient)
        n = n.to(losses.dtype)
        with torch.no_grad():
            share = chosen.shape[0] / n  # this micro-batch's part of the step's pairs
            every = logits.detach()
            aux = {
                "min_reward": every.min() * share,
                "mean_reward": every.mean() * share,
                "max_reward": every.max() * share,
                "accuracy": (chosen > rejected).to(n.dtype).sum() / n,
                "margin": (chosen - rejected).detach().sum() / n,
            }
        return losses.sum() / n, aux


def reward_objective(center_rewards_coefficient: float | None = None) -> RewardObjective:
    """Return the Bradley–Terry objective (``center_rewards_coefficient``: TRL's centring, e.g. 0.01)."""
    return RewardObjective(center_rewards_coefficient)
