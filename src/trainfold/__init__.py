"""trainfold: train PyTorch models as a fold of a pure ``step(state, batch) -> state``.

The pieces, bottom up: ``tree`` (pure ops on tensor dicts), ``state`` (the ``TrainState``
record), ``losses``, ``optim`` and ``schedules``, ``step`` (``make_step``), ``samplers`` and
``data`` (the resumable stream), ``fold`` (``fit``, ``trajectory``), ``reducers`` and
``evaluation``, ``checkpoint`` and ``preempt``, ``observe`` and ``reporters``, ``neftune``,
``dpo``/``grpo``/``sft``/``generate`` (``dpo.train``, ``grpo.train``, ``sft.train``: the runs), ``packing`` and
``chunked_loss`` (LLM batches and loss), ``distributed``, and ``train`` (``TrainingArguments`` +
``train``) which wires them from the HF Trainer's setting names.
"""

from trainfold import ckpt as checkpoint
from trainfold import data, observe, optim
from trainfold import dist as distributed
from trainfold import eval as evaluation
from trainfold.ckpt import latest_checkpoint, load, save
from trainfold.core import chunked_loss, losses, tree
from trainfold.core.chunked_loss import chunked_causal_lm
from trainfold.core.determinism import warm_up_kernels
from trainfold.core.fold import any_of, fit, max_steps, max_time, trajectory
from trainfold.core.state import Cursor, TrainState, init_state
from trainfold.core.version import library_version
from trainfold.data import StepBatch, keyed, packing, pad_collate, samplers, stream
from trainfold.data.packing import pack, packed_collate, padding_free_collate
from trainfold.data.samplers import Sampler, make_sampler
from trainfold.eval import reducers
from trainfold.eval.evaluation import EvalPrediction
from trainfold.hf import dpo, grpo, grpo_args, grpo_run, sft
from trainfold.hf.args import TrainingArguments
from trainfold.hf.grpo_args import GRPOArguments
from trainfold.hf.train import TrainResult, evaluate, predict, train
from trainfold.observe import reporters
from trainfold.observe.stopping import early_stopping
from trainfold.optim import adamw, chain, clip_by_global_norm, decay_mask, schedules, sgd
from trainfold.recipes import ensemble, generate
from trainfold.recipes.ensemble import init_ensemble_state, make_ensemble_step, split_ensemble
from trainfold.step import compiled, make_step

__version__ = library_version()

__all__ = [
    "Cursor",
    "EvalPrediction",
    "GRPOArguments",
    "Sampler",
    "StepBatch",
    "TrainResult",
    "TrainState",
    "TrainingArguments",
    "adamw",
    "checkpoint",
    "chunked_causal_lm",
    "chunked_loss",
    "compiled",
    "ensemble",
    "init_ensemble_state",
    "keyed",
    "make_ensemble_step",
    "split_ensemble",
    "data",
    "distributed",
    "dpo",
    "evaluation",
    "generate",
    "grpo",
    "grpo_args",
    "grpo_run",
    "observe",
    "reducers",
    "reporters",
    "samplers",
    "any_of",
    "chain",
    "clip_by_global_norm",
    "decay_mask",
    "early_stopping",
    "evaluate",
    "fit",
    "init_state",
    "latest_checkpoint",
    "load",
    "losses",
    "make_sampler",
    "make_step",
    "max_steps",
    "max_time",
    "optim",
    "pack",
    "packed_collate",
    "packing",
    "padding_free_collate",
    "pad_collate",
    "predict",
    "save",
    "schedules",
    "sgd",
    "sft",
    "stream",
    "train",
    "trajectory",
    "tree",
    "warm_up_kernels",
]
