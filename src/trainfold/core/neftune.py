"""NEFTune: uniform noise on the input embeddings during training, as a transformation of the forward.

Each sequence ``i`` gets noise ``U(-a_i, a_i)`` with ``a_i = alpha / sqrt(L_i * d)``, where
``L_i`` is its true length (from the attention mask) and ``d`` the embedding width; padding
positions get none, and evaluation (the model in eval mode) gets none. The noise is drawn from
the step's seeded generator (the objective's ``key``), so a resumed run draws the same noise.

Nothing is attached to the model: the noisy forward computes ``inputs_embeds`` itself through
the step's functional parameters and calls the model with them, so no hook can outlive a step,
even when training raises.

>>> import torch
>>> g = torch.Generator().manual_seed(0)
>>> noise = neftune_noise(torch.zeros(1, 4, 8), torch.tensor([[1, 1, 0, 0]]), alpha=4.0, key=g)
>>> bound = 4.0 / (2 * 8) ** 0.5                    # L = 2 real tokens, d = 8
>>> bool(noise[0, :2].abs().max() <= bound), noise[0, 2:].abs().max().item()
(True, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from trainfold.core.forward import Forward, Objective
from trainfold.core.losses import aux_reduction_of, causal_lm, counter_for, loss_and_metrics

__all__ = ["neftune_noise", "input_embedding", "neftune_forward", "neftune_objective"]


def neftune_noise(embeds: Tensor, attention_mask: Tensor | None, alpha: float, key: torch.Generator) -> Tensor:
    """Return NEFTune noise shaped like ``embeds`` ``(batch, seq, d)``: ``U(-a_i, a_i)``, zero at padding.

    ``a_i = alpha / sqrt(L_i * d)`` with ``L_i`` the number of non-zero entries of row ``i`` of
    ``attention_mask`` (the whole row when there is no mask). Uniforms come from ``key``.

    >>> import torch
    >>> noise = neftune_noise(torch.zeros(2, 3, 4), None, alpha=6.0, key=torch.Generator().manual_seed(0))
    >>> list(noise.shape), bool(noise.abs().max() <= 6.0 / (3 * 4) ** 0.5)
    ([2, 3, 4], True)
    """
    if embeds.dim() != 3:
        raise ValueError(
            f"NEFTune needs input embeddings shaped (batch, seq, d), got {tuple(embeds.shape)}; "
            "packed batches without a batch dimension are not supported"
        )
    b, t, d = embeds.shape
    if attention_mask is None:
        real = torch.ones(b, t, dtype=torch.bool, device=key.device)
    else:
        if tuple(attention_mask.shape) != (b, t):
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} does not fit embeddings of shape "
                f"{tuple(embeds.shape)}: expected ({b}, {t})"
            )
        real = attention_mask.to(key.device) != 0
    lengths = real.sum(-1).clamp(min=1).to(torch.float32)
    bound = alpha / torch.sqrt(lengths * d)
    uniform = torch.rand(embeds.shape, generator=key, device=key.device, dtype=torch.float32) * 2 - 1
    noise = uniform * bound[:, None, None] * real[..., None]
    return noise.to(device=embeds.device, dtype=embeds.dtype)


def input_embedding(model: nn.Module) -> tuple[nn.Module, str | None]:
    """Return the model's input embedding module and the name of its weight among the model's parameters.

    The name is ``None`` when the weight is not a parameter of ``model``.

    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> input_embedding(TinyLM(TinyLMConfig(vocab_size=8, d_model=4, n_layers=1, n_heads=1, max_len=4)))[1]
    'tok.weight'
    """
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if not isinstance(emb, nn.Module) or not isinstance(getattr(emb, "weight", None), Tensor):
        raise TypeError(
            f"NEFTune needs {type(model).__name__}.get_input_embeddings() to return the token embedding "
            f"module (got {type(emb).__name__}); add that method, as Hugging Face models and TinyLM have"
        )
    name = next((n for n, p in model.named_parameters() if p is emb.weight), None)
    return emb, name


def neftune_forward(model: nn.Module, forward: Forward, alpha: float, key: torch.Generator) -> Forward:
    """Return ``forward`` with NEFTune noise added to the input embeddings while the model is training.

    ``input_ids`` are embedded through the functional parameters (the embedding module's own
    weight when it is frozen, hence not among them) and passed on as ``inputs_embeds``; given
    ``inputs_embeds`` get the noise directly. In eval mode the forward is unchanged.

    >>> import torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> model = TinyLM(TinyLMConfig(vocab_size=8, d_model=4, n_layers=1, n_heads=1, max_len=4))
    >>> embeds_of = lambda params, inputs: inputs["inputs_embeds"]   # a forward that shows its input
    >>> noisy = neftune_forward(model, embeds_of, alpha=5.0, key=torch.Generator().manual_seed(0))
    >>> bool(noisy({}, {"inputs_embeds": torch.zeros(1, 3, 4)}).abs().sum() > 0)
    True
    >>> _ = model.eval()                                            # evaluation: no noise
    >>> noisy({}, {"inputs_embeds": torch.zeros(1, 3, 4)}).abs().sum().item()
    0.0
    """
    emb, name = input_embedding(model)

    def noisy(params: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Any:
        if not emb.training:
            return forward(params, inputs)
        rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "inputs_embeds")}
        if "input_ids" in inputs:
            # input_embedding checked emb.weight is a Tensor; nn.Module's stubs type it Tensor | Module
            weight = params[name] if name is not None and name in params else cast(Tensor, emb.weight)
            embeds = functional_call(emb, {"weight": weight}, (inputs["input_ids"],))
        elif "inputs_embeds" in inputs:
            embeds = inputs["inputs_embeds"]
        else:
            raise KeyError(f"NEFTune needs 'input_ids' or 'inputs_embeds' among the inputs, got {sorted(inputs)}")
        embeds = embeds + neftune_noise(embeds, inputs.get("attention_mask"), alpha, key)
        return forward(params, {**rest, "inputs_embeds": embeds})

    return noisy


def neftune_objective(
    model: nn.Module,
    alpha: float,
    loss: Callable[..., Tensor] = causal_lm,
    *,
    objective: Objective | None = None,
    label_key: str = "labels",
) -> Objective:
    """Return an objective for ``make_step(..., objective=...)`` that trains with NEFTune noise.

    By default the forward pass is scored with ``loss`` on the micro-batch's ``label_key``, the loss's own metrics
    kept and reduced as without noise (SFT's ``entropy`` and ``mean_token_accuracy``, as TRL logs them); pass
    ``objective`` to add the noise to another objective's forward passes instead (DPO).

    >>> import torch
    >>> from trainfold import init_state, make_step, sgd
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> step = make_step(model, optimizer=sgd(0.1), objective=neftune_objective(model, alpha=5.0))
    >>> ids = torch.randint(0, 16, (2, 6))
    >>> step(init_state(model, sgd(0.1)), [{"input_ids": ids, "labels": ids}]).step.item()
    1
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"neftune_noise_alpha={alpha!r} must be a positive finite number (the paper uses 5 to 15)")
    input_embedding(model)  # fail now, not at the first step
    count_labels = counter_for(loss)

    def labels_of(micro: Mapping[str, Tensor]) -> Tensor:
        if label_key not in micro:
            raise KeyError(
                f"micro-batch has no {label_key!r} key (keys: {sorted(micro)}); pass label_key= to neftune_objective"
            )
        return micro[label_key]

    def neftune(
        forward: Forward,
        params: Mapping[str, Tensor],
        micro: Mapping[str, Tensor],
        num_items: Tensor,
        key: torch.Generator,
    ) -> tuple[Tensor, Mapping[str, Tensor]]:
        noisy = neftune_forward(model, forward, alpha, key)
        if objective is not None:
            return objective(noisy, params, micro, num_items, key)
        inputs = {k: v for k, v in micro.items() if k != label_key}
        return loss_and_metrics(loss, noisy(params, inputs), labels_of(micro), num_items)

    if objective is None:
        neftune.count_items = lambda micro: count_labels(labels_of(micro))  # type: ignore[attr-defined]
    elif hasattr(objective, "count_items"):
        neftune.count_items = objective.count_items  # type: ignore[attr-defined]
    # how the step reduces its aux: the loss's metrics as without noise (summed, or sft_loss's per micro-batch)
    reduction = aux_reduction_of(None, loss) if objective is None else getattr(objective, "aux_reduction", None)
    if reduction is not None:
        neftune.aux_reduction = reduction  # type: ignore[attr-defined]
    return neftune
