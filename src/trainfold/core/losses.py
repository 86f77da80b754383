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

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainfold.core.chunked_loss import chunked_causal_lm
from trainfold.core.counting import (
    IGNORE_INDEX,
    count_elements,
    count_labels,
    count_shifted_labels,
    counter_for,
    refuse_unlabelled,
    warn_no_items,
)
from trainfold.core.tasks import model_task

__all__ = [
    "IGNORE_INDEX",
    "Loss",
    "causal_lm",
    "cross_entropy",
    "mse",
    "bce_with_logits",
    "sequence_classification",
    "default_loss_for",
    "refuse_unlabelled",
    "count_labels",
    "count_shifted_labels",
    "logits_of",
    "loss_and_metrics",
    "MICRO_BATCH",
    "aux_reduction_of",
    "count_key",
    "counter_for",
    "label_smoothed",
    "chunked_causal_lm",
    "count_elements",
    "model_task",
    "warn_no_items",
]


Loss = Callable[[Any, Tensor, Tensor], Tensor]


MICRO_BATCH = "micro_batch"  # an aux_reduction: each micro-batch's aux are its own values, averaged unweighted


def count_key(name: str) -> str:
    """Return the key of metric ``name``'s count of micro-batches (``aux_reduction = "micro_batch"``).

    A micro-batch's ``aux`` may hold it, 0 or 1: 0 leaves the micro-batch out of ``name``'s mean (TRL's KTO appends
    no ``rewards/chosen`` for a micro-batch without desirable rows). A step reports each such metric as the mean
    of its micro-batches' values and, under this key, how many they were; a logging window (and an evaluation, over
    its batches) weighs the steps by it: the mean over every micro-batch since the last log, as TRL's ``log``.

    >>> count_key("entropy")
    'entropy#micro_batches'
    """
    return f"{name}#micro_batches"


def aux_reduction_of(objective: Any, loss: Any) -> str:
    """Return how a step reduces its ``aux`` over micro-batches: ``objective.aux_reduction`` (default ``"mean"``),
    else, for a loss's own ``metrics``, ``loss.aux_reduction`` (default ``"sum"``: divided by ``num_items`` as the
    loss). ``"micro_batch"`` (:data:`MICRO_BATCH`): each micro-batch's own value, averaged unweighted
    (:func:`count_key`).

    >>> aux_reduction_of(None, cross_entropy), aux_reduction_of(lambda *a: None, None)
    ('sum', 'mean')
    """
    if objective is not None:
        return getattr(objective, "aux_reduction", "mean")
    return getattr(loss, "aux_reduction", "sum")


def loss_and_metrics(
    loss: Callable[..., Tensor], outputs: Any, labels: Tensor, num_items: Tensor
) -> tuple[Tensor, Mapping[str, Tensor]]:
    """Return ``loss(outputs, labels, num_items)`` and the loss's own ``metrics(outputs, labels, num_items)``
    (``{}`` for a loss without: ``sft.sft_loss`` has TRL's). The metrics are divided by ``num_items`` as the loss
    is, so a step sums them over its micro-batches, unless the loss says ``aux_reduction = "micro_batch"``
    (:func:`aux_reduction_of`: ``sft_loss``'s are each micro-batch's own token means, as TRL's).

    >>> import torch
    >>> loss, metrics = loss_and_metrics(cross_entropy, torch.zeros(2, 4), torch.tensor([1, 2]), torch.tensor(2))
    >>> round(loss.item(), 4), dict(metrics)  # ln 4
    (1.3863, {})
    """
    metrics = getattr(loss, "metrics", None)
    return loss(outputs, labels, num_items), ({} if metrics is None else metrics(outputs, labels, num_items))


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


def _raise_out_of_range(labels: Tensor, num_classes: int) -> None:
    valid = labels != IGNORE_INDEX
    bad = labels[valid & ((labels < 0) | (labels >= num_classes))].unique()[:8].tolist()
    raise ValueError(
        f"labels {bad} are outside the {num_classes} classes of the logits (valid: 0..{num_classes - 1} "
        f"or {IGNORE_INDEX} to ignore); check the tokenizer's vocabulary size against the model's"
    )


def _summed_cross_entropy(
    logits: Tensor, labels: Tensor, num_items: Tensor | int, label_smoothing: float = 0.0
) -> Tensor:
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
            _wide(logits.reshape(-1, num_classes)),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            label_smoothing=label_smoothing,
        )
    except IndexError:  # on the CPU torch checks the range itself; say what it means
        _raise_out_of_range(labels, num_classes)
    # An all-ignored step has num_items 0 and a zero sum: return 0, not NaN.
    return total / _denominator(num_items)


def causal_lm(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int, label_smoothing: float = 0.0) -> Tensor:
    """Next-token cross-entropy: position t predicts ``labels[t + 1]``; -100 is ignored.

    Returns the summed loss of this micro-batch divided by ``num_items_in_batch``, the count of
    shifted labels that are not -100 over the whole optimizer step. Logits are upcast to float32 (float64 stays).

    >>> import torch
    >>> logits = torch.zeros(1, 3, 4)              # uniform over 4 tokens: ln 4 per item
    >>> labels = torch.tensor([[1, 2, -100]])      # one item: position 0 predicts 2
    >>> round(causal_lm(logits, labels, 1).item(), 4), causal_lm.count_items(labels).item()
    (1.3863, 1)
    """
    logits = logits_of(outputs)
    if logits.dim() < 3 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not fit labels of shape {tuple(labels.shape)}: "
            "causal_lm needs logits shaped (batch, seq, vocab) and labels shaped (batch, seq); for one label "
            "per sample (sequence classification) use losses.cross_entropy, or compute_loss_func="
        )
    # Shift the labels, not the logits: no copy of the (large) logits, and HF's exact arithmetic.
    shifted = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return _summed_cross_entropy(logits, shifted, num_items_in_batch, label_smoothing)


causal_lm.count_items = count_shifted_labels  # type: ignore[attr-defined]


def cross_entropy(
    outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int, label_smoothing: float = 0.0
) -> Tensor:
    """Cross-entropy for classification and token classification (no shift); -100 is ignored.

    >>> import torch
    >>> logits = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    >>> round(cross_entropy(logits, torch.tensor([0, 1]), torch.tensor(2)).item(), 4)
    0.6931
    """
    return _summed_cross_entropy(logits_of(outputs), labels, num_items_in_batch, label_smoothing)


cross_entropy.count_items = count_labels  # type: ignore[attr-defined]


def _wide(t: Tensor) -> Tensor:
    """Return ``t`` in float32, or float64 when it is float64 (upcast, never down: a float64 model keeps its precision).

    >>> import torch
    >>> _wide(torch.ones(1, dtype=torch.bfloat16)).dtype, _wide(torch.ones(1, dtype=torch.float64)).dtype
    (torch.float32, torch.float64)
    """
    return t if t.dtype == torch.float64 else t.float()


def _denominator(num_items: Tensor | int) -> Tensor | int:
    return num_items.clamp(min=1) if isinstance(num_items, Tensor) else max(int(num_items), 1)


def mse(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int) -> Tensor:
    """Squared error summed over the micro-batch, divided by the step's label count (HF's regression loss).

    Logits must have the labels' shape, or the labels' shape plus a trailing 1 (``num_labels=1``
    with labels ``[batch]``); anything else is refused rather than broadcast.

    >>> import torch
    >>> logits, labels = torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 1.0])
    >>> mse(logits, labels, mse.count_items(labels)).item()   # (1 + 4) / 2
    2.5
    """
    logits = logits_of(outputs)
    if logits.shape != labels.shape and logits.shape != (*labels.shape, 1):
        raise ValueError(
            f"regression logits of shape {tuple(logits.shape)} do not fit labels of shape {tuple(labels.shape)}: "
            "expected the labels' shape, or (batch, 1) logits for (batch,) labels; check num_labels and the labels "
            "column"
        )
    error = _wide(logits).reshape(labels.shape) - _wide(labels)
    return (error * error).sum() / _denominator(num_items_in_batch)


mse.count_items = count_elements  # type: ignore[attr-defined]


def bce_with_logits(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int) -> Tensor:
    """Binary cross-entropy on logits, summed, divided by the step's label count (HF's multi-label loss).

    >>> import torch
    >>> logits, labels = torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])
    >>> round(bce_with_logits(logits, labels, 2).item(), 4)      # ln 2 per label
    0.6931
    """
    logits = logits_of(outputs)
    if logits.shape != labels.shape:
        ids = labels.dim() == logits.dim() - 1  # one float per row: class ids written as floats, most likely
        raise ValueError(
            f"multi-label logits of shape {tuple(logits.shape)} do not fit labels of shape {tuple(labels.shape)} "
            f"({labels.dtype}): float labels mean multi-label targets (HF's rule), (batch, num_labels), one 0/1 "
            "target per class"
            + (
                "; if they are class ids, make them integers (dataset.map(lambda r: {'labels': int(r['labels'])}), "
                "or cast the column to datasets.ClassLabel) for single-label cross-entropy; for one regression "
                "target per row, give the model num_labels=1"
                if ids
                else ""
            )
        )
    total = F.binary_cross_entropy_with_logits(_wide(logits), _wide(labels), reduction="sum")
    return total / _denominator(num_items_in_batch)


bce_with_logits.count_items = count_elements  # type: ignore[attr-defined]

_CLASS_INDEX_DTYPES = (torch.int64, torch.int32)


def _by_label_dtype(labels: Tensor) -> Callable[[Any, Tensor, Tensor | int], Tensor]:
    if labels.dtype in _CLASS_INDEX_DTYPES:
        return cross_entropy
    if labels.dtype.is_floating_point:
        return bce_with_logits
    raise TypeError(
        f"sequence classification labels of dtype {labels.dtype} are neither class indices (int64/int32: "
        "cross-entropy) nor float targets (multi-label BCE); cast the labels, or set config.problem_type"
    )


def sequence_classification(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int) -> Tensor:
    """HF's rule for ``num_labels > 1`` without ``problem_type``: integer labels → cross-entropy, float → BCE.

    HF decides this from the labels' dtype on the first forward pass; so does this loss, on every call.

    >>> import torch
    >>> logits = torch.zeros(1, 2)
    >>> round(sequence_classification(logits, torch.tensor([1]), 1).item(), 4)
    0.6931
    >>> round(sequence_classification(logits, torch.tensor([[1.0, 0.0]]), 2).item(), 4)
    0.6931
    """
    return _by_label_dtype(labels)(outputs, labels, num_items_in_batch)


def _count_by_label_dtype(labels: Tensor) -> Tensor:
    return counter_for(_by_label_dtype(labels))(labels)


sequence_classification.count_items = _count_by_label_dtype  # type: ignore[attr-defined]


def default_loss_for(model: Any, *, defer: bool = False) -> Loss:
    """Return the loss ``model``'s task trains with, chosen as transformers' own loss would be.

    Causal LMs → :func:`causal_lm`; token classification and masked LM → :func:`cross_entropy`
    (no shift); sequence classification by ``config.problem_type``, else ``num_labels``: 1 →
    :func:`mse`, otherwise :func:`sequence_classification` (integer labels → cross-entropy,
    float labels → BCE, decided from the labels as HF does). Anything else raises ``TypeError``
    asking for ``compute_loss_func``; with ``defer=True`` (an objective replaces the loss, or an
    evaluation may need none) the returned loss raises that error only if it is ever called.

    >>> import torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> default_loss_for(TinyLM(TinyLMConfig(vocab_size=8, d_model=4, n_layers=1, n_heads=1, max_len=4))).__name__
    'causal_lm'
    """
    task = model_task(model)
    if task == "causal_lm":
        return causal_lm
    if task in ("token_classification", "masked_lm"):
        return cross_entropy
    if task == "sequence_classification":
        return _sequence_classification_loss(model)
    why = {
        None: "it is not a model whose task trainfold knows (a causal LM, or a transformers "
        "...ForSequenceClassification / ...ForTokenClassification / ...ForMaskedLM head)",
        "ambiguous": "transformers lists its class under several tasks",
        "seq2seq": "it is a sequence-to-sequence model, whose decoder inputs come from the labels, which the step "
        "keeps from the model: put decoder_input_ids in the batches (transformers.DataCollatorForSeq2Seq(tokenizer, "
        "model=model) adds them) and take losses.cross_entropy (as the model's own loss, equal to HF's)",
    }.get(task, f"its task {task!r} has no built-in loss")
    error = TypeError(
        f"cannot choose a default loss for {type(model).__name__}: {why}. Pass compute_loss_func= (train) or "
        "loss= (make_step): trainfold.core.losses.causal_lm (next token), losses.cross_entropy (one class per label, "
        "no shift), losses.mse, losses.bce_with_logits, or your own loss(outputs, labels, num_items_in_batch)"
    )
    if not defer:
        raise error

    def no_default_loss(outputs: Any, labels: Tensor, num_items_in_batch: Tensor | int) -> Tensor:
        raise error

    return no_default_loss


def _sequence_classification_loss(model: Any) -> Loss:
    config = getattr(model, "config", None)
    problem = getattr(config, "problem_type", None)
    num_labels = getattr(config, "num_labels", None)
    if problem == "regression":
        return mse
    if problem == "single_label_classification":
        return cross_entropy
    if problem == "multi_label_classification":
        return bce_with_logits
    if problem is not None:
        raise ValueError(
            f"config.problem_type={problem!r} of {type(model).__name__} is not one of 'regression', "
            "'single_label_classification', 'multi_label_classification'; fix the config or pass compute_loss_func="
        )
    if num_labels is None:
        raise TypeError(f"{type(model).__name__} has no config.num_labels: pass compute_loss_func=")
    return mse if num_labels == 1 else sequence_classification


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
    if loss is sequence_classification:  # a classifier's default loss: smoothing needs class labels
        loss = cross_entropy
    if loss in (mse, bce_with_logits):
        raise ValueError(
            f"label smoothing applies to class labels (causal_lm, cross_entropy); {loss.__name__} "
            "takes float targets: set label_smoothing_factor=0"
        )
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
