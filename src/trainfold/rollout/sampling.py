"""One request completed on a param dict: ``trainfold.core.generate`` with the request's own generator, then
the completion's log-probs from one forward pass over prompt and completion (as the trainer recomputes them).

Local and process engines both call :func:`complete`, so on the same weights they agree bitwise.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from trainfold.core.forward import train_mode
from trainfold.core.generate import functional_forward, generate, token_logps
from trainfold.core.losses import logits_of
from trainfold.rollout.engine import Completion, RolloutRequest

__all__ = ["complete"]


@torch.no_grad()
def complete(
    model: nn.Module,
    params: Mapping[str, Tensor],
    request: RolloutRequest,
    version: int,
    *,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    buffers: Mapping[str, Tensor] | None = None,
) -> Completion:
    """Return ``request`` completed with ``params`` (weight ``version``).

    Tokens are ``core.generate``'s for this one prompt with ``torch.Generator().manual_seed(spec.seed)``;
    log-probs are ``core.generate.token_logps`` at the spec's temperature (1.0 when greedy) over the
    unfiltered distribution, float32.
    """
    spec = request.spec
    prompt = list(request.prompt_ids)
    (ids,) = generate(
        model,
        params,
        [prompt],
        max_new_tokens=spec.max_new_tokens,
        temperature=spec.temperature,
        eos_token_id=eos_token_id,
        generator=torch.Generator().manual_seed(spec.seed),
        pad_token_id=pad_token_id,
        buffers=buffers,
        top_k=spec.top_k,
        top_p=spec.top_p,
    )
    device = next(iter(params.values())).device
    full = torch.tensor([prompt + ids], dtype=torch.long, device=device)
    with train_mode(model, False):
        inputs = {"input_ids": full, "attention_mask": torch.ones_like(full)}
        logits = logits_of(functional_forward(model, buffers)(params, inputs))
    logps = token_logps(logits, full, spec.temperature or 1.0)[0, len(prompt) - 1 :].float().cpu()
    stopped = bool(ids) and eos_token_id is not None and ids[-1] == eos_token_id
    return Completion(request, tuple(ids), logps, ((int(version), 0),), "stop" if stopped else "length")
