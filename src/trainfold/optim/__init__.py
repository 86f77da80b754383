"""Optimizers as chains of small gradient transformations, and learning-rate schedules.

``adamw`` and ``sgd`` (``base``) are aliases built with ``chain`` (``chain``) from the transforms
(``adam``: ``scale_by_adam``; ``transforms``: ``clip_by_global_norm``, ``add_decayed_weights``,
``scale_by_learning_rate``, ``trace``), all implementing ``GradientTransformation`` (``transform``);
``masks`` picks the params weight decay touches; ``torch_optim.from_torch`` runs any ``torch.optim``
optimizer; ``flat`` assembles the element-wise AdamW plan the compiled and ensemble steps run;
``schedules`` holds the HF learning-rate schedules.
"""

from trainfold.optim.adam import AdamState, adamw_update, scale_by_adam
from trainfold.optim.base import adamw, sgd
from trainfold.optim.chain import chain
from trainfold.optim.flat import OptimizerPlan, optimizer_plan
from trainfold.optim.masks import decay_mask, decay_mask_by_name
from trainfold.optim.torch_optim import TorchOptimizer, TorchOptState, from_torch
from trainfold.optim.transform import GradientTransformation, StepRule, apply_updates, overwrite
from trainfold.optim.transforms import (
    SgdState,
    add_decayed_weights,
    clip_by_global_norm,
    clip_coefficient,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    "GradientTransformation",
    "AdamState",
    "SgdState",
    "StepRule",
    "adamw",
    "sgd",
    "chain",
    "scale_by_adam",
    "add_decayed_weights",
    "scale_by_learning_rate",
    "clip_by_global_norm",
    "clip_coefficient",
    "trace",
    "apply_updates",
    "overwrite",
    "decay_mask",
    "decay_mask_by_name",
    "OptimizerPlan",
    "optimizer_plan",
    "adamw_update",
    "from_torch",
    "TorchOptimizer",
    "TorchOptState",
]
