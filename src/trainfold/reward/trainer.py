"""``RewardTrainer``: TRL ``RewardTrainer``'s shape over ``trainfold.reward.train``, for moving scripts by their import.

It takes ``RewardTrainer``'s keywords (``model`` a module or a name, loaded for sequence classification with
one label; ``args`` a ``RewardArguments`` or the script's own ``trl.RewardConfig``; ``peft_config``...) and
has ``trainfold.Trainer``'s methods: ``evaluate``/``predict`` score rows prepared as the run prepares them.
No logic of its own: new code calls ``trainfold.reward.train``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainfold.reward.args import RewardArguments
from trainfold.reward.data import reward_collate
from trainfold.reward.loss import reward_objective
from trainfold.reward.run import pad_id_for, prepare_reward_dataset, reward_model
from trainfold.reward.run import train as reward_train
from trainfold.trainer.args import GivenArguments
from trainfold.trainer.facade import Collate, PeerTrainer, peer_keywords

__all__ = ["RewardTrainer"]


class RewardTrainer(PeerTrainer[RewardArguments]):
    """TRL ``RewardTrainer``'s constructor and methods over ``trainfold.reward.train`` (see the module doc)."""

    keywords = peer_keywords(without=("compute_loss_func",))
    run = staticmethod(reward_train)
    load_model = staticmethod(reward_model)

    def loaded(self, args: RewardArguments) -> RewardArguments:
        """The arguments the run gets: the model is loaded and its dropout off already (``reward_model``)."""
        return args.replace(model_init_kwargs=None, disable_dropout=False)

    def _collator(self, model: nn.Module, tok: Any, args: RewardArguments, given: Collate | None) -> Collate:
        return given or reward_collate(pad_id_for(model, tok, args), args.pad_to_multiple_of)

    def _finish(self, given: GivenArguments | None, **rest: Any) -> None:
        self.objective = reward_objective(self.args.center_rewards_coefficient)

    def _eval_rows(self, dataset: Any) -> Any:
        return prepare_reward_dataset(dataset, self.processing_class, self.args)

    def _scoring(self) -> dict[str, Any]:
        return {**super()._scoring(), "objective": self.objective}
