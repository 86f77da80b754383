"""GRPO sampling from torch's global generator in TRL's order (``GRPOArguments(generation_rng="global")``).

TRL 1.16's ``GRPOTrainer`` draws every random number of a run from torch's global generator, seeded by
``set_seed(args.seed)`` when it is built (after the model is loaded):

* one number each time a loader starts iterating: each training epoch and each evaluation (torch's
  ``DataLoader`` draws its workers' base seed; ``trainfold.data.steps.epoch_draw``);
* per generation, ``model.generate(do_sample=True)`` with its ``GenerationConfig`` over the generation's
  left-padded prompts: one ``torch.multinomial`` over every row per new token (finished rows too) until every
  row has ended, then the reward functions (whatever they draw), then one ``torch.randperm`` of the rows
  (training only: an evaluation batch is not shuffled).

The ``"global"`` run draws the same numbers in the same order: a transformers model samples with its own
``generate`` (on the step's weights), any other model with ``trainfold.core.generate`` from the global
generator (which draws for the unfinished rows only: TRL takes transformers models only). So, from
``GRPOTrainer``'s ``set_seed`` on, the completions, rewards and losses are TRL's. A checkpoint holds the global
generators (``trainfold.core.rng``); a resumed run sets them back before its first step, as HF's does. The
default ``"keyed"`` run samples each generation from a generator keyed by the seed and the generation's place
instead, whatever ran before (``trainfold.grpo.schedule``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from trainfold.core.forward import train_mode
from trainfold.core.generate import generate
from trainfold.core.state import TrainState
from trainfold.data.steps import epoch_draw
from trainfold.grpo.data import Sampling

__all__ = ["GENERATION_RNGS", "global_completions", "global_problems", "loader_draw", "shuffled_rows"]

GENERATION_RNGS = ("keyed", "global")


def global_problems(rng: str, engine: str, max_staleness: int) -> list[str]:
    """Return why a run cannot sample from the global generator in TRL's order (empty: it can)."""
    if rng != "global":
        return []
    out = []
    if engine != "local":
        out.append(
            f"generation_rng='global' with rollout_engine={engine!r}: only the in-process engine draws from this "
            "process's global generator; use rollout_engine='local' or generation_rng='keyed'"
        )
    if max_staleness > 0:
        out.append(
            f"generation_rng='global' with max_staleness={max_staleness}: a generation sampled ahead of its step "
            "would draw before the draws of the steps between (TRL's order cannot hold); use max_staleness=0 or "
            "generation_rng='keyed'"
        )
    return out


def loader_draw() -> None:
    """The draw of a loader starting to iterate (each epoch, each evaluation), as under HF's loop."""
    epoch_draw()


def shuffled_rows(rows: int) -> Tensor:
    """TRL's ``shuffle_sequence_dict``: a permutation of a generation's rows from the global generator."""
    return torch.randperm(rows)


def _eos_ids(model: nn.Module, eos_token_id: int | None) -> list[int]:
    """TRL's ``eos_token_ids``: the tokenizer's end token, then every end id the model's generation config names."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return ids if eos_token_id is None or eos_token_id in ids else [eos_token_id, *ids]


class _Generating(nn.Module):
    """``model.generate`` as a module's forward, so ``functional_call`` runs it on a param dict."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: Any) -> Tensor:
        return self.model.generate(**inputs)  # type: ignore[operator]


def _left_padded(prompts: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def global_completions(
    model: nn.Module,
    state: TrainState,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    eos_token_id: int | None,
    pad_token_id: int,
    training: bool,
) -> list[list[int]]:
    """Return a completion of each prompt sampled with ``state``'s weights from the global generator as TRL's
    ``GRPOTrainer`` samples it (``sampling``'s length and temperature).

    A transformers model (one with ``generate``) runs its own ``generate`` on ``params`` with TRL's
    ``GenerationConfig`` (``do_sample``, ``temperature``, ``top_p=1``, ``top_k=0``, TRL's pad and end ids), in
    train mode for a training generation and eval mode for an evaluation, as TRL's; each completion is cut
    after its first end token. Another model samples with ``trainfold.core.generate`` from the global generator.
    """
    if not callable(getattr(model, "generate", None)) or not hasattr(model, "generation_config"):
        return generate(  # in eval mode, generator=None: the global one
            model,
            state.params,
            prompts,
            max_new_tokens=sampling.max_completion_length,
            temperature=sampling.temperature,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            buffers=state.buffers,
        )
    eos = _eos_ids(model, eos_token_id)
    return _transformers_generate(model, state, prompts, sampling, eos, pad_token_id, training)


def _transformers_generate(
    model: nn.Module,
    state: TrainState,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    eos: list[int],
    pad_token_id: int,
    training: bool,
) -> list[list[int]]:
    """``model.generate`` on ``state``'s weights with TRL's ``GenerationConfig``, each completion cut after its
    first end token (any of ``eos``)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=sampling.max_completion_length,
        do_sample=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos,
        temperature=sampling.temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        disable_compile=True,
    )
    ids, mask = _left_padded(prompts, pad_token_id, next(iter(state.params.values())).device)
    tensors = {f"model.{k}": v for k, v in {**(state.buffers or {}), **state.params}.items()}
    with train_mode(model, training):
        made = torch.func.functional_call(
            _Generating(model),
            tensors,
            args=(),
            kwargs={"input_ids": ids, "attention_mask": mask, "generation_config": config},
            strict=False,
        )
    out = []
    for row in made[:, ids.shape[1] :].tolist():
        ends = [i for i, tok in enumerate(row) if tok in eos]
        out.append(row[: ends[0] + 1] if ends else row)
    return out
