"""Optimizers as chains of small gradient transformations, and learning-rate schedules.

A transformation is optax's pair ``init(params)`` / ``update(grads, state, params)`` (``transform``);
``chain`` composes them. ``adamw`` and ``sgd`` (``base``) compute what ``torch.optim.AdamW`` and
``torch.optim.SGD`` compute (``adamw`` through torch's own kernels, ``adam``); ``transforms`` holds
``clip_by_global_norm``, ``add_decayed_weights``, ``scale_by_learning_rate`` and ``trace``; ``masks``
picks the params weight decay touches; ``torch_optim.from_torch`` runs any ``torch.optim`` optimizer;
``schedules`` holds the HF learning-rate schedules.
"""

from trainfold.optim.adam import AdamState, scale_by_adam
from trainfold.optim.base import adamw, sgd
from trainfold.optim.chain import chain
from trainfold.optim.masks import decay_mask, decay_mask_by_name
from trainfold.optim.torch_optim import TorchOptimizer, TorchOptState, from_torch
from trainfold.optim.transform import GradientTransformation, apply_updates, overwrite
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
    "from_torch",
    "TorchOptimizer",
    "TorchOptState",
]
