"""``SFTTrainer``: TRL ``SFTTrainer``'s shape over ``trainfold.sft.train``, for moving scripts by their import.

It takes ``SFTTrainer``'s keywords (``model`` a module or a name, loaded with ``args.model_init_kwargs`` and
wrapped by ``peft_config`` when it is built, as TRL does; ``args`` an ``SFTArguments`` or the script's own
``trl.SFTConfig``; ``formatting_func``...) and has ``trainfold.Trainer``'s methods: ``train`` is
``trainfold.sft.train``, ``evaluate``/``predict`` score rows prepared as the run prepares them. No logic of
its own: new code calls ``trainfold.sft.train``.
"""

from __future__ import annotations

from typing import Any

from trainfold.sft.args import SFTArguments
from trainfold.sft.data import sft_loss
from trainfold.sft.run import default_collator, prepare_eval_dataset
from trainfold.sft.run import train as sft_train
from trainfold.trainer.facade import PeerTrainer, peer_keywords

__all__ = ["SFTTrainer"]


class SFTTrainer(PeerTrainer[SFTArguments]):
    """TRL ``SFTTrainer``'s constructor and methods over ``trainfold.sft.train`` (see the module doc)."""

    keywords = peer_keywords(extra=("formatting_func",))
    run = staticmethod(sft_train)
    run_extras = ("formatting_func",)
    formatting_func: Any  # kept by _finish

    def _eval_rows(self, dataset: Any) -> Any:
        return prepare_eval_dataset(dataset, self.processing_class, self.args, self.formatting_func)

    def _scoring(self) -> dict[str, Any]:
        return {
            **super()._scoring(),
            "data_collator": default_collator(self.processing_class, self.args, self.data_collator),
            "compute_loss_func": self.compute_loss_func or sft_loss,
        }
