"""A submission's requests completed on a param dict, the requests of one prompt length as one batch.

Each request is sampled as ``trainfold.core.generate`` samples one prompt alone (no KV cache: every new token
runs the model on the whole sequence), with its own generator (``torch.Generator().manual_seed(spec.seed)``),
and its log-probs come from one forward pass over prompt and completion (as the trainer recomputes them).
What batching changes is only the batch dimension of the model's forward passes: requests whose prompts have
the same length run as one batch, which stays unpadded as it grows (every active row gains one token a step;
a row that stops leaves it), and the log-prob passes batch the rows of equal total length. Everything after
the forward (temperature, ``filter_logits``, softmax, the draw, ``token_logps``) runs on each row alone, in
the shapes ``core.generate`` uses for one prompt.

So the math of every row is the one-prompt math, but its floats are bitwise the one-prompt floats only where
the kernels round a row of a batch as they round it alone — true on the CPUs this is tested on (MKL, AVX-512),
promised by no BLAS. What *is* exact by construction: the batches are a function of the submission alone
(its requests, in order), so the same submission on the same weights gives the same completions bitwise,
and the local and process engines, which both call :func:`complete_all`, agree bitwise. A request submitted
alone is ``core.generate``'s for its prompt, bitwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from trainfold.core.forward import train_mode
from trainfold.core.generate import filter_logits, functional_forward, token_logps
from trainfold.core.losses import logits_of
from trainfold.rollout.engine import Completion, RolloutRequest

__all__ = ["BatchFailed", "complete_all", "length_groups"]


class BatchFailed(RuntimeError):
    """Generating one batch of requests raised; ``request_ids`` names the batch's requests."""

    def __init__(self, request_ids: Sequence[str], error: BaseException) -> None:
        ids = list(request_ids)
        named = f"request {ids[0]!r}" if len(ids) == 1 else f"requests {ids} (generated as one batch)"
        super().__init__(f"the rollout engine failed on {named}: {type(error).__name__}: {error}")
        self.request_ids = ids


def length_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Return the indices of ``lengths`` grouped by value, groups in order of first appearance.

    >>> length_groups([3, 1, 3, 2, 1])
    [[0, 2], [1, 4], [3]]
    """
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(int(n), []).append(i)
    return list(groups.values())


def _forward(model: nn.Module, params: Mapping[str, Tensor], rows: list[list[int]], buffers: Any) -> Tensor:
    """The logits of equal-length ``rows`` run as one unpadded batch (``core.generate``'s inputs for one row)."""
    device = next(iter(params.values())).device
    ids = torch.tensor(rows, dtype=torch.long, device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with train_mode(model, False):
        return logits_of(functional_forward(model, buffers)(params, inputs))


def _draw(last: Tensor, request: RolloutRequest, generator: torch.Generator) -> int:
    """One row's next token: ``core.generate``'s draw for a batch of one (``last`` is ``(1, vocab)``)."""
    spec = request.spec
    if spec.temperature == 0:
        return int(last.argmax(-1).item())
    probs = torch.softmax(filter_logits(last / spec.temperature, spec.top_k, spec.top_p), dim=-1)
    if generator.device.type != probs.device.type:
        probs = probs.to(generator.device)  # draw where the generator lives
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _sample(
    model: nn.Module, params: Mapping[str, Tensor], requests: Sequence[RolloutRequest], eos: int | None, buffers: Any
) -> list[list[int]]:
    """Sample the completions of requests whose prompts have one length, as one batch."""
    seqs = [list(r.prompt_ids) for r in requests]
    generators = [torch.Generator().manual_seed(r.spec.seed) for r in requests]
    out: list[list[int]] = [[] for _ in requests]
    active = list(range(len(requests)))
    while active:
        logits = _forward(model, params, [seqs[i] for i in active], buffers)
        n = len(active)
        at = torch.full((n,), logits.shape[1] - 1, device=logits.device)
        last = logits[torch.arange(n, device=logits.device), at].float()  # core.generate's indexing
        still = []
        for row, i in enumerate(active):
            token = _draw(last[row : row + 1], requests[i], generators[i])
            seqs[i].append(token)
            out[i].append(token)
            if token != eos and len(out[i]) < requests[i].spec.max_new_tokens:
                still.append(i)
        active = still
    return out


@torch.no_grad()
def complete_all(
    model: nn.Module,
    params: Mapping[str, Tensor],
    requests: Sequence[RolloutRequest],
    version: int,
    *,
    eos_token_id: int | None = None,
    buffers: Mapping[str, Tensor] | None = None,
) -> list[Completion]:
    """Return ``requests`` completed with ``params`` (weight ``version``), in their order.

    Tokens are drawn as ``core.generate`` draws them for one prompt, with the request's own generator;
    log-probs are ``core.generate.token_logps`` at the spec's temperature (1.0 when greedy) over the
    unfiltered distribution, float32. Requests of one prompt length run as one batch (module docstring);
    a batch that raises raises :class:`BatchFailed` naming its requests.
    """
    made: list[list[int]] = [[] for _ in requests]
    for group in length_groups([len(r.prompt_ids) for r in requests]):
        batch = [requests[i] for i in group]
        try:
            for i, ids in zip(group, _sample(model, params, batch, eos_token_id, buffers)):
                made[i] = ids
        except Exception as e:
            raise BatchFailed([r.request_id for r in batch], e) from e
    logps: list[Tensor] = [torch.empty(0)] * len(requests)
    full = [list(r.prompt_ids) + ids for r, ids in zip(requests, made)]
    for group in length_groups([len(f) for f in full]):
        try:
            logits = _forward(model, params, [full[i] for i in group], buffers)
        except Exception as e:
            raise BatchFailed([requests[i].request_id for i in group], e) from e
        for row, i in enumerate(group):
            row_ids = torch.tensor([full[i]], dtype=torch.long, device=logits.device)
            temperature = requests[i].spec.temperature or 1.0
            lp = token_logps(logits[row : row + 1], row_ids, temperature)[0, len(requests[i].prompt_ids) - 1 :]
            logps[i] = lp.float().cpu()
    out = []
    for r, ids, lp in zip(requests, made, logps):
        stopped = bool(ids) and eos_token_id is not None and ids[-1] == eos_token_id
        out.append(Completion(r, tuple(ids), lp, ((int(version), 0),), "stop" if stopped else "length"))
    return out
