"""Sampling from a causal LM run functionally on a param dict: TinyLM or a Hugging Face model.

``generate(model, params, prompts, ...)`` draws completions token by token. There is no KV cache:
each new token runs the model on the whole (right-padded) batch and reads the logits at every
row's last real position. Attention is causal, so padding to the right of a row never changes
what the row sees, and the result is the same as sampling each prompt alone. For the small
models this serves (tests, examples, RL on CPU) that is fast enough and obviously correct.

>>> import torch
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=16))
>>> params = dict(model.named_parameters())
>>> out = generate(model, params, [[1, 2], [3]], max_new_tokens=4, temperature=1.0,
...                eos_token_id=None, generator=torch.Generator().manual_seed(0))
>>> [len(c) for c in out]
[4, 4]
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from trainfold.core.forward import Forward, make_forward, train_mode
from trainfold.core.losses import logits_of

__all__ = ["before_eos", "filter_logits", "functional_forward", "generate", "pad_right", "token_logps"]


def functional_forward(model: nn.Module, buffers: Mapping[str, Tensor] | None = None) -> Forward:
    """Return ``forward(params, inputs)``: ``model`` run on ``params`` (and ``buffers``), weights untouched.

    ``trainfold.core.forward.make_forward`` made lenient: tensors of the model that ``params`` and
    ``buffers`` do not name (buffers, frozen weights) are taken from the model itself (detached), and
    ``params`` win over ``buffers`` where both name a tensor.

    >>> import torch
    >>> lin = torch.nn.Linear(1, 1)
    >>> fwd = functional_forward(lin)
    >>> fwd({"weight": torch.tensor([[2.0]]), "bias": torch.tensor([1.0])}, {"input": torch.tensor([[3.0]])}).item()
    7.0
    """

    def forward(params: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Any:
        given = {**(buffers or {}), **params}
        rest = {
            k: v.detach() for k, v in itertools.chain(model.named_parameters(), model.named_buffers()) if k not in given
        }
        return make_forward(model, rest)(given, inputs)

    return forward


def pad_right(rows: Sequence[Sequence[int]], pad_token_id: int = 0) -> tuple[Tensor, Tensor]:
    """Return ``(input_ids, attention_mask)`` of ``rows`` right-padded to the longest.

    >>> ids, mask = pad_right([[5, 6], [7]])
    >>> ids.tolist(), mask.tolist()
    ([[5, 6], [7, 0]], [[1, 1], [1, 0]])
    """
    if not rows:
        raise ValueError("pad_right needs at least one row")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def token_logps(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Return the log-prob of each next token: ``out[b, t] = log p(input_ids[b, t+1] | ids[b, :t+1])``.

    The result has shape ``(batch, seq - 1)``; logits are divided by ``temperature`` and upcast to
    float32.

    >>> import torch
    >>> lp = token_logps(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]]))
    >>> [round(x, 4) for x in lp[0].tolist()]  # uniform over 4: ln(1/4)
    [-1.3863, -1.3863]
    """
    shifted = logits[:, :-1, :].float() / temperature
    picked = shifted.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return picked - shifted.logsumexp(-1)


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Return ``logits`` with the tokens outside the top ``top_k`` and the ``top_p`` nucleus set to ``-inf``.

    transformers' ``TopKLogitsWarper`` then ``TopPLogitsWarper`` (one token always kept); ``top_k=0`` and
    ``top_p=1.0`` keep every token (and return ``logits`` itself).

    >>> import torch
    >>> filter_logits(torch.tensor([[1.0, 3.0, 2.0]]), top_k=2).tolist()
    [[-inf, 3.0, 2.0]]
    >>> filter_logits(torch.log(torch.tensor([[0.5, 0.3, 0.2]])), top_p=0.6).isinf().tolist()
    [[False, False, True]]
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1:] = False  # keep at least one token
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


def _check(prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float) -> None:
    problems = []
    if not prompts or any(len(p) == 0 for p in prompts):
        problems.append("every prompt must hold at least one token (and there must be at least one prompt)")
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        problems.append(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if problems:
        raise ValueError("; ".join(problems))


@torch.no_grad()
def generate(
    model: nn.Module,
    params: Mapping[str, Tensor],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int = 0,
    buffers: Mapping[str, Tensor] | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[list[int]]:
    """Sample a completion for each prompt (token id lists); return the completions' token ids.

    Tokens are drawn from ``softmax(filter_logits(logits / temperature, top_k, top_p))`` with ``generator``
    (``temperature=0``: argmax; a CPU generator serves any device). A completion stops after its first
    ``eos_token_id`` (kept) or ``max_new_tokens`` tokens; the model runs in eval mode on ``params``, untouched.

    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> params = dict(model.named_parameters())
    >>> greedy = generate(model, params, [[1, 2], [3]], max_new_tokens=3, temperature=0)
    >>> [len(c) for c in greedy], greedy == generate(model, params, [[1, 2], [3]], max_new_tokens=3, temperature=0)
    ([3, 3], True)
    >>> stop = greedy[0][0]  # ends right after its first token, which it keeps
    >>> generate(model, params, [[1, 2]], max_new_tokens=3, temperature=0, eos_token_id=stop) == [[stop]]
    True
    """
    _check(prompts, max_new_tokens, temperature)
    forward = functional_forward(model, buffers)
    device = next(iter(params.values())).device
    seqs = [list(map(int, p)) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    with train_mode(model, False):
        for _ in range(max_new_tokens):
            if not active:
                break
            ids, mask = pad_right([seqs[i] for i in active], pad_token_id)
            logits = logits_of(forward(params, {"input_ids": ids.to(device), "attention_mask": mask.to(device)}))
            last = logits[torch.arange(len(active), device=device), (mask.sum(1) - 1).to(device)].float()
            if temperature == 0:
                nxt = last.argmax(-1)
            else:
                probs = torch.softmax(filter_logits(last / temperature, top_k, top_p), dim=-1)
                if generator is not None and generator.device.type != probs.device.type:
                    probs = probs.to(generator.device)  # draw where the generator lives
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(device)
            still = []
            for i, tok in zip(active, nxt.tolist()):
                seqs[i].append(tok)
                out[i].append(tok)
                if tok != eos_token_id:
                    still.append(i)
            active = still
    return out


def before_eos(tokens: list[int], eos: int | None) -> list[int]:
    """Return ``tokens`` up to (not including) the first ``eos``.

    >>> before_eos([4, 5, 2, 6], 2), before_eos([4, 5], None)
    ([4, 5], [4, 5])
    """
    return tokens[: tokens.index(eos)] if eos is not None and eos in tokens else tokens
