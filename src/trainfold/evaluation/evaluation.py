"""Evaluation: a transduction of eval batches under ``torch.inference_mode()``.

``evaluate_batches`` runs the forward pass on given parameters, maps each batch to its summed loss, item
count and (when metrics need them) its predictions, optionally reduced on the device by
``preprocess_logits_for_metrics``, and folds these with the reducers of ``trainfold.evaluation.reducers``.
The eval loss is HF ``Trainer.evaluate``'s: each batch's mean loss weighted by the batch's rows (so it
depends on how rows are batched when their token counts differ); ``{prefix}_token_loss`` is the mean over all
items, ``sum of losses / number of items``, which does not depend on the eval batch size or padding.
Predictions come back in the order of ``batches``,
right-padded with -100 along dim 1, moved to the CPU every ``eval_accumulation_steps`` batches.

>>> import torch
>>> model = torch.nn.Embedding(5, 5)
>>> batches = [{"input": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}]
>>> with torch.no_grad():
...     _ = model.weight.zero_()
>>> forward = lambda params, inputs: torch.nn.functional.embedding(inputs["input"], params["weight"])
>>> m = evaluate_batches(forward, dict(model.named_parameters()), batches, speed_metrics=False)
>>> round(m["eval_loss"], 4)  # ln 5
1.6094

When to evaluate (``eval_strategy`` and friends) is decided in ``trainfold.evaluation.schedule``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
from torch import Tensor, nn

from trainfold.distributed.distributed import GatherCollective
from trainfold.evaluation.gather import merged_parts
from trainfold.evaluation.metrics import (
    PredictionOutput,
    final_metrics,
    throughput,
    to_numpy,
)
from trainfold.evaluation.pipeline import eval_fold
from trainfold.evaluation.reducers import combine
from trainfold.evaluation.spec import EvalSpec

__all__ = ["evaluate_batches", "predict_batches"]


def _outcome(
    spec: EvalSpec,
    model_or_forward: Any,
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    buffers: Any,
    collective: GatherCollective | None,
    *,
    gather: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    # What every entry point shares: run the pipeline, merge the ranks (if any), time it, make the metrics.
    start = time.perf_counter()
    parts, acc = eval_fold(spec, model_or_forward, params, batches, gather=gather, buffers=buffers)
    if collective is None:
        out = {**combine(parts).complete(acc), "runtime": time.perf_counter() - start}
    else:
        out = merged_parts(parts, acc, collective, time.perf_counter() - start)
    speed = throughput(out["runtime"], out["samples"], out["batches"]) if spec.speed_metrics else None
    metrics = final_metrics(
        out.get("tensors") or {},
        out["loss"] if out["labelled"] else None,
        spec.compute_metrics,
        prefix=spec.metric_key_prefix,
        as_numpy=spec.as_numpy,
        speed=speed,
        objective_metrics=out["metrics"],
        token_loss=out["token_loss"] if out["labelled"] and spec.objective is None else None,
    )
    return out, metrics


def evaluate_batches(
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    spec: EvalSpec | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    collective: GatherCollective | None = None,
    **settings: Any,
) -> dict[str, float]:
    """Evaluate ``params`` on ``batches`` and return metrics named ``{metric_key_prefix}_*``.

    ``model_or_forward`` is an ``nn.Module`` (run in eval mode through ``functional_call``; its
    buffers are used unless ``buffers`` is given) or a ``forward(params, inputs)`` function.
    ``params`` is a dict of tensors, a ``TrainState`` (its params and buffers), or ``None`` for
    the module's own. Each batch is a dict of tensors. The settings are one :class:`EvalSpec` record, ``spec``
    (``loss``, ``compute_metrics``, ``eval_accumulation_steps``, ``metric_key_prefix`` ...; see it for each), or
    its fields as keywords (they replace the ``spec``'s).
    With ``collective`` (every rank calls it with the batches of its own contiguous shard, from
    ``trainfold.distributed.shard``), each rank's ``(loss sum, item count)``, ``(weighted batch means, rows)`` and
    metric accumulators are merged
    with the reducers' ``merge`` (never an average of averages) and every rank returns the whole set's metrics.
    A NaN or infinite loss in any batch shows in the eval loss (HF drops non-finite batch losses).

    >>> import torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> rows = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    >>> one = evaluate_batches(model, None, [{"input_ids": rows, "labels": rows}], speed_metrics=False,
    ...                compute_metrics=lambda p: {"rows": p.predictions.shape[0]})
    >>> sorted(one), one["eval_rows"]
    (['eval_loss', 'eval_rows', 'eval_token_loss'], 2)
    >>> rows_one_by_one = [{"input_ids": r[None], "labels": r[None]} for r in rows]
    >>> two = evaluate_batches(model, None, rows_one_by_one, speed_metrics=False)
    >>> round(one["eval_token_loss"], 5) == round(two["eval_token_loss"], 5)  # the token mean: batching does not matter
    True
    """
    spec = attrs.evolve(spec if spec is not None else EvalSpec(), **settings)
    _, metrics = _outcome(spec, model_or_forward, params, batches, buffers, collective, gather=spec.gathers)
    return metrics


def predict_batches(
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    spec: EvalSpec | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    collective: GatherCollective | None = None,
    **settings: Any,
) -> PredictionOutput:
    """Return predictions and labels for ``batches`` in their order, and the metrics ``evaluate_batches`` gives.

    Predictions are ``predictions_of(outputs)`` after ``preprocess_logits_for_metrics``, padded
    with -100 along dim 1; ``label_ids`` is ``None`` when batches have no labels (both are ``None``
    with ``prediction_loss_only``, as in HF). Metric names
    are prefixed with ``test`` by default, as in HF (a ``spec``'s own prefix otherwise). ``spec``, ``settings`` and
    ``collective`` are ``evaluate_batches``'s: with ``collective``, every rank gets the whole set's predictions, in
    dataset order.

    >>> import torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> batches = [{"input_ids": torch.tensor([[1, 2, 3, 4]]), "labels": torch.tensor([[1, 2, 3, 4]])},
    ...            {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, 6, 7]])}]
    >>> out = predict_batches(model, None, batches, speed_metrics=False)
    >>> list(out.predictions.shape), out.label_ids.tolist(), sorted(out.metrics)
    ([2, 4, 16], [[1, 2, 3, 4], [5, 6, 7, -100]], ['test_loss', 'test_token_loss'])
    """
    spec = attrs.evolve(spec, **settings) if spec is not None else EvalSpec(**{"metric_key_prefix": "test", **settings})
    gather = not spec.prediction_loss_only  # as HF: the loss alone, no predictions
    out, metrics = _outcome(spec, model_or_forward, params, batches, buffers, collective, gather=gather)
    tensors = out.get("tensors") or {}
    conv = to_numpy if spec.as_numpy else (lambda x: x)
    return PredictionOutput(conv(tensors.get("predictions")), conv(tensors.get("label_ids")), metrics)


# ``trainfold.evaluate``/``predict`` are the run-level ones (a model, TrainingArguments and a dataset); these
# take params and batches, and had the same names before (one meaning per public name)
