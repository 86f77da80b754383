"""KTO's reference log-probs computed once, before training (``precompute_ref_log_probs``).

:func:`unpaired_reference_logps` scores unpaired rows with the reference (eval mode, no grad, in row order, through the
training collator): each row's completion and, with a KL term, its mismatched KL completion.
:func:`prepare_reference_logps` adds them to the train and eval rows as ``ref_logps`` and ``ref_KL_logps``.
They are computed at each start of ``train`` (a resumed run included) from the reference it is given.

>>> import torch
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> from trainfold.kto.collate import unpaired_collate
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> rows = [{"prompt_ids": [1], "completion_ids": [4], "KL_completion_ids": [5], "label": True}]
>>> scored = unpaired_reference_logps(model, dict(model.named_parameters()), rows, unpaired_collate())
>>> out = with_reference_logps(rows, *scored)
>>> sorted(out[0]), "ref_logps" in rows[0]
(['KL_completion_ids', 'completion_ids', 'label', 'prompt_ids', 'ref_KL_logps', 'ref_logps'], False)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from trainfold.core.logps import completion_logps, score_with_reference
from trainfold.kto.collate import REF_COLUMNS

__all__ = ["prepare_reference_logps", "unpaired_logps", "unpaired_reference_logps", "with_reference_logps"]


def unpaired_logps(
    forward: Callable[..., Any], params: Mapping[str, Tensor], batch: Mapping[str, Tensor], prefix: str = ""
) -> Tensor:
    """Return each row's summed completion log-prob of the ``prefix`` sequences of a collated batch."""
    side = {k: batch[prefix + k] for k in ("input_ids", "attention_mask", "completion_mask")}
    inputs = {k: side[k] for k in ("input_ids", "attention_mask")}
    return completion_logps(forward, params, inputs, side, None, 0)[0]


def unpaired_reference_logps(
    model: nn.Module,
    ref_params: Mapping[str, Tensor],
    rows: Any,
    collate: Callable[[list[Any]], Mapping[str, Tensor]],
    *,
    batch_size: int = 16,
    kl: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Return the reference's summed completion log-probs of every row, and of its KL completion (None without
    ``kl``), float32, ``batch_size`` rows at a time."""

    def score(forward: Callable[..., Any], params: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Any:
        main = unpaired_logps(forward, params, batch)
        return (main, unpaired_logps(forward, params, batch, "KL_")) if kl else (main,)

    device = next(iter(ref_params.values())).device
    buffers = {k: v.to(device) for k, v in model.named_buffers()}
    scored = score_with_reference(
        model,
        ref_params,
        rows,
        collate,
        score,
        columns=2 if kl else 1,
        batch_size=batch_size,
        buffers=buffers,
        drop=REF_COLUMNS,
    )
    return scored[0], (scored[1] if kl else None)


def with_reference_logps(rows: Any, ref: Tensor, ref_kl: Tensor | None) -> Any:
    """Return ``rows`` with ``ref_logps`` (and ``ref_KL_logps``) added: a list of new dicts, or a ``datasets.Dataset``
    with the columns added; nothing passed in is changed."""
    columns = {REF_COLUMNS[0]: ref.tolist()} | ({} if ref_kl is None else {REF_COLUMNS[1]: ref_kl.tolist()})
    if hasattr(rows, "add_column") and hasattr(rows, "column_names"):
        for name, values in columns.items():
            rows = rows.add_column(name, values)
        return rows
    return [{**dict(r), **{k: v[i] for k, v in columns.items()}} for i, r in enumerate(rows)]


def prepare_reference_logps(
    model: nn.Module,
    ref_params: Mapping[str, Tensor],
    train_dataset: Any,
    eval_dataset: Any,
    collate: Callable[[list[Any]], Mapping[str, Tensor]],
    *,
    device: torch.device,
    batch_sizes: tuple[int, int],
    kl: bool,
) -> tuple[Any, Any]:
    """Return the train and eval rows (one set or a dict of them) with the reference log-probs added."""
    ref = {k: v.detach().to(device) for k, v in ref_params.items()}

    def scored(rows: Any, size: int) -> Any:
        return with_reference_logps(rows, *unpaired_reference_logps(model, ref, rows, collate, batch_size=size, kl=kl))

    train_dataset = scored(train_dataset, batch_sizes[0])
    if isinstance(eval_dataset, Mapping):
        eval_dataset = {name: scored(ds, batch_sizes[1]) for name, ds in eval_dataset.items()}
    elif eval_dataset is not None:
        eval_dataset = scored(eval_dataset, batch_sizes[1])
    return train_dataset, eval_dataset
