"""Sharded evaluation: each rank evaluates its own shard and every rank returns the whole eval set's results.

Each rank evaluates a contiguous slice of the eval set (``trainfold.distributed.shard``) with the
one-process pipeline; the ranks' loss, count and metric accumulators are merged with the
reducers' ``merge`` and the predictions gathered back in dataset order (``trainfold.evaluation.gather``),
so every rank returns what one process would on the whole set.

>>> import torch
>>> from trainfold.distributed.distributed import SingleProcess
>>> forward = lambda params, inputs: torch.nn.functional.embedding(inputs["input"], params["weight"])
>>> batches = [{"input": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}]
>>> m = evaluate_sharded(
...     forward, {"weight": torch.zeros(5, 5)}, batches, collective=SingleProcess(), speed_metrics=False
... )
>>> round(m["eval_loss"], 4)  # ln 5, over the 2 labels left after the causal shift
1.6094
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor, nn

from trainfold.core.losses import causal_lm, logits_of
from trainfold.distributed.distributed import GatherCollective
from trainfold.evaluation.evaluation import evaluate_with, predict_with
from trainfold.evaluation.metrics import EvalPrediction, PredictionOutput
from trainfold.evaluation.spec import EvalSpec

__all__ = ["evaluate_sharded", "predict_sharded"]


def evaluate_sharded(
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    collective: GatherCollective | None,
    loss: Callable[..., Tensor] = causal_lm,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    prediction_loss_only: bool = False,
    metric_key_prefix: str = "eval",
    label_key: str = "labels",
    buffers: Mapping[str, Tensor] | None = None,
    predictions_of: Callable[[Any], Any] = logits_of,
    as_numpy: bool = True,
    speed_metrics: bool = True,
    eval_accumulation_steps: int | None = None,
    include_for_metrics: Iterable[str] = (),
    main_input_name: str = "input_ids",
    move: Callable[[Tensor], Tensor] | None = None,
    objective: Callable[..., Any] | None = None,
) -> dict[str, float]:
    """Evaluate this rank's shard (``batches``, from ``shard``) and return the whole eval set's metrics.

    Every rank must call it, with the batches of its own contiguous shard. The eval loss is the
    token-level mean over all ranks: each rank's ``(loss sum, item count)`` accumulator is merged
    with ``mean_loss``'s ``merge``, never an average of averages. With ``compute_metrics``, the
    (preprocessed) predictions, labels and ``include_for_metrics`` are moved to the host every
    ``eval_accumulation_steps`` batches, then gathered in rank order, i.e. dataset order, and
    ``compute_metrics`` sees the whole set on every rank, so every rank returns the same metrics.
    An ``objective``'s metrics are merged like the loss: exact means over every rank's items.
    The settings are those of :class:`EvalSpec`; this is ``evaluate_with(EvalSpec(...), ...,
    collective=collective)``, and ``collective=None`` is one process (``evaluate``).
    """
    spec = EvalSpec.of(locals())
    return evaluate_with(spec, model_or_forward, params, batches, buffers=buffers, collective=collective)


def predict_sharded(
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    collective: GatherCollective | None,
    loss: Callable[..., Tensor] = causal_lm,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    metric_key_prefix: str = "test",
    label_key: str = "labels",
    buffers: Mapping[str, Tensor] | None = None,
    predictions_of: Callable[[Any], Any] = logits_of,
    as_numpy: bool = True,
    speed_metrics: bool = True,
    eval_accumulation_steps: int | None = None,
    include_for_metrics: Iterable[str] = (),
    main_input_name: str = "input_ids",
    move: Callable[[Tensor], Tensor] | None = None,
    objective: Callable[..., Any] | None = None,
    prediction_loss_only: bool = False,
) -> PredictionOutput:
    """Return the whole set's predictions and labels in dataset order, and its metrics, from this rank's shard.

    As :func:`evaluate_sharded`, but predictions are gathered (on every rank) unless ``prediction_loss_only``;
    ``collective=None`` is ``predict``.

    >>> import torch
    >>> from trainfold.distributed.distributed import SingleProcess
    >>> forward = lambda params, inputs: params["weight"][inputs["input"]]
    >>> batches = [{"input": torch.tensor([[0, 1]]), "labels": torch.tensor([[0, 1]])}]
    >>> out = predict_sharded(
    ...     forward, {"weight": torch.eye(2)}, batches, collective=SingleProcess(), speed_metrics=False
    ... )
    >>> out.predictions.tolist(), out.label_ids.tolist()
    ([[[1.0, 0.0], [0.0, 1.0]]], [[0, 1]])
    """
    spec = EvalSpec.of(locals())
    return predict_with(spec, model_or_forward, params, batches, buffers=buffers, collective=collective)
