"""trainfold: train PyTorch models as a fold of a pure ``step(state, batch) -> state``.

The pieces, bottom up: ``tree`` (pure ops on tensor dicts), ``state`` (the ``TrainState``
record), ``losses``, ``optim`` and ``schedules``, ``step`` (``make_step``), ``samplers`` and
``data`` (the resumable stream), ``fold`` (``fit``, ``trajectory``), ``reducers`` and
``evaluation``, ``checkpoint`` and ``preempt``, ``observe`` and ``reporters``, ``neftune``,
``dpo``/``grpo``/``generate`` (``grpo.train``: the GRPO run, ``grpo_run``), ``packing`` and
``chunked_loss`` (LLM batches and loss), ``distributed``, and ``train`` (``TrainingArguments`` +
``train``) which wires them from the HF Trainer's setting names.

``import trainfold`` imports none of them (nor ``torch``): each public name is imported the first
time it is used (PEP 562), so a script pays only for what it touches.

>>> import trainfold
>>> trainfold.fit is trainfold.core.fold.fit
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainfold.core.version import library_version

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
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
    from trainfold.data import StepBatch, keyed, packing, pad_collate, samplers, stream
    from trainfold.data.packing import pack, packed_collate, padding_free_collate
    from trainfold.data.samplers import Sampler, make_sampler
    from trainfold.eval import reducers
    from trainfold.eval.evaluation import EvalPrediction
    from trainfold.hf import grpo, grpo_args, grpo_run
    from trainfold.hf.args import TrainingArguments
    from trainfold.hf.grpo_args import GRPOArguments
    from trainfold.hf.train import TrainResult, evaluate, predict, train
    from trainfold.observe import reporters
    from trainfold.observe.stopping import early_stopping
    from trainfold.optim import adamw, chain, clip_by_global_norm, decay_mask, schedules, sgd
    from trainfold.recipes import dpo, ensemble, generate
    from trainfold.recipes.ensemble import init_ensemble_state, make_ensemble_step, split_ensemble
    from trainfold.step import compiled, make_step

# public name -> (module, attribute in it; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "checkpoint": ("trainfold.ckpt", None),
    "data": ("trainfold.data", None),
    "distributed": ("trainfold.dist", None),
    "evaluation": ("trainfold.eval", None),
    "observe": ("trainfold.observe", None),
    "optim": ("trainfold.optim", None),
    "chunked_loss": ("trainfold.core.chunked_loss", None),
    "losses": ("trainfold.core.losses", None),
    "tree": ("trainfold.core.tree", None),
    "packing": ("trainfold.data.packing", None),
    "samplers": ("trainfold.data.samplers", None),
    "reducers": ("trainfold.eval.reducers", None),
    "grpo": ("trainfold.hf.grpo", None),
    "grpo_args": ("trainfold.hf.grpo_args", None),
    "grpo_run": ("trainfold.hf.grpo_run", None),
    "reporters": ("trainfold.observe.reporters", None),
    "schedules": ("trainfold.optim.schedules", None),
    "dpo": ("trainfold.recipes.dpo", None),
    "ensemble": ("trainfold.recipes.ensemble", None),
    "generate": ("trainfold.recipes.generate", None),
    "compiled": ("trainfold.step.compiled", None),
    "latest_checkpoint": ("trainfold.ckpt.listing", "latest_checkpoint"),
    "load": ("trainfold.ckpt.reader", "load"),
    "save": ("trainfold.ckpt.writer", "save"),
    "chunked_causal_lm": ("trainfold.core.chunked_loss", "chunked_causal_lm"),
    "warm_up_kernels": ("trainfold.core.determinism", "warm_up_kernels"),
    "any_of": ("trainfold.core.fold", "any_of"),
    "fit": ("trainfold.core.fold", "fit"),
    "max_steps": ("trainfold.core.fold", "max_steps"),
    "max_time": ("trainfold.core.fold", "max_time"),
    "trajectory": ("trainfold.core.fold", "trajectory"),
    "Cursor": ("trainfold.core.state", "Cursor"),
    "TrainState": ("trainfold.core.state", "TrainState"),
    "init_state": ("trainfold.core.state", "init_state"),
    "StepBatch": ("trainfold.data.steps", "StepBatch"),
    "stream": ("trainfold.data.steps", "stream"),
    "keyed": ("trainfold.data.collate", "keyed"),
    "pad_collate": ("trainfold.data.collate", "pad_collate"),
    "pack": ("trainfold.data.packing", "pack"),
    "packed_collate": ("trainfold.data.packing", "packed_collate"),
    "padding_free_collate": ("trainfold.data.packing", "padding_free_collate"),
    "Sampler": ("trainfold.data.samplers", "Sampler"),
    "make_sampler": ("trainfold.data.samplers", "make_sampler"),
    "EvalPrediction": ("trainfold.eval.evaluation", "EvalPrediction"),
    "TrainingArguments": ("trainfold.hf.args", "TrainingArguments"),
    "GRPOArguments": ("trainfold.hf.grpo_args", "GRPOArguments"),
    "TrainResult": ("trainfold.hf.train", "TrainResult"),
    "evaluate": ("trainfold.hf.train", "evaluate"),
    "predict": ("trainfold.hf.train", "predict"),
    "train": ("trainfold.hf.train", "train"),
    "early_stopping": ("trainfold.observe.stopping", "early_stopping"),
    "adamw": ("trainfold.optim.base", "adamw"),
    "sgd": ("trainfold.optim.base", "sgd"),
    "chain": ("trainfold.optim.chain", "chain"),
    "clip_by_global_norm": ("trainfold.optim.transforms", "clip_by_global_norm"),
    "decay_mask": ("trainfold.optim.masks", "decay_mask"),
    "init_ensemble_state": ("trainfold.recipes.ensemble", "init_ensemble_state"),
    "make_ensemble_step": ("trainfold.recipes.ensemble", "make_ensemble_step"),
    "split_ensemble": ("trainfold.recipes.ensemble", "split_ensemble"),
    "make_step": ("trainfold.step.make", "make_step"),
}

# the layers: ``trainfold.core`` etc. work after ``import trainfold`` alone, as eager imports used to allow
_SUBPACKAGES = ("core", "ckpt", "dist", "eval", "hf", "recipes", "step", "testing")

__version__ = library_version()


def __getattr__(name: str) -> Any:
    """Import a public name, or a layer, the first time it is asked for, and keep it (PEP 562)."""
    if name in _LAZY:
        module_name, attribute = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'trainfold' has no attribute {name!r}; its public names are trainfold.__all__")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})


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
    "stream",
    "train",
    "trajectory",
    "tree",
    "warm_up_kernels",
]
