"""Ensembles: many models (``stack``: vmapped over a stacked state) or many LoRA adapters on one base (``lora``).

>>> from trainfold.step import ensemble
>>> ensemble.make_ensemble_step is ensemble.stack.make_ensemble_step
True
"""

from trainfold.step.ensemble.stack import make_ensemble_step
from trainfold.step.ensemble.state import (
    ensemble_axes,
    ensemble_size,
    init_ensemble_state,
    split_ensemble,
    stack_batches,
    stack_ensemble,
)

__all__ = [
    "ensemble_axes",
    "ensemble_size",
    "init_ensemble_state",
    "make_ensemble_step",
    "split_ensemble",
    "stack_batches",
    "stack_ensemble",
]
