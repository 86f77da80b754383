"""Optimizers as chains of gradient transformations, and learning-rate schedules."""

from trainfold.optim.base import (
    AdamState,
    GradientTransformation,
    SgdState,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    decay_mask,
    decay_mask_by_name,
    sgd,
)

__all__ = [
    "GradientTransformation",
    "AdamState",
    "SgdState",
    "adamw",
    "sgd",
    "clip_by_global_norm",
    "chain",
    "apply_updates",
    "decay_mask",
    "decay_mask_by_name",
]
