"""Cross-entropy over chunks of tokens, so that the ``tokens x vocab`` logits never exist at once.

At vocabulary 151k a causal LM's logits (and the float32 log-softmax autograd keeps for them) are
the largest tensors of a fine-tuning step. ``chunked_cross_entropy`` computes
``hidden @ weight.T`` and the summed cross-entropy one chunk of tokens at a time, and makes each
chunk's gradients while its logits exist (``softmax - target``, times the hidden states and the
weight), so autograd keeps the gradients, never the logits, and no chunk is computed twice. The
per-token log-probs DPO and GRPO need (``chunked_token_logps``) are checkpointed chunks instead:
autograd keeps a chunk's hidden states and recomputes its logits in backward. Sums are float32
whatever the model dtype, and the loss
is divided by the step's ``num_items_in_batch`` like every trainfold loss, so gradients are those of
the plain loss (to float32 rounding) and independent of how the step is split.

``chunked_causal_lm(model, chunk_size)`` is the objective for Hugging Face causal LMs, unpatched:
it asks the model for its final hidden states and no logits (``logits_to_keep`` of no positions)
and applies the output embedding itself.

>>> import torch
>>> hidden, weight = torch.randn(2, 5, 4), torch.randn(11, 4)
>>> labels = torch.tensor([[1, 2, -100, 4, 5], [6, 7, 8, 9, 10]])
>>> plain = torch.nn.functional.cross_entropy((hidden @ weight.T).reshape(-1, 11), labels.reshape(-1),
...                                           reduction="sum") / 9
>>> torch.allclose(chunked_cross_entropy(hidden, weight, labels, 9, chunk_size=3), plain)
True
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Protocol, cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from trainfold.core.counting import IGNORE_INDEX, count_shifted_labels

__all__ = [
    "ChunkedCausalLM",
    "OutputHead",
    "chunked_causal_lm",
    "chunked_cross_entropy",
    "check_chunk_size",
    "chunked_token_logps",
    "output_head",
]


def _check_labels(labels: Tensor, vocab: int) -> None:
    bad = (labels >= vocab) | ((labels < 0) & (labels != IGNORE_INDEX))
    if bool(bad.any()):
        values = labels[bad].unique()[:8].tolist()
        raise ValueError(
            f"labels {values} are outside the {vocab} rows of the output embedding (valid: "
            f"0..{vocab - 1} or {IGNORE_INDEX}); check the tokenizer against the model"
        )


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias``, chunk by chunk, its gradients made on the way.

    Each chunk's logits exist once: the forward pass computes the chunk's loss and, where inputs need
    them, its gradients (``softmax - target`` times the chunk's hidden states and the weight), so the
    backward pass only scales them. Three matrix products per chunk, as the plain loss has in all.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        chunk_size: int,
        label_smoothing: float,
    ) -> Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        need_b = need_b and bias is not None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            logits = F.linear(h, weight, bias).float()
            loss, lse = _chunk_loss(logits, y, label_smoothing)
            total = total + loss
            if grad_h is None and grad_w is None and grad_b is None:
                continue
            d = _logit_grads(logits, y, lse, label_smoothing)
            if grad_b is not None:
                grad_b += d.sum(0)
            d = d.to(weight.dtype)
            if grad_h is not None:
                grad_h[start : start + chunk_size] = d @ weight
            if grad_w is not None:
                if grad_w.dtype == d.dtype:
                    grad_w.addmm_(d.T, h)  # no temporary of the weight's size
                else:
                    grad_w += (d.T @ h).float()
        # Kept in the weight's dtype until backward: a float32 copy of a bf16 embedding would double it.
        ctx.save_for_backward(
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None or bias is None else grad_b.to(bias.dtype),
        )
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors  # made for this call alone: scaled in place, no second copy
        scale = [None if g is None else g.mul_(grad.to(g.dtype)) for g in (grad_h, grad_w, grad_b)]
        return (*scale, None, None, None)


def _chunk_loss(logits: Tensor, labels: Tensor, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """Return the chunk's summed (label-smoothed) cross-entropy and its logits' log-sum-exp."""
    lse = torch.logsumexp(logits, dim=-1)
    per = (lse - logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]) * (1 - label_smoothing)
    if label_smoothing:
        per = per + label_smoothing * (lse - logits.mean(-1))
    return (per * (labels != IGNORE_INDEX).to(logits.dtype)).sum(), lse


def _logit_grads(logits: Tensor, labels: Tensor, lse: Tensor, label_smoothing: float) -> Tensor:
    """Return the summed loss's gradient with respect to the chunk's float32 ``logits`` (``softmax - target``,
    zero at ignored labels), made in the logits' memory."""
    target = labels.clamp(min=0)[:, None]
    d = logits.sub_(lse[:, None]).exp_()  # the softmax
    d.scatter_add_(1, target, torch.full_like(target, label_smoothing - 1, dtype=d.dtype))
    if label_smoothing:
        d -= label_smoothing / logits.shape[-1]
    d *= (labels != IGNORE_INDEX).to(d.dtype)[:, None]
    return d


def _flat(hidden: Tensor, labels: Tensor, weight: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden states of shape {tuple(hidden.shape)} do not fit labels of shape {tuple(labels.shape)}: "
            "expected hidden shaped labels.shape + (hidden_size,)"
        )
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the output embedding's {tuple(weight.shape)}")
    check_chunk_size(chunk_size)
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    num_items_in_batch: Tensor | int,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 256,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Return ``sum of cross_entropy(hidden @ weight.T + bias, labels) / num_items_in_batch``, chunk by chunk.

    ``hidden`` is ``labels.shape + (hidden_size,)``; labels of -100 are ignored (already shifted for a
    causal LM). Only ``chunk_size`` tokens' logits exist at a time; their gradients are made in the
    forward pass (so no second forward is needed), which is why it has no second derivative.
    """
    h, y = _flat(hidden, labels, weight, chunk_size)
    if not torch.compiler.is_compiling():  # a data-dependent check: the eager step makes it
        _check_labels(y, weight.shape[0])
    total = _LinearCrossEntropy.apply(h, weight, bias, y, chunk_size, float(label_smoothing))
    denom = (
        num_items_in_batch.clamp(min=1) if isinstance(num_items_in_batch, Tensor) else max(int(num_items_in_batch), 1)
    )
    return total / denom


def _chunk_logps(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float) -> Tensor:
    logits = F.linear(hidden, weight, bias).float() / temperature
    safe = labels.clamp(min=0)
    picked = logits.gather(-1, safe[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return picked.masked_fill(labels == IGNORE_INDEX, 0.0)


def chunked_token_logps(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 256,
    temperature: float = 1.0,
) -> Tensor:
    """Return each label's log-probability (0 where the label is -100), shaped like ``labels``, chunk by chunk.

    The per-token log-probs DPO and GRPO sum over completions, without the full logits.

    >>> import torch
    >>> h, w = torch.randn(1, 3, 4), torch.randn(7, 4)
    >>> y = torch.tensor([[2, -100, 6]])
    >>> plain = torch.log_softmax(h @ w.T, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0] * (y != -100)
    >>> torch.allclose(chunked_token_logps(h, w, y, chunk_size=2), plain)
    True
    """
    h, y = _flat(hidden, labels, weight, chunk_size)
    parts = []
    for start in range(0, h.shape[0], chunk_size):
        part = (h[start : start + chunk_size], weight, bias, y[start : start + chunk_size], temperature)
        parts.append(
            checkpoint(_chunk_logps, *part, use_reentrant=False, preserve_rng_state=False)
            if torch.is_grad_enabled()
            else _chunk_logps(*part)
        )
    return torch.cat(parts).reshape(labels.shape) if parts else h.new_zeros(labels.shape, dtype=torch.float32)


def _refusal(model: nn.Module) -> str | None:
    """Say why ``model``'s logits are not ``hidden @ output_embedding.T (+ bias)``, or None when they are."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(head, nn.Linear):
        return (
            f"{type(model).__name__} has no output embedding (get_output_embeddings() returned "
            f"{type(head).__name__}); chunked cross-entropy needs a transformers causal LM"
        )
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no logits_to_keep, so it cannot skip computing the logits"
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"{type(model).__name__} transforms its logits ({name}={getattr(config, name)!r})"
    return None


class _CausalLM(Protocol):
    def get_output_embeddings(self) -> nn.Linear: ...


def _output_layer(model: nn.Module) -> nn.Linear:
    """Return ``model.get_output_embeddings()``, which ``_refusal`` checked is an ``nn.Linear``."""
    # cast: nn.Module's stubs type every attribute as Tensor | Module, so a subclass's method is not callable
    return cast(_CausalLM, model).get_output_embeddings()


@attrs.frozen(eq=False)
class OutputHead:
    """Where a causal LM's logits come from: its final hidden states times its output embedding (+ bias).

    ``hidden(forward, params, inputs)`` runs the model for its final hidden states and no logits;
    ``weight(params)`` is the output embedding among ``params`` (a frozen one is read from the module).
    """

    model: nn.Module
    weight_name: str | None

    def hidden(self, forward: Any, params: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Tensor:
        """Return the final hidden states ``(batch, seq, hidden)`` of ``forward(params, inputs)``.

        It computes no logits.
        """
        first = next(iter(inputs.values()))
        no_positions = torch.empty(0, dtype=torch.long, device=first.device)
        outputs = forward(params, {**inputs, "logits_to_keep": no_positions, "output_hidden_states": True})
        return outputs.hidden_states[-1]

    def weight(self, params: Mapping[str, Tensor]) -> Tensor:
        """Return the output embedding ``(vocab, hidden)`` of ``params``."""
        if self.weight_name is not None and self.weight_name in params:
            return params[self.weight_name]
        return _output_layer(self.model).weight

    @property
    def bias(self) -> Tensor | None:
        """Return the output layer's bias, if it has one."""
        return _output_layer(self.model).bias


def _reproduces_logits(head: OutputHead) -> bool:
    """Check once, on three tokens in eval mode, that ``hidden @ weight.T + bias`` gives the model's own logits."""
    model = head.model
    was_training = [m.training for m in model.modules()]
    weight = _output_layer(head.model).weight
    ids = torch.arange(3, device=weight.device)[None] % weight.shape[0]

    def forward(params: Any, inputs: Mapping[str, Tensor]) -> Any:
        return model(**inputs, use_cache=False)

    try:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits.float()
            hidden = head.hidden(forward, {}, {"input_ids": ids})
            mine = F.linear(hidden, weight, head.bias).float()
    finally:
        for m, flag in zip(model.modules(), was_training):
            m.training = flag
    return mine.shape == logits.shape and torch.allclose(mine, logits, rtol=1e-3, atol=1e-3)


def output_head(model: nn.Module) -> OutputHead:
    """Return ``model``'s :class:`OutputHead`; refuse models whose logits are not a linear map of the hidden states.

    Besides the known logit transforms (soft-capping, scaling), one forward pass on three tokens checks that the
    final hidden states times the output embedding are the model's own logits.
    """
    reason = _refusal(model)
    weight = _output_layer(model).weight if reason is None else None
    head = (
        None
        if weight is None
        else OutputHead(model, next((n for n, p in model.named_parameters() if p is weight), None))
    )  # a tied weight: its first name
    if head is not None and not _reproduces_logits(head):
        reason = (
            f"{type(model).__name__}'s final hidden states times its output embedding are not its logits "
            "(checked on three tokens)"
        )
    if reason is not None:
        raise ValueError(
            f"chunked cross-entropy cannot reproduce this model's logits: {reason}; train without loss_chunk_size"
        )
    assert head is not None
    return head


def check_chunk_size(chunk_size: int) -> None:
    """Raise ``ValueError`` unless ``chunk_size`` is a positive int."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")


@attrs.frozen(eq=False)
class ChunkedCausalLM:
    """The objective of :func:`chunked_causal_lm`: next-token cross-entropy without the full logits."""

    head: OutputHead
    chunk_size: int
    label_smoothing: float = 0.0
    label_key: str = "labels"

    def count_items(self, micro: Mapping[str, Tensor]) -> Tensor:
        """Count the micro-batch's targets: labels that are not -100 after the causal shift."""
        return count_shifted_labels(micro[self.label_key])

    def __call__(
        self,
        forward: Any,
        params: Mapping[str, Tensor],
        micro: Mapping[str, Tensor],
        num_items: Tensor,
        key: torch.Generator | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        if self.label_key not in micro:
            raise KeyError(f"micro-batch has no {self.label_key!r} key (keys: {sorted(micro)})")
        labels = micro[self.label_key]
        hidden = self.head.hidden(forward, params, {k: v for k, v in micro.items() if k != self.label_key})
        if hidden.shape[:2] != labels.shape:
            raise ValueError(
                f"final hidden states of shape {tuple(hidden.shape)} do not fit labels {tuple(labels.shape)}"
            )
        loss = chunked_cross_entropy(
            hidden[:, :-1],
            self.head.weight(params),
            labels[:, 1:],
            num_items,
            bias=self.head.bias,
            chunk_size=self.chunk_size,
            label_smoothing=self.label_smoothing,
        )
        return loss, {}


def chunked_causal_lm(model: nn.Module, chunk_size: int = 256, label_smoothing: float = 0.0) -> ChunkedCausalLM:
    """Return the objective that trains ``model`` (a transformers causal LM) on chunked next-token cross-entropy.

    Pass it as ``make_step(model, loss, opt, objective=chunked_causal_lm(model, 2048))``, or set
    ``TrainingArguments(loss_chunk_size=2048)``. Models whose logits are not a plain linear map of the
    final hidden states (logit soft-capping, scaling) are refused by name.
    """
    head = output_head(model)
    check_chunk_size(chunk_size)
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return ChunkedCausalLM(head, chunk_size, label_smoothing)
