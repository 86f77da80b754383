"""The eval pipeline: each batch scored under ``inference_mode`` and folded by the reducers of an eval run.

``eval_fold`` maps every batch to its summed loss, item count and (when gathering) its
predictions, and steps the parts of :func:`eval_parts` over them; the parts' accumulators come
back uncompleted, so one process completes them (``combine(parts).complete``) and several ranks
merge them first.

>>> import torch
>>> from trainfold.evaluation.spec import EvalSpec
>>> from trainfold.evaluation.reducers import combine
>>> forward = lambda params, inputs: torch.nn.functional.embedding(inputs["input"], params["weight"])
>>> batches = [{"input": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}]
>>> parts, acc = eval_fold(EvalSpec(), forward, {"weight": torch.zeros(5, 5)}, batches, gather=False)
>>> out = combine(parts).complete(acc)
>>> round(out["loss"], 4), round(out["token_loss"], 4), out["labelled"], out["samples"], out["batches"]  # ln 5
(1.6094, 1.6094, 1, 1, 1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.forward import cache_configs, cache_off, make_forward, train_mode
from trainfold.core.losses import MICRO_BATCH, aux_reduction_of, count_key, counter_for, logits_of
from trainfold.evaluation.concat import pad_concat
from trainfold.evaluation.reducers import (
    Reducer,
    collecting,
    combine,
    compose,
    counting,
    filtering,
    fold,
    mapping,
    mean_loss,
    offloading,
    summing,
    unreduced,
)
from trainfold.evaluation.spec import EvalSpec

__all__ = ["eval_fold", "eval_parts", "resolve_forward"]


@attrs.frozen
class _Plan:
    forward: Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], Any]
    params: Mapping[str, Tensor]
    spec: EvalSpec
    count_items: Callable[[Tensor], Tensor]
    device: torch.device | None
    gather: bool


@attrs.frozen(eq=False)
class _BatchOut:
    loss_sum: Tensor | None
    count: Tensor | None
    num_samples: int
    tensors: dict[str, Any]
    metric_sums: dict[str, Tensor] | None = None  # an objective's metrics times the batch's item count
    metric_count: Tensor | Mapping[str, Tensor] | None = None  # what metric_sums are divided by, where not count
    # (1: a batch's value; by name: a batch's count_key entries, 0 where it has no value of a metric)


def _to_device(batch: Mapping[str, Any], device: torch.device | None) -> dict[str, Any]:
    if device is None:
        return dict(batch)
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}


def _num_samples(batch: Mapping[str, Any]) -> int:
    for v in batch.values():
        if isinstance(v, Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 0


def _items(count: Callable[[Any], Any], of: Any) -> Tensor:
    # The one place an eval batch's item count is taken: a 0-d int64 tensor, whatever the counter returns.
    return torch.as_tensor(count(of)).reshape(()).to(torch.int64)


def _run_batch(plan: _Plan, batch: Mapping[str, Any]) -> _BatchOut:
    spec = plan.spec
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"eval batches must be dicts of tensors (with a {spec.label_key!r} key), got {type(batch).__name__}"
        )
    batch = _to_device(batch, plan.device)
    if spec.objective is not None:
        return _run_objective(plan, batch)
    labels = batch.get(spec.label_key)
    inputs = {k: v for k, v in batch.items() if k != spec.label_key}
    outputs = plan.forward(plan.params, inputs)
    loss_sum = count = sums = per_batch = None
    if labels is not None:
        count = _items(plan.count_items, labels)
        # The loss divides its sum by the count it is given; multiply back for the exact sum
        # (also right for a loss that returns a plain mean).
        loss_sum = spec.loss(outputs, labels, count).detach().double() * count.to(torch.float64)
        metrics = getattr(spec.loss, "metrics", None)  # a loss's own metrics (SFT's entropy...), as the step's
        if metrics is not None and aux_reduction_of(None, spec.loss) == MICRO_BATCH:  # sft_loss: batch means
            sums, per_batch = _batch_values(metrics(outputs, labels, count))
        elif metrics is not None:
            sums = {
                k: v.detach().double() * count.to(torch.float64) for k, v in metrics(outputs, labels, count).items()
            }
    tensors: dict[str, Any] = {}
    if plan.gather:
        tensors["predictions"] = spec.predictions_of(outputs)
        if labels is not None:
            tensors["label_ids"] = labels
        if "inputs" in spec.include_for_metrics:
            if spec.main_input_name not in inputs:
                raise KeyError(
                    f"include_for_metrics has 'inputs' but batches have no {spec.main_input_name!r} key "
                    f"(keys: {sorted(inputs)}); pass main_input_name="
                )
            tensors["inputs"] = inputs[spec.main_input_name]
        if "loss" in spec.include_for_metrics and labels is not None:
            tensors["losses"] = _sample_losses(plan, outputs, labels)
    return _BatchOut(
        loss_sum=loss_sum,
        count=count,
        num_samples=_num_samples(batch),
        tensors=tensors,
        metric_sums=sums,
        metric_count=per_batch,
    )


def _batch_values(aux: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    # aux_reduction "micro_batch": each metric is the batch's own value, counted once (0: the batch has none of it,
    # its count_key entry says so), so the eval metric is the mean over the batches that have it (TRL's).
    sums, counts = {}, {}
    for name, value in aux.items():
        if name.endswith(count_key("")):
            continue
        v = torch.as_tensor(value).detach().double().reshape(())
        n = torch.as_tensor(aux.get(count_key(name), 1.0)).detach().double().reshape(()).to(v.device)
        sums[name], counts[name] = torch.where(n > 0, v, 0.0) * n, n
    return sums, counts


def _objective_items(plan: _Plan, batch: Mapping[str, Any]) -> Tensor:
    # As the step counts: ``objective.count_items``, else the loss's count of the labels, else the rows.
    objective, label_key = plan.spec.objective, plan.spec.label_key
    count_items = getattr(objective, "count_items", None)
    if count_items is not None:
        return _items(count_items, batch)
    if label_key in batch:
        return _items(plan.count_items, batch[label_key])
    return _items(_num_samples, batch)


def _run_objective(plan: _Plan, batch: Mapping[str, Any]) -> _BatchOut:
    # The objective's loss and metrics are means over the count it is given: times the count, they are sums.
    spec = plan.spec
    assert spec.objective is not None  # _run_batch calls this only for a spec with an objective
    count = _objective_items(plan, batch)
    key = torch.Generator(device=plan.device or "cpu").manual_seed(0)
    loss, aux = spec.objective(plan.forward, plan.params, batch, count.to(plan.device or "cpu"), key)
    n = count.to(torch.float64)
    # eval_metrics_per_batch (TRL's RewardTrainer): each metric is the mean over batches of the batch's value
    weight = torch.ones_like(n) if getattr(spec.objective, "eval_metrics_per_batch", False) else n
    sums = {
        name: torch.as_tensor(v).detach().double().reshape(()) * weight.to(v.device) for name, v in dict(aux).items()
    }
    per_batch: Any = weight.to(count.dtype) if weight is not n else None
    if aux_reduction_of(spec.objective, None) == MICRO_BATCH:  # KTO: its batch values, each left out where absent
        sums, per_batch = _batch_values(aux)
    tensors: dict[str, Any] = {}
    if plan.gather:
        predict = getattr(spec.objective, "predictions", None)
        if predict is not None:
            outputs, label_ids = predict(plan.forward, plan.params, batch)
        else:  # a generic objective: the model on the batch without its labels, scored against them (or its inputs)
            outputs = plan.forward(plan.params, {k: v for k, v in batch.items() if k != spec.label_key})
            label_ids = batch.get(spec.label_key, batch.get(spec.main_input_name))
        tensors["predictions"] = spec.predictions_of(outputs)
        if label_ids is not None:
            tensors["label_ids"] = label_ids
        if "inputs" in spec.include_for_metrics:
            tensors["inputs"] = batch[spec.main_input_name]
    samples = getattr(spec.objective, "count_samples", None)  # DPO: pairs, not its 2 rows per pair
    return _BatchOut(
        loss_sum=loss.detach().double() * n.to(loss.device),
        count=count,
        num_samples=int(samples(batch)) if samples is not None else _num_samples(batch),
        tensors=tensors,
        metric_sums=sums,
        metric_count=per_batch,
    )


def _metric_sums_and_count(out: _BatchOut) -> tuple[dict[str, Tensor] | None, Any]:
    return out.metric_sums, out.count if out.metric_count is None else out.metric_count


def _metric_means() -> Reducer:
    """Average each metric over items: step on ``({name: sum}, item_count)`` (or ``{name: count}``); each name has
    its own count."""
    one = mean_loss()
    merge_one = one.merge
    assert merge_one is not None  # mean_loss merges

    def step(acc: dict[str, Any], x: tuple[Mapping[str, Tensor], Any]) -> dict[str, Any]:
        sums, n = x
        count = (lambda k: n[k]) if isinstance(n, Mapping) else (lambda k: n)
        return {**acc, **{k: one.step(acc.get(k, one.init()), (v, count(k))) for k, v in sums.items()}}

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {k: merge_one(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}

    def complete(acc: dict[str, Any]) -> dict[str, float]:  # a metric no batch had a value of is left out (TRL's)
        return {k: one.complete(v) for k, v in acc.items() if int(v[1])}

    return Reducer(init=dict, step=step, complete=complete, merge=merge)


def _sample_losses(plan: _Plan, outputs: Any, labels: Tensor) -> Tensor:
    # Each sample's own token-mean loss (NaN for a sample without items), one loss call per row.
    logits = logits_of(outputs)
    losses = []
    for i in range(labels.shape[0]):
        row = labels[i : i + 1]
        n = _items(plan.count_items, row)
        value = plan.spec.loss(logits[i : i + 1], row, n).detach().float().reshape(())
        losses.append(torch.where(n > 0, value, torch.full_like(value, float("nan"))))
    return torch.stack(losses) if losses else logits.new_zeros(0)


def _preprocessing(preprocess: Callable[[Any, Any], Any]) -> Callable[[_BatchOut], _BatchOut]:
    def apply(out: _BatchOut) -> _BatchOut:
        t = out.tensors
        return attrs.evolve(out, tensors={**t, "predictions": preprocess(t["predictions"], t.get("label_ids"))})

    return apply


def _rows_and_mean(out: _BatchOut) -> tuple[Tensor, Tensor]:
    # HF's eval loss: each batch's mean loss weighted by its rows (``loss.repeat(batch_size)``, the last batch's
    # cut to its rows); a batch without items has no mean and no weight (HF drops its NaN, logging_nan_inf_filter).
    assert out.loss_sum is not None and out.count is not None  # labelled batches only
    has_items = out.count > 0
    rows = torch.where(has_items, out.num_samples, 0)
    mean = out.loss_sum / out.count.clamp(min=1).to(out.loss_sum.device)
    return torch.where(has_items.to(mean.device), mean * rows.to(mean.device), 0.0), rows


def eval_parts(
    gather: bool = True, eval_accumulation_steps: int | None = None, move: Callable[[Tensor], Tensor] | None = None
) -> dict[str, Reducer]:
    """Return the reducers an eval run folds its per-batch outputs with, by the name of their result.

    ``loss`` (HF's: the batches' mean losses weighted by their rows), ``token_loss`` (the mean over all items,
    tokens for a token task), ``labelled`` (batches with labels), ``samples``, ``batches``,
    ``metrics`` (an objective's metric means) and, with ``gather``, ``tensors`` (predictions,
    label_ids, inputs, losses, padded and concatenated on the host; moved there every
    ``eval_accumulation_steps`` batches, or once at the end, by ``move``, default to the CPU).
    Every part but ``tensors`` has a ``merge``: ranks merge those, and gather ``tensors`` in rank order.

    >>> sorted(eval_parts(gather=False))
    ['batches', 'labelled', 'loss', 'metrics', 'samples', 'token_loss']
    """
    labelled = filtering(lambda o: o.count is not None)
    parts: dict[str, Reducer] = {
        "loss": compose(labelled, mapping(_rows_and_mean))(mean_loss()),
        "token_loss": compose(labelled, mapping(lambda o: (o.loss_sum, o.count)))(mean_loss()),
        "labelled": labelled(counting()),
        "samples": mapping(lambda o: o.num_samples)(summing()),
        "batches": counting(),
        "metrics": compose(filtering(lambda o: o.metric_sums is not None), mapping(_metric_sums_and_count))(
            _metric_means()
        ),
    }
    if gather:
        parts["tensors"] = compose(mapping(lambda o: o.tensors), offloading(eval_accumulation_steps, move))(_joined())
    return parts


def _joined() -> Reducer:
    # Chunks from ``offloading`` are fresh host tensors: a single chunk is the result as is.
    def complete(acc: Any) -> Any:
        chunks = collecting().complete(acc)
        return (chunks[0] if len(chunks) == 1 else pad_concat(chunks)) if chunks else None

    return attrs.evolve(collecting(), complete=complete)


def resolve_forward(
    model_or_forward: Any, params: Any, buffers: Mapping[str, Tensor] | None = None
) -> tuple[Callable[..., Any], Mapping[str, Tensor]]:
    """Return the ``forward(params, inputs)`` function and the params to evaluate ``model_or_forward`` on.

    ``model_or_forward`` is an ``nn.Module`` (run through ``functional_call`` with ``buffers``,
    default its own buffers and any parameter not in ``params``) or a ``forward(params, inputs)``
    function, returned as it is. ``params`` is a dict of tensors, a ``TrainState`` (its params,
    and its buffers unless ``buffers`` is given), or ``None`` for the module's own parameters.

    >>> forward, params = resolve_forward(torch.nn.Linear(2, 1), None)
    >>> sorted(params), forward(params, {"input": torch.zeros(3, 2)}).shape[0]
    (['bias', 'weight'], 3)
    """
    if params is not None and hasattr(params, "params") and hasattr(params, "buffers"):  # a TrainState
        params, buffers = params.params, (params.buffers if buffers is None else buffers)
    if not isinstance(model_or_forward, nn.Module):
        if params is None:
            raise TypeError("evaluate with a forward function needs params (a dict of tensors or a TrainState)")
        if not callable(model_or_forward):
            raise TypeError(
                "evaluate needs an nn.Module or a forward(params, inputs) function, "
                f"got {type(model_or_forward).__name__}"
            )
        return model_or_forward, params
    model = model_or_forward
    if params is None:
        params = dict(model.named_parameters())
    if buffers is None:
        buffers = {**{k: p for k, p in model.named_parameters() if k not in params}, **dict(model.named_buffers())}
    return make_forward(model, buffers), params


def eval_fold(
    spec: EvalSpec,
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    gather: bool,
    buffers: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, Reducer], dict[str, Any]]:
    """Fold ``batches`` through the eval pipeline of ``spec``; return :func:`eval_parts` and their accumulators.

    The model runs in eval mode under ``torch.inference_mode()`` (see :func:`resolve_forward` for
    ``model_or_forward``, ``params`` and ``buffers``); ``gather`` collects the predictions.
    """
    forward, params = resolve_forward(model_or_forward, params, buffers)
    first = next(iter(params.values()), None)
    plan = _Plan(
        forward=forward,
        params=params,
        spec=spec,
        count_items=counter_for(spec.loss),
        device=first.device if isinstance(first, Tensor) else None,
        gather=gather,
    )
    steps = [mapping(lambda b: _run_batch(plan, b))]
    if gather and spec.preprocess_logits_for_metrics is not None:
        steps.append(mapping(_preprocessing(spec.preprocess_logits_for_metrics)))
    parts = eval_parts(gather, spec.eval_accumulation_steps, spec.move)
    reducer = compose(*steps)(combine(parts))
    mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    no_cache: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if isinstance(model_or_forward, nn.Module):
        mode = train_mode(model_or_forward, False)
        # no KV cache, as TRL's compute_loss: with one, packed rows would attend across their documents
        no_cache = cache_off(cache_configs(model_or_forward.modules()))
    with mode, no_cache, torch.inference_mode():
        return parts, unreduced(fold(reducer, batches))
