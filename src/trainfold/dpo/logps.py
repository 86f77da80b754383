"""Per-sequence log-probs of preference batches: what DPO's objective and its reference precompute share.

A collated preference batch (``trainfold.dpo.objective.preference_collate``) holds every ``prompt+chosen``
row, then every ``prompt+rejected`` row; :func:`completion_logps` scores each row's completion
tokens (the sum of their next-token log-probs) from the logits or, chunk by chunk, from the
final hidden states, and :func:`halves` splits a per-row tensor into its chosen and rejected
halves. :func:`token_means` gives TRL's token-weighted metrics (``logits/chosen``, ``entropy``...).

>>> import torch
>>> [t.tolist() for t in halves(torch.arange(4))]
[[0, 1], [2, 3]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from trainfold.core.chunked_loss import OutputHead, chunked_token_logps
from trainfold.core.counting import sequence_count
from trainfold.core.generate import token_logps
from trainfold.core.losses import logits_of

__all__ = [
    "MODEL_KEYS",
    "PREFERENCE_COLUMNS",
    "REF_KEYS",
    "completion_logps",
    "halves",
    "per_sequence",
    "sequence_logps",
    "token_means",
]

PREFERENCE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")  # TRL 1.x's names for tokenized rows
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")  # what the model sees of a preference batch


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


def halves(x: Tensor) -> tuple[Tensor, Tensor]:
    """Return the chosen and the rejected half of a per-row tensor."""
    n = x.shape[0] // 2
    return x[:n], x[n:]


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


def token_means(stats: Tensor, lengths: tuple[Tensor, Tensor], weight: Tensor) -> dict[str, Tensor]:
    """Return TRL's token-weighted metrics of a micro-batch (its token means), times ``weight``."""
    (sc, sr), (nc, nr) = halves(stats), lengths
    tokens_c, tokens_r = nc.sum().clamp(min=1), nr.sum().clamp(min=1)
    return {
        "logits/chosen": sc[:, 0].sum() / tokens_c * weight,
        "logits/rejected": sr[:, 0].sum() / tokens_r * weight,
        "entropy": stats[:, 1].sum() / (nc.sum() + nr.sum()).clamp(min=1) * weight,
        "mean_token_accuracy": sc[:, 2].sum() / tokens_c * weight,
    }
