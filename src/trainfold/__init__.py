"""trainfold: train PyTorch models as a fold of a pure ``step(state, batch) -> state``.

Three tiers, each usable alone: ``fit`` (a bare fold over ``make_step``), ``loop.run`` (a composed run:
hooks as values, a run directory, resume) and ``train`` (an HF run: ``TrainingArguments`` planned into
``loop.run``); ``sft``, ``dpo`` and ``grpo`` are TRL's algorithms on top. The layers, bottom up: ``core``,
``distributed``, ``optim``, ``data``, ``step`` (with ``step.ensemble``: vmapped ensembles, many adapters on one
base), ``evaluation``, ``ckpt``, ``observe``, ``rollout`` (generation engines for online RL), ``loop``,
``trainer``, then the algorithms ``sft``, ``dpo``, ``grpo``, ``reward``, ``kto``, and ``cli``.

The ``if TYPE_CHECKING`` block below is the one list of the public names: type checkers and editors read
it as imports, and at run time it is read as the table of what to import when a name is first used
(PEP 562), so ``import trainfold`` loads neither torch nor any layer and a script pays only for what it
touches.

>>> import trainfold
>>> trainfold.fit is trainfold.core.fold.fit
True
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainfold import (
        ckpt,
        core,
        data,
        distributed,
        dpo,
        evaluation,
        grpo,
        kto,
        loop,
        observe,
        optim,
        reward,
        rollout,
        sft,
        step,
        trainer,
    )
    from trainfold.ckpt import latest_checkpoint, load, save
    from trainfold.core.chunked_loss import chunked_causal_lm
    from trainfold.core.determinism import warm_up_kernels
    from trainfold.core.fold import any_of, fit, max_steps, max_time, trajectory
    from trainfold.core.state import Cursor, TrainState, init_state
    from trainfold.data import StepBatch, keyed, pad_collate, stream
    from trainfold.data.packing import pack, packed_collate, padding_free_collate
    from trainfold.data.samplers import Sampler, make_sampler
    from trainfold.evaluation.metrics import EvalPrediction
    from trainfold.grpo.args import GRPOArguments
    from trainfold.observe.stopping import early_stopping
    from trainfold.optim import adamw, chain, clip_by_global_norm, decay_mask, sgd
    from trainfold.step import make_step
    from trainfold.step.ensemble import init_ensemble_state, make_ensemble_step, split_ensemble
    from trainfold.trainer.args import TrainingArguments
    from trainfold.trainer.facade import Trainer
    from trainfold.trainer.replay import first_divergence, replay
    from trainfold.trainer.train import TrainResult, evaluate, predict, train
    from trainfold.trainer.trainer_methods import (
        create_model_card,
        is_world_process_zero,
        log_metrics,
        save_metrics,
        save_model,
        save_state,
    )


def _public_names() -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute; None: the module itself), read from the ``TYPE_CHECKING`` block above."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    table: dict[str, tuple[str, str | None]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            if node.module == "trainfold":
                table[alias.name] = (f"trainfold.{alias.name}", None)
            else:
                table[alias.name] = (node.module, alias.name)
    return table


_PUBLIC = _public_names()
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    """Import a public name the first time it is asked for, and keep it (PEP 562)."""
    if name == "__version__":  # importlib.metadata costs ~0.1-0.3 s: paid by who asks
        from trainfold.core.version import library_version

        value: Any = library_version()
    elif name in _PUBLIC:
        module_name, attribute = _PUBLIC[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
    else:
        raise AttributeError(f"module 'trainfold' has no attribute {name!r}; its public names are trainfold.__all__")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
