"""Loss functions ``(outputs, labels, num_items_in_batch) -> Tensor``.

Each loss returns the *sum* over its micro-batch divided by the global ``num_items_in_batch``,
so adding the losses of the micro-batches of one optimizer step gives the exact mean over
the whole step, however the samples were split. A loss declares how its items are counted
with a ``count_items(labels) -> Tensor`` attribute; without one, the step counts the labels
that are not -100.

>>> import torch
>>> logits = torch.zeros(1, 3, 4)          # uniform over 4 classes
>>> labels = torch.tensor([[-100, 1, 2]])  # 2 items after the causal shift
>>> n = causal_lm.count_items(labels)
>>> round(causal_lm(logits, labels, n).item(), 4)  # ln 4
1.3863
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "IGNORE_INDEX",
    "Loss",
    "causal_lm",
    "cross_entropy",
    "count_labels",
    "count_shifted_labels",
    "logits_of",
    "counter_for",
    "label_smoothed",
    "dpo",
    "dpo_loss_errors",
    "DPO_LOSS_TYPES",
]

IGNORE_INDEX = -100
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")

Loss = Callable[[Any, Tensor, Tensor], Tensor]


def logits_of(outputs: Any) -> Tensor:
    """Return the logits of a model's outputs: a tensor, a mapping with ``"logits"``, or ``.logits``.

    >>> import torch
    >>> logits_of({"logits": torch.ones(1)}).tolist()
    [1.0]
    """
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    raise TypeError(
        f"cannot find logits in model outputs of type {type(outputs).__name__}: return a tensor, "
        "a mapping with a 'logits' key, or an object with a .logits attribute"
    )


def count_labels(labels: Tensor) -> Tensor:
    """Count labels that are not -100.

    >>> import torch
    >>> count_labels(torch.tensor([1, -100, 3])).item()
    2
    """
    return (labels != IGNORE_INDEX).sum()


def count_shifted_labels(labels: Tensor) -> Tensor:
    """Count labels that are not -100 after the causal shift (``labels[..., 1:]``).

    >>> import torch
    >>> count_shifted_labels(torch.tensor([[5, 1, -100]])).item()
    1
    """
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def counter_for(loss: Callable[..., Tensor]) -> Callable[[Tensor], Tensor]:
    """Return how ``loss`` counts its items: its ``count_items`` attribute, else ``count_labels``.

    >>> counter_for(causal_lm) is count_shifted_labels
    True
    """
    return getattr(loss, "count_items", count_labels)


def _raise_out_of_range(labels: Tensor, num_classes: int) -> None:
    valid = labels != IGNORE_INDEX
    bad = labels[valid & ((labels < 0) | (labels >= num_classes))].unique()[:8].tolist()
    raise ValueError(
        f"labels {bad} are outside the {num_classes} classes of the logits (valid: 0..{num_classes - 1} "
        f"or {IGNORE_INDEX} to ignore); check the tokenizer's vocabulary size against the model's"
    )


def _summed_cross_entropy(logits: Tensor, labels: Tensor, num_items: Tensor | int, label_smoothing: float = 0.0) -> Tensor:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not fit labels of shape {tuple(labels.shape)}: "
            "expected logits shaped labels.shape + (num_classes,); check the collator's labels key"
        )
    num_classes = logits.shape[-1]
    if labels.device.type != "cpu" and not torch.compiler.is_compiling():  # a device-side assert there: check first
        low, high = torch.aminmax(labels) if labels.numel() else (labels.new_zeros(()), labels.new_zeros(()))
        if int(high) >= num_classes or (int(low) < 0 and bool(((labels < 0) & (labels != IGNORE_INDEX)).any())):
            _raise_out_of_range(labels, num_classes)
    try:
        total = F.cross_entropy(
            logits.reshape(-1, num_classes).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum",
            label_smoothing=label_smoothing,
        )
    except IndexError:  # on the CPU torch checks the range itself; say what it means
        _raise_out_of_range(labels, num_classes)
    # An all-ignored step has num_items 0 and a zero sum: return 0, not NaN.
    denom = num_items.clamp(min=1) if isinstance(num_items, Tensor) else max(int(num_items), 1)
    return total / denom


def causal_lm(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int, label_smoothing: float = 0.0) -> Tensor:
    """Next-token cross-entropy: position t predicts ``labels[t + 1]``; -100 is ignored.

    Returns the summed loss of this micro-batch divided by ``num_items_in_batch``, the count of
    shifted labels that are not -100 over the whole optimizer step. Logits are upcast to float32.

    >>> import torch
    >>> logits = torch.zeros(1, 3, 4)              # uniform over 4 tokens: ln 4 per item
    >>> labels = torch.tensor([[1, 2, -100]])      # one item: position 0 predicts 2
    >>> round(causal_lm(logits, labels, 1).item(), 4), causal_lm.count_items(labels).item()
    (1.3863, 1)
    """
    logits = logits_of(outputs)
    if logits.dim() < 2 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not fit labels of shape {tuple(labels.shape)}: "
            "a causal LM needs logits shaped (batch, seq, vocab) and labels shaped (batch, seq)"
        )
    # Shift the labels, not the logits: no copy of the (large) logits, and HF's exact arithmetic.
    shifted = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return _summed_cross_entropy(logits, shifted, num_items_in_batch, label_smoothing)


causal_lm.count_items = count_shifted_labels  # type: ignore[attr-defined]


def cross_entropy(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int, label_smoothing: float = 0.0) -> Tensor:
    """Cross-entropy for classification and token classification (no shift); -100 is ignored.

    >>> import torch
    >>> logits = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    >>> round(cross_entropy(logits, torch.tensor([0, 1]), torch.tensor(2)).item(), 4)
    0.6931
    """
    return _summed_cross_entropy(logits_of(outputs), labels, num_items_in_batch, label_smoothing)


cross_entropy.count_items = count_labels  # type: ignore[attr-defined]


def label_smoothed(loss: Loss, epsilon: float) -> Loss:
    """Return ``causal_lm`` or ``cross_entropy`` with label smoothing ``epsilon`` (HF's ``label_smoothing_factor``).

    Each item's loss is ``(1 − ε)·nll + ε·mean over classes of −log p``, as HF's ``LabelSmoother``,
    but summed over the micro-batch and divided by the step's ``num_items_in_batch`` like every
    loss here (HF divides each micro-batch by its own count, so accumulation changes its result).

    >>> import torch
    >>> logits, labels = torch.tensor([[2.0, 0.0]]), torch.tensor([0])
    >>> plain, smooth = cross_entropy(logits, labels, 1), label_smoothed(cross_entropy, 0.1)(logits, labels, 1)
    >>> round(plain.item(), 4), round(smooth.item(), 4)
    (0.1269, 0.2269)
    """
    if loss not in (causal_lm, cross_entropy):
        raise ValueError("label smoothing applies to causal_lm and cross_entropy; a custom loss smooths its own labels")
    if not 0 <= epsilon < 1:
        raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")

    def smoothed(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int) -> Tensor:
        return loss(outputs, labels, num_items_in_batch, label_smoothing=epsilon)

    smoothed.count_items = loss.count_items  # type: ignore[attr-defined]
    smoothed.smooths = (loss, epsilon)  # type: ignore[attr-defined]  # what it smooths (the compiled step reads it)
    smoothed.__name__ = f"label_smoothed_{loss.__name__}"
    return smoothed


def warn_no_items(step: int) -> None:
    """Warn that an optimizer step had no labelled items and was skipped."""
    warnings.warn(
        f"optimizer step {step} had no labels other than -100 (num_items_in_batch == 0); the update "
        "was skipped and the parameters are unchanged. Check the collator's padding and label masking",
        RuntimeWarning,
        stacklevel=3,
    )


# -- preference losses ---------------------------------------------------------------------------


def dpo_loss_errors(beta: float, loss_type: str, label_smoothing: float) -> list[str]:
    """Return every problem with DPO loss settings (empty when they are valid).

    >>> dpo_loss_errors(0.1, "sigmoid", 0.0)
    []
    """
    problems = []
    if loss_type not in DPO_LOSS_TYPES:
        problems.append(f"loss_type={loss_type!r} is not one of {list(DPO_LOSS_TYPES)}")
    if not beta > 0:
        problems.append(f"beta={beta} must be > 0")
    if loss_type == "robust" and not 0 <= label_smoothing < 0.5:
        problems.append(f"label_smoothing={label_smoothing} must be in [0, 0.5) for the robust loss")
    if loss_type in ("sigmoid", "hinge", "ipo") and label_smoothing != 0:
        problems.append(
            f"label_smoothing={label_smoothing} has no effect on loss_type={loss_type!r}; "
            "use loss_type='robust' for noisy preference labels, or label_smoothing=0"
        )
    return problems


def dpo(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> Tensor:
    """Return the DPO loss of each pair (shape ``(pairs,)``; take ``.mean()`` for TRL's value).

    With ``ρ = policy − ref`` per sequence and ``Δ = ρ_c − ρ_r``:
    ``sigmoid`` ``−log σ(βΔ)``; ``hinge`` ``max(0, 1 − βΔ)``;
    ``ipo`` ``(ρ_c/n_c − ρ_r/n_r − 1/(2β))²`` with the completion lengths ``n`` (needs
    ``chosen_lengths`` and ``rejected_lengths``); ``robust``
    ``(−(1−ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε)`` with ``ε = label_smoothing``.

    >>> import torch
    >>> t = lambda *x: torch.tensor(x)
    >>> round(dpo(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5).item(), 4)  # -log σ(0.5·2)
    0.3133
    >>> dpo(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, loss_type="hinge").item()
    0.0
    """
    problems = dpo_loss_errors(beta, loss_type, label_smoothing)
    if loss_type == "ipo" and (chosen_lengths is None or rejected_lengths is None):
        problems.append("loss_type='ipo' is length-normalised: pass chosen_lengths and rejected_lengths")
    if problems:
        raise ValueError("; ".join(problems))
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    z = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type == "ipo":
        assert chosen_lengths is not None and rejected_lengths is not None
        margin = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
        return (margin - 1 / (2 * beta)) ** 2
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
