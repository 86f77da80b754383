"""Per-sequence completion log-probs, and a frozen reference's pass over a dataset: what preference objectives share.

:func:`completion_logps` scores each row's completion tokens (the sum of their next-token log-probs) from the
logits or, chunk by chunk, from the final hidden states, with the token statistics TRL logs; :func:`per_sequence`
sums per-position values per sequence (one per row, or per ``sequence_index`` of a padding-free row).
:func:`score_with_reference` runs a frozen reference over a dataset in order, batch by batch, as DPO's and KTO's
precomputed reference log-probs need.

>>> import torch
>>> per_sequence(torch.ones(2, 3), {}).tolist()
[3.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from trainfold.core.chunked_loss import OutputHead, chunked_token_logps
from trainfold.core.counting import sequence_count
from trainfold.core.forward import train_mode
from trainfold.core.generate import functional_forward, token_logps
from trainfold.core.losses import logits_of

__all__ = ["check_sized", "completion_logps", "per_sequence", "score_with_reference", "sequence_logps"]


def per_sequence(x: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """Return per-position values ``x`` ``(rows, seq - 1, ...)`` summed per sequence.

    A padded batch has one sequence per row; a padding-free one (``sequence_index``: each token's
    sequence, one flattened row) sums each position into the sequence of the token it scores.

    >>> import torch
    >>> per_sequence(torch.ones(1, 4), {"sequence_index": torch.tensor([[0, 0, 1, 1, 1]])}).tolist()
    [1.0, 3.0]
    """
    if "sequence_index" not in batch:
        return x.sum(1)
    index = batch["sequence_index"][0, 1:].to(x.device)
    out = torch.zeros(sequence_count(batch), *x.shape[2:], dtype=x.dtype, device=x.device)
    return out.index_add(0, index, x[0])


def sequence_logps(logits: Tensor, input_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Return each row's summed log-prob of its completion tokens (position t scores token t+1).

    >>> import torch
    >>> logits = torch.zeros(1, 3, 4)  # uniform: each token has log-prob ln(1/4)
    >>> round(sequence_logps(logits, torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 1]])).item(), 4)
    -2.7726
    """
    per_token = token_logps(logits, input_ids)
    return (per_token * completion_mask[:, 1:].to(per_token.dtype)).sum(-1)


def _position_stats(logits: Tensor, targets: Tensor) -> Tensor:
    """Return ``(vocab-mean logit, entropy, top-1 hit)`` per position, 0 where ``targets`` is -100 (as TRL's head)."""
    logits = logits.detach().float()
    valid = (targets != -100).to(logits.dtype)
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    top1 = (logits.argmax(-1) == targets).to(logits.dtype)
    return torch.stack([logits.mean(-1), entropy, top1], -1) * valid[..., None]


def _row_stats(
    logits: Tensor | None,
    hidden: Tensor | None,
    head: OutputHead | None,
    params: Mapping[str, Tensor],
    targets: Tensor,
    chunk_size: int,
    batch: Mapping[str, Tensor],
) -> Tensor:
    """Return each sequence's sums of :func:`_position_stats` over its completion tokens, ``(seqs, 3)``, no grad."""
    with torch.no_grad():
        if logits is not None:
            return per_sequence(_position_stats(logits[:, :-1], targets), batch)
        assert hidden is not None and head is not None
        weight, bias = head.weight(params).detach(), head.bias
        h, y = hidden[:, :-1].detach().reshape(-1, hidden.shape[-1]).to(weight.dtype), targets.reshape(-1)
        parts = []
        for start in range(0, h.shape[0], chunk_size):
            z = h[start : start + chunk_size] @ weight.T
            parts.append(_position_stats(z if bias is None else z + bias, y[start : start + chunk_size]))
        return per_sequence(torch.cat(parts).reshape(*targets.shape, 3), batch)


def completion_logps(
    forward: Callable[..., Any],
    params: Mapping[str, Tensor],
    inputs: Mapping[str, Tensor],
    batch: Mapping[str, Tensor],
    head: OutputHead | None,
    chunk_size: int,
) -> tuple[Tensor, Callable[[], Tensor]]:
    """Return each row's completion log-prob (from the logits, or chunk by chunk from the hidden states), and a
    function that gives its :func:`_row_stats` when called (no grad; the reference's scoring never calls it)."""
    targets = batch["input_ids"][:, 1:].masked_fill(batch["completion_mask"][:, 1:] == 0, -100)
    logits: Tensor | None = None
    hidden: Tensor | None = None
    if head is None:
        logits = logits_of(forward(params, inputs))
        per_token = token_logps(logits, batch["input_ids"]) * batch["completion_mask"][:, 1:].to(logits.dtype)
    else:
        hidden = head.hidden(forward, params, inputs)
        per_token = chunked_token_logps(
            hidden[:, :-1], head.weight(params), targets, bias=head.bias, chunk_size=chunk_size
        )
    return per_sequence(per_token, batch), lambda: _row_stats(logits, hidden, head, params, targets, chunk_size, batch)


def check_sized(dataset: Any) -> None:
    """Refuse a dataset without a length and indexing: a precomputed reference scores rows by their index."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"precompute_ref_log_probs needs a map-style dataset, got {type(dataset).__name__} (an "
            "iterable dataset); pass a list or a datasets.Dataset, or precompute_ref_log_probs=False "
            "(as TRL)"
        )


def score_with_reference(
    model: nn.Module,
    ref_params: Mapping[str, Tensor],
    dataset: Any,
    collate: Callable[[list[Any]], Mapping[str, Tensor]],
    score: Callable[[Callable[..., Any], Mapping[str, Tensor], Mapping[str, Tensor]], Sequence[Tensor]],
    *,
    columns: int,
    batch_size: int = 16,
    buffers: Mapping[str, Tensor] | None = None,
    drop: Sequence[str] = (),
) -> tuple[Tensor, ...]:
    """Return the ``columns`` per-row tensors ``score(forward, params, batch)`` gives for every batch of ``dataset``,
    each concatenated in dataset order, float32 on the CPU.

    Each batch is as the reference sees it: ``model`` on ``ref_params`` (and ``buffers``) in eval mode without
    grad, ``batch_size`` rows at a time, through ``collate`` (the collator training uses, so the scored tokens are
    the same), on the parameters' device; columns named in ``drop`` (reference values already stored) are left out
    of the rows.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 1)
    >>> rows = [{"x": [1.0, 0.0]}, {"x": [0.0, 1.0]}, {"x": [1.0, 1.0]}]
    >>> collate = lambda rows: {"x": torch.tensor([r["x"] for r in rows])}
    >>> score = lambda forward, params, batch: (batch["x"].sum(1), batch["x"][:, 0])
    >>> [t.tolist() for t in score_with_reference(lin, dict(lin.named_parameters()), rows, collate, score,
    ...                                           columns=2, batch_size=2)]
    [[1.0, 1.0, 2.0], [1.0, 0.0, 1.0]]
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    check_sized(dataset)
    forward = functional_forward(model, buffers)
    params = {k: v.detach() for k, v in ref_params.items()}
    device = next(iter(params.values())).device
    parts: list[tuple[Tensor, ...]] = []
    with torch.no_grad(), train_mode(model, False):
        for start in range(0, len(dataset), batch_size):
            rows = (dict(dataset[i]) for i in range(start, min(start + batch_size, len(dataset))))
            batch = collate([{k: v for k, v in row.items() if k not in drop} for row in rows])
            scored = score(forward, params, {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()})
            parts.append(tuple(t.float().cpu() for t in scored))
    if not parts:
        return tuple(torch.zeros(0) for _ in range(columns))
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))
