"""trainfold: train PyTorch models as a fold of a pure ``step(state, batch) -> state``.

The pieces, bottom up: ``tree`` (pure ops on tensor dicts), ``state`` (the ``TrainState``
record), ``losses``, ``optim`` and ``schedules``, ``step`` (``make_step``), ``samplers`` and
``data`` (the resumable stream), ``fold`` (``fit``, ``trajectory``), ``reducers`` and
``evaluation``, ``checkpoint`` and ``preempt``, ``observe`` and ``reporters``, ``neftune``,
``dpo``/``grpo``/``sft``/``kto``/``generate`` (``dpo.train``, ``grpo.train``, ``sft.train``, ``kto.train``: the
runs), ``packing`` and ``chunked_loss`` (LLM batches and loss), ``distributed``, and ``train`` (``TrainingArguments`` +
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

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from trainfold import (
        checkpoint,
        chunked_loss,
        compiled,
        data,
        distributed,
        dpo,
        ensemble,
        evaluation,
        generate,
        grpo,
        grpo_args,
        grpo_run,
        kto,
        losses,
        observe,
        optim,
        packing,
        reducers,
        reporters,
        samplers,
        schedules,
        sft,
        tree,
    )
    from trainfold.ckpt import latest_checkpoint, load, save
    from trainfold.core.chunked_loss import chunked_causal_lm
    from trainfold.core.determinism import warm_up_kernels
    from trainfold.core.fold import any_of, fit, max_steps, max_time, trajectory
    from trainfold.core.state import Cursor, TrainState, init_state
    from trainfold.data import StepBatch, keyed, pad_collate, stream
    from trainfold.data.packing import pack, packed_collate, padding_free_collate
    from trainfold.data.samplers import Sampler, make_sampler
    from trainfold.evaluation.evaluation import EvalPrediction
    from trainfold.hf.args import TrainingArguments
    from trainfold.hf.grpo_args import GRPOArguments
    from trainfold.hf.replay import first_divergence, replay
    from trainfold.hf.train import TrainResult, evaluate, predict, train
    from trainfold.hf.trainer_methods import (
        create_model_card,
        is_world_process_zero,
        log_metrics,
        save_metrics,
        save_model,
        save_state,
    )
    from trainfold.observe.stopping import early_stopping
    from trainfold.optim import adamw, chain, clip_by_global_norm, decay_mask, sgd
    from trainfold.recipes.ensemble import init_ensemble_state, make_ensemble_step, split_ensemble
    from trainfold.step import make_step

# public name -> (module, attribute in it; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "checkpoint": ("trainfold.checkpoint", None),
    "data": ("trainfold.data", None),
    "distributed": ("trainfold.distributed", None),
    "evaluation": ("trainfold.evaluation", None),
    "observe": ("trainfold.observe", None),
    "optim": ("trainfold.optim", None),
    "chunked_loss": ("trainfold.chunked_loss", None),
    "losses": ("trainfold.losses", None),
    "tree": ("trainfold.tree", None),
    "packing": ("trainfold.packing", None),
    "samplers": ("trainfold.samplers", None),
    "reducers": ("trainfold.reducers", None),
    "grpo": ("trainfold.grpo", None),
    "grpo_args": ("trainfold.grpo_args", None),
    "grpo_run": ("trainfold.grpo_run", None),
    "reporters": ("trainfold.reporters", None),
    "schedules": ("trainfold.schedules", None),
    "sft": ("trainfold.sft", None),
    "dpo": ("trainfold.dpo", None),
    "kto": ("trainfold.kto", None),
    "ensemble": ("trainfold.ensemble", None),
    "generate": ("trainfold.generate", None),
    "compiled": ("trainfold.compiled", None),
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
    "EvalPrediction": ("trainfold.evaluation.evaluation", "EvalPrediction"),
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
    "replay": ("trainfold.hf.replay", "replay"),
    "first_divergence": ("trainfold.hf.replay", "first_divergence"),
    "save_model": ("trainfold.hf.trainer_methods", "save_model"),
    "log_metrics": ("trainfold.hf.trainer_methods", "log_metrics"),
    "save_metrics": ("trainfold.hf.trainer_methods", "save_metrics"),
    "save_state": ("trainfold.hf.trainer_methods", "save_state"),
    "create_model_card": ("trainfold.hf.trainer_methods", "create_model_card"),
    "is_world_process_zero": ("trainfold.hf.trainer_methods", "is_world_process_zero"),
}

# the layers: ``trainfold.core`` etc. work after ``import trainfold`` alone, as eager imports used to allow
_SUBPACKAGES = ("core", "ckpt", "distributed", "evaluation", "hf", "recipes", "step", "testing")


def __getattr__(name: str) -> Any:
    """Import a public name, or a layer, the first time it is asked for, and keep it (PEP 562)."""
    if name == "__version__":  # importlib.metadata costs ~0.1-0.3 s: paid by who asks
        from trainfold.core.version import library_version

        value: Any = library_version()
    elif name in _LAZY:
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
    return sorted({*globals(), *__all__, *_SUBPACKAGES, "__version__"})


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
    "kto",
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
    "first_divergence",
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
    "replay",
    "save",
    "schedules",
    "sft",
    "sgd",
    "stream",
    "train",
    "trajectory",
    "tree",
    "warm_up_kernels",
    "save_model",
    "log_metrics",
    "save_metrics",
    "save_state",
    "create_model_card",
    "is_world_process_zero",
]
