"""trainfold: train PyTorch models as a fold of a pure ``step(state, batch) -> state``."""

from trainfold import losses, optim, schedules, tree
from trainfold.fold import any_of, fit, max_steps, max_time, trajectory
from trainfold.optim import adamw, chain, clip_by_global_norm, decay_mask, sgd
from trainfold.state import Cursor, TrainState, init_state
from trainfold.step import make_step

__version__ = "0.1.0"

__all__ = [
    "Cursor",
    "TrainState",
    "adamw",
    "any_of",
    "chain",
    "clip_by_global_norm",
    "decay_mask",
    "fit",
    "init_state",
    "losses",
    "make_step",
    "max_steps",
    "max_time",
    "optim",
    "schedules",
    "sgd",
    "trajectory",
    "tree",
]
