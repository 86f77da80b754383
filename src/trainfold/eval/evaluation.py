"""Evaluation: a transduction of eval batches under ``torch.inference_mode()``.

``evaluate`` runs the forward pass on given parameters, maps each batch to its summed loss, item
count and (when metrics need them) its predictions, optionally reduced on the device by
``preprocess_logits_for_metrics``, and folds these with the reducers of ``trainfold.eval.reducers``.
The eval loss is the token-level mean, ``sum of losses / number of items``, so it does not
depend on the eval batch size or padding. Predictions come back in the order of ``batches``,
right-padded with -100 along dim 1, moved to the CPU every ``eval_accumulation_steps`` batches.

>>> import torch
>>> model = torch.nn.Embedding(5, 5)
>>> batches = [{"input": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}]
>>> with torch.no_grad():
...     _ = model.weight.zero_()
>>> forward = lambda params, inputs: torch.nn.functional.embedding(inputs["input"], params["weight"])
>>> m = evaluate(forward, dict(model.named_parameters()), batches, speed_metrics=False)
>>> round(m["eval_loss"], 4)  # ln 5
1.6094

When to evaluate (``eval_strategy`` and friends) is decided in ``trainfold.eval.schedule``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch
from torch import Tensor, nn

from trainfold.core.forward import make_forward, train_mode
from trainfold.core.losses import causal_lm, counter_for, logits_of
from trainfold.eval.reducers import (
    Reducer,
    collecting,
    combine,
    compose,
    counting,
    filtering,
    mapping,
    mean_loss,
    offloading,
    pad_concat,
    summing,
    transduce,
)

__all__ = [
    "EvalPrediction",
    "PredictionOutput",
    "check_metrics",
    "eval_sets",
    "evaluate",
    "final_metrics",
    "predict",
    "prefix_metrics",
    "resolve_forward",
    "throughput",
    "to_numpy",
]


@attrs.frozen(eq=False)
class EvalPrediction:
    """What ``compute_metrics`` receives, as in HF: iterates as ``(predictions, label_ids)``.

    ``inputs`` and ``losses`` follow in the iteration when present (HF's order).

    >>> preds, labels = EvalPrediction(np.array([1]), np.array([2]))
    >>> preds.tolist(), labels.tolist()
    ([1], [2])
    """

    predictions: Any
    label_ids: Any
    inputs: Any = None
    losses: Any = None

    def _items(self) -> tuple[Any, ...]:
        extra = tuple(x for x in (self.inputs, self.losses) if x is not None)
        return (self.predictions, self.label_ids, *extra)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items())

    def __getitem__(self, index: int) -> Any:
        return self._items()[index]

    def __len__(self) -> int:
        return len(self._items())


class PredictionOutput(NamedTuple):
    """What ``predict`` returns (HF's names): predictions and labels in dataset order, and metrics.

    A named tuple, so it unpacks as HF's does:

    >>> preds, labels, metrics = PredictionOutput(np.array([[1, 2]]), None, {"test_loss": 0.5})
    >>> preds.tolist(), labels, metrics
    ([[1, 2]], None, {'test_loss': 0.5})
    """

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


# Metrics -------------------------------------------------------------------------------------


def to_numpy(tree: Any) -> Any:
    """Convert tensors (nested in tuples/lists/dicts) to numpy arrays; bfloat16 becomes float32.

    >>> to_numpy({"a": torch.tensor([1.5], dtype=torch.bfloat16)})["a"].dtype.name
    'float32'
    """
    if isinstance(tree, Tensor):
        t = tree.detach().cpu()
        if t.dtype in (torch.bfloat16,) or t.dtype.itemsize == 1 and t.dtype.is_floating_point:
            t = t.float()
        return t.numpy()
    if isinstance(tree, Mapping):
        return {k: to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(to_numpy(v) for v in tree)
    return tree


def _as_scalar(value: Any) -> float | int | bool | None:
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, np.generic) and np.ndim(value) == 0:
        return value.item()
    if isinstance(value, (np.ndarray, Tensor)) and value.ndim == 0:
        return value.item()
    return None


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else repr(value)[:40]


def check_metrics(metrics: Any, source: str = "compute_metrics") -> dict[str, float | int | bool]:
    """Return ``metrics`` with every value a Python number, or say which values are not scalars.

    >>> check_metrics({"acc": np.float32(0.5), "n": torch.tensor(3)})
    {'acc': 0.5, 'n': 3}
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{source} must return a dict of metric name -> number, got {type(metrics).__name__}")
    out, bad = {}, {}
    for key, value in metrics.items():
        scalar = _as_scalar(value)
        if not isinstance(key, str) or scalar is None:
            bad[key] = _describe(value)
        else:
            out[key] = scalar
    if bad:
        raise ValueError(
            f"{source} returned values that are not scalars: {bad}; reduce each to one number "
            "(e.g. float(x.mean())), and give every metric a string name"
        )
    return out


def prefix_metrics(metrics: Mapping[str, Any], prefix: str = "eval") -> dict[str, Any]:
    """Prefix metric names with ``prefix + "_"`` unless they already start with it.

    >>> prefix_metrics({"accuracy": 1.0, "eval_f1": 0.5})
    {'eval_accuracy': 1.0, 'eval_f1': 0.5}
    """
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = key if not prefix or key.startswith(f"{prefix}_") else f"{prefix}_{key}"
        if name in out:
            raise ValueError(
                f"metrics {sorted(k for k in metrics if k in (name, name[len(prefix) + 1 :]))} both "
                f"become {name!r} after prefixing with {prefix!r}; rename one"
            )
        out[name] = value
    return out


def eval_sets(eval_dataset: Any, prefix: str = "eval") -> dict[str, Any]:
    """Return ``{metric prefix: dataset}``: one set under ``prefix``, a dict of sets under ``{prefix}_{name}``.

    As HF's ``Trainer.evaluate``: each set of a dict (a ``datasets.DatasetDict`` too) is evaluated
    on its own, its metrics named ``eval_{name}_loss``, ``eval_{name}_runtime``... ``None`` is no set.

    >>> sorted(eval_sets({"a": [1], "b": [2]}))
    ['eval_a', 'eval_b']
    >>> eval_sets([1, 2], prefix="test")
    {'test': [1, 2]}
    """
    if eval_dataset is None:
        return {}
    if not isinstance(eval_dataset, dict):
        return {prefix: eval_dataset}
    if not eval_dataset:
        raise ValueError("eval_dataset is an empty dict; give at least one named eval set, or eval_dataset=None")
    bad = [k for k in eval_dataset if not isinstance(k, str) or not k]
    if bad:
        raise TypeError(
            f"eval_dataset's names {bad!r} must be non-empty strings (they name the metrics eval_{{name}}_*)"
        )
    return {f"{prefix}_{name}": dataset for name, dataset in eval_dataset.items()}


def throughput(runtime: float, samples: int, batches: int) -> dict[str, float]:
    """Return the speed metrics of an eval run: ``runtime`` (seconds), ``samples_per_second``, ``steps_per_second``.

    A runtime below 1 ns counts as 1 ns, so the rates stay finite.

    >>> throughput(2.0, 10, 4)
    {'runtime': 2.0, 'samples_per_second': 5.0, 'steps_per_second': 2.0}
    """
    runtime = max(runtime, 1e-9)
    return {
        "runtime": round(runtime, 4),
        "samples_per_second": round(samples / runtime, 3),
        "steps_per_second": round(batches / runtime, 3),
    }


def final_metrics(
    gathered: Mapping[str, Any],
    loss: float | None,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None = None,
    *,
    prefix: str = "eval",
    as_numpy: bool = True,
    speed: Mapping[str, float] | None = None,
    objective_metrics: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Return an eval run's metrics named ``{prefix}_*``: ``compute_metrics``' results, the loss, ``speed``, then
    ``objective_metrics`` (the means of an objective's metrics over the eval items: ``eval_rewards/chosen``...).

    ``gathered`` holds the run's ``predictions`` and ``label_ids`` (and optionally ``inputs`` and
    ``losses``); ``compute_metrics`` runs on them (as numpy arrays unless ``as_numpy=False``) only
    when both are there. ``loss`` is the eval loss, ``None`` when no batch had labels; ``speed``
    (e.g. :func:`throughput`) is added as it is.

    >>> final_metrics({}, 0.5, speed={"runtime": 2.0})
    {'eval_loss': 0.5, 'eval_runtime': 2.0}
    >>> acc = lambda p: {"accuracy": float((p.predictions == p.label_ids).mean())}
    >>> gathered = {"predictions": torch.tensor([1, 2]), "label_ids": torch.tensor([1, 0])}
    >>> final_metrics(gathered, None, acc, prefix="test")
    {'test_accuracy': 0.5}
    """
    metrics: dict[str, Any] = {}
    predictions, label_ids = gathered.get("predictions"), gathered.get("label_ids")
    if compute_metrics is not None and predictions is not None and label_ids is not None:
        conv = to_numpy if as_numpy else (lambda x: x)
        pred = EvalPrediction(
            predictions=conv(predictions),
            label_ids=conv(label_ids),
            inputs=conv(gathered.get("inputs")),
            losses=conv(gathered.get("losses")),
        )
        metrics = check_metrics(compute_metrics(pred))
    if loss is not None:
        if "loss" in metrics or f"{prefix}_loss" in metrics:
            raise ValueError(f"compute_metrics returned a 'loss' metric, which would hide {prefix}_loss; rename it")
        metrics["loss"] = loss
    if speed is not None:
        metrics.update(speed)
    clash = sorted(set(objective_metrics or ()) & set(metrics))
    if clash:
        raise ValueError(
            f"the objective's metrics {clash} are also among {sorted(metrics)} (from compute_metrics, "
            "the loss or the speed metrics); rename one of them"
        )
    metrics.update(objective_metrics or {})
    return prefix_metrics(metrics, prefix)


# The eval pipeline ----------------------------------------------------------------------------


@attrs.frozen
class _Plan:
    forward: Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], Any]
    params: Mapping[str, Tensor]
    loss: Callable[..., Tensor]
    count_items: Callable[[Tensor], Tensor]
    label_key: str
    device: torch.device | None
    gather: bool
    include_inputs: bool
    include_losses: bool
    main_input_name: str
    predictions_of: Callable[[Any], Any]
    objective: Any = None  # set: it scores each batch (loss and metrics) instead of ``loss``


@attrs.frozen(eq=False)
class _BatchOut:
    loss_sum: Tensor | None
    count: Tensor | None
    num_samples: int
    tensors: dict[str, Any]
    metric_sums: dict[str, Tensor] | None = None  # an objective's metrics times the batch's item count


def _to_device(batch: Mapping[str, Any], device: torch.device | None) -> dict[str, Any]:
    if device is None:
        return dict(batch)
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}


def _num_samples(batch: Mapping[str, Any]) -> int:
    for v in batch.values():
        if isinstance(v, Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 0


def _run_batch(plan: _Plan, batch: Mapping[str, Any]) -> _BatchOut:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"eval batches must be dicts of tensors (with a {plan.label_key!r} key), got {type(batch).__name__}"
        )
    batch = _to_device(batch, plan.device)
    if plan.objective is not None:
        return _run_objective(plan, batch)
    labels = batch.get(plan.label_key)
    inputs = {k: v for k, v in batch.items() if k != plan.label_key}
    outputs = plan.forward(plan.params, inputs)
    loss_sum = count = None
    if labels is not None:
        count = torch.as_tensor(plan.count_items(labels)).reshape(()).to(torch.int64)
        # The loss divides its sum by the count it is given; multiply back for the exact sum
        # (also right for a loss that returns a plain mean).
        loss_sum = plan.loss(outputs, labels, count).detach().double() * count.to(torch.float64)
    tensors: dict[str, Any] = {}
    if plan.gather:
        tensors["predictions"] = plan.predictions_of(outputs)
        if labels is not None:
            tensors["label_ids"] = labels
        if plan.include_inputs:
            if plan.main_input_name not in inputs:
                raise KeyError(
                    f"include_for_metrics has 'inputs' but batches have no {plan.main_input_name!r} key "
                    f"(keys: {sorted(inputs)}); pass main_input_name="
                )
            tensors["inputs"] = inputs[plan.main_input_name]
        if plan.include_losses and labels is not None:
            tensors["losses"] = _sample_losses(plan, outputs, labels)
    return _BatchOut(loss_sum=loss_sum, count=count, num_samples=_num_samples(batch), tensors=tensors)


def _objective_items(
    objective: Any,
    batch: Mapping[str, Any],
    label_key: str = "labels",
    count_labels: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Count the items of an objective's batch as the step does: ``objective.count_items``, else its labels, else rows.

    >>> _objective_items(lambda *a: None, {"x": torch.zeros(3, 2)}).item()
    3
    """
    if hasattr(objective, "count_items"):
        n = objective.count_items(batch)
    elif label_key in batch and count_labels is not None:
        n = count_labels(batch[label_key])
    else:
        n = _num_samples(batch)
    return torch.as_tensor(n).reshape(()).to(torch.int64)


def _run_objective(plan: _Plan, batch: Mapping[str, Any]) -> _BatchOut:
    # The objective's loss and metrics are means over the count it is given: times the count, they are sums.
    count = _objective_items(plan.objective, batch, plan.label_key, plan.count_items)
    key = torch.Generator(device=plan.device or "cpu").manual_seed(0)
    loss, aux = plan.objective(plan.forward, plan.params, batch, count.to(plan.device or "cpu"), key)
    n = count.to(torch.float64)
    sums = {name: torch.as_tensor(v).detach().double().reshape(()) * n.to(v.device) for name, v in dict(aux).items()}
    tensors: dict[str, Any] = {}
    if plan.gather:
        predict = getattr(plan.objective, "predictions", None)
        if predict is not None:
            outputs, label_ids = predict(plan.forward, plan.params, batch)
        else:  # a generic objective: the model on the batch without its labels, scored against them (or its inputs)
            outputs = plan.forward(plan.params, {k: v for k, v in batch.items() if k != plan.label_key})
            label_ids = batch.get(plan.label_key, batch.get(plan.main_input_name))
        tensors["predictions"] = plan.predictions_of(outputs)
        if label_ids is not None:
            tensors["label_ids"] = label_ids
        if plan.include_inputs:
            tensors["inputs"] = batch[plan.main_input_name]
    samples = getattr(plan.objective, "count_samples", None)  # DPO: pairs, not its 2 rows per pair
    return _BatchOut(
        loss_sum=loss.detach().double() * n.to(loss.device),
        count=count,
        num_samples=int(samples(batch)) if samples is not None else _num_samples(batch),
        tensors=tensors,
        metric_sums=sums,
    )


def _metric_means() -> Reducer:
    """Average each metric over items: step on ``({name: sum}, item_count)``; each name has its own count."""
    one = mean_loss()

    def step(acc: dict[str, Any], x: tuple[Mapping[str, Tensor], Tensor]) -> dict[str, Any]:
        sums, n = x
        return {**acc, **{k: one.step(acc.get(k, one.init()), (v, n)) for k, v in sums.items()}}

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {k: one.merge(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}

    return Reducer(init=dict, step=step, complete=lambda acc: {k: one.complete(v) for k, v in acc.items()}, merge=merge)


def _sample_losses(plan: _Plan, outputs: Any, labels: Tensor) -> Tensor:
    # Each sample's own token-mean loss (NaN for a sample without items), one loss call per row.
    logits = logits_of(outputs)
    losses = []
    for i in range(labels.shape[0]):
        row = labels[i : i + 1]
        n = torch.as_tensor(plan.count_items(row)).reshape(()).to(torch.int64)
        value = plan.loss(logits[i : i + 1], row, n).detach().float().reshape(())
        losses.append(torch.where(n > 0, value, torch.full_like(value, float("nan"))))
    return torch.stack(losses) if losses else logits.new_zeros(0)


def _preprocessing(preprocess: Callable[[Any, Any], Any]) -> Callable[[_BatchOut], _BatchOut]:
    def apply(out: _BatchOut) -> _BatchOut:
        t = out.tensors
        return attrs.evolve(out, tensors={**t, "predictions": preprocess(t["predictions"], t.get("label_ids"))})

    return apply


def _eval_reducer(
    gather: bool = True, eval_accumulation_steps: int | None = None, move: Callable[[Tensor], Tensor] | None = None
) -> Reducer:
    """Return the reducer ``evaluate`` folds per-batch outputs with.

    Its result is a dict: ``loss`` (token-level mean), ``labelled`` (batches with labels),
    ``samples``, ``batches`` and, with ``gather``, ``tensors`` (predictions, label_ids, inputs,
    padded and concatenated on the host; moved there every ``eval_accumulation_steps`` batches,
    or once at the end). ``move`` moves one tensor to the host (default: to the CPU).
    """
    parts: dict[str, Reducer] = {
        "loss": compose(filtering(lambda o: o.count is not None), mapping(lambda o: (o.loss_sum, o.count)))(
            mean_loss()
        ),
        "labelled": filtering(lambda o: o.count is not None)(counting()),
        "samples": mapping(lambda o: o.num_samples)(summing()),
        "batches": counting(),
        "metrics": compose(filtering(lambda o: o.metric_sums is not None), mapping(lambda o: (o.metric_sums, o.count)))(
            _metric_means()
        ),
    }
    if gather:
        parts["tensors"] = compose(mapping(lambda o: o.tensors), offloading(eval_accumulation_steps, move))(_joined())
    return combine(parts)


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
        return _check_forward(model_or_forward), params
    model = model_or_forward
    if params is None:
        params = dict(model.named_parameters())
    if buffers is None:
        buffers = {**{k: p for k, p in model.named_parameters() if k not in params}, **dict(model.named_buffers())}
    return make_forward(model, buffers), params


def _check_forward(forward: Any) -> Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], Any]:
    if not callable(forward):
        raise TypeError(
            f"evaluate needs an nn.Module or a forward(params, inputs) function, got {type(forward).__name__}"
        )
    return forward


def _validate(
    eval_accumulation_steps: Any,
    prediction_loss_only: bool,
    compute_metrics: Any,
    preprocess: Any,
    include_for_metrics: Iterable[str],
    objective: Any = None,
) -> list[str]:
    errors = []
    if objective is not None and not callable(objective):
        errors.append(
            f"objective must be a function objective(forward, params, batch, num_items, key) -> (loss, "
            f"metrics), got {type(objective).__name__}"
        )
    if objective is not None and "loss" in include_for_metrics:
        errors.append(
            "include_for_metrics=['loss'] scores each sample with the loss, but an objective scores whole "
            "batches; drop 'loss', or compute per-sample values in compute_metrics"
        )
    if eval_accumulation_steps is not None and (
        not isinstance(eval_accumulation_steps, int) or eval_accumulation_steps < 1
    ):
        errors.append(f"eval_accumulation_steps must be a positive int or None, got {eval_accumulation_steps!r}")
    if prediction_loss_only and compute_metrics is not None:
        errors.append(
            "prediction_loss_only=True gathers no predictions, so compute_metrics would never run; drop one of them"
        )
    for name, f in (("compute_metrics", compute_metrics), ("preprocess_logits_for_metrics", preprocess)):
        if f is not None and not callable(f):
            errors.append(f"{name} must be a function, got {type(f).__name__}")
    unknown = sorted(set(include_for_metrics) - {"inputs", "loss"})
    if unknown:
        errors.append(f"include_for_metrics takes 'inputs' and 'loss', got {unknown}")
    return errors


def _run(
    model_or_forward: Any,
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    loss: Callable[..., Tensor],
    gather: bool,
    preprocess: Any,
    eval_accumulation_steps: int | None,
    include: tuple[str, ...],
    label_key: str,
    main_input_name: str,
    buffers: Any,
    predictions_of: Callable[[Any], Any],
    move: Callable[[Tensor], Tensor] | None,
    objective: Any = None,
) -> dict[str, Any]:
    forward, params = resolve_forward(model_or_forward, params, buffers)
    first = next(iter(params.values()), None)
    plan = _Plan(
        forward=forward,
        params=params,
        loss=loss,
        count_items=counter_for(loss),
        label_key=label_key,
        device=first.device if isinstance(first, Tensor) else None,
        gather=gather,
        include_inputs="inputs" in include,
        include_losses="loss" in include,
        main_input_name=main_input_name,
        predictions_of=predictions_of,
        objective=objective,
    )
    steps = [mapping(lambda b: _run_batch(plan, b))]
    if gather and preprocess is not None:
        steps.append(mapping(_preprocessing(preprocess)))
    mode = train_mode(model_or_forward, False) if isinstance(model_or_forward, nn.Module) else contextlib.nullcontext()
    with mode, torch.inference_mode():
        return transduce(compose(*steps), _eval_reducer(gather, eval_accumulation_steps, move), batches)


def evaluate(
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    loss: Callable[..., Tensor] = causal_lm,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    eval_accumulation_steps: int | None = None,
    prediction_loss_only: bool = False,
    metric_key_prefix: str = "eval",
    include_for_metrics: Iterable[str] = (),
    label_key: str = "labels",
    main_input_name: str = "input_ids",
    buffers: Mapping[str, Tensor] | None = None,
    predictions_of: Callable[[Any], Any] = logits_of,
    as_numpy: bool = True,
    speed_metrics: bool = True,
    move: Callable[[Tensor], Tensor] | None = None,
    objective: Callable[..., Any] | None = None,
) -> dict[str, float]:
    """Evaluate ``params`` on ``batches`` and return metrics named ``{metric_key_prefix}_*``.

    ``model_or_forward`` is an ``nn.Module`` (run in eval mode through ``functional_call``; its
    buffers are used unless ``buffers`` is given) or a ``forward(params, inputs)`` function.
    ``params`` is a dict of tensors, a ``TrainState`` (its params and buffers), or ``None`` for
    the module's own. Each batch is a dict of tensors; ``labels`` (``label_key``) are taken out
    before the forward pass and scored with ``loss``. Only when ``compute_metrics`` is given are
    predictions gathered: ``predictions_of(outputs)`` (the logits), reduced per batch on the
    device by ``preprocess_logits_for_metrics(logits, labels)``, padded with -100 and moved to
    the CPU every ``eval_accumulation_steps`` batches (or once at the end). ``compute_metrics``
    gets an ``EvalPrediction`` of numpy arrays (torch tensors with ``as_numpy=False``) and must
    return a dict of scalars; ``include_for_metrics`` may add ``"inputs"`` (the batches'
    ``main_input_name``) and ``"loss"`` (each sample's own token-mean loss, not HF's batch mean
    repeated). Adds ``_runtime``, ``_samples_per_second`` and
    ``_steps_per_second`` unless ``speed_metrics=False``. A NaN or infinite loss in any batch
    shows in the eval loss (HF drops non-finite batch losses silently).

    ``objective`` (the one the run trains with, e.g. ``dpo_objective``) scores each batch instead
    of ``loss``: it is called as in the step, ``objective(forward, params, batch, n, key)`` with
    ``n`` the batch's own item count (``objective.count_items``, else its labels, else its rows),
    and returns ``(loss, metrics)`` as means over those items. ``eval_loss`` and each metric
    (``eval_rewards/chosen``...) are then exact means over all eval items: sums of ``value × n``
    over the batches divided by the summed ``n``, reduced like the loss (so for equal-sized
    batches they equal TRL's mean of batch means). With ``compute_metrics`` the predictions come
    from ``objective.predictions(forward, params, batch) -> (outputs, label_ids)`` (DPO: the
    policy's logits on the batch's chosen then rejected rows, and their ``input_ids``, as TRL's
    ``prediction_step``); an objective without it is scored as the model run on the batch
    without its labels, with ``label_ids`` the labels, else the ``main_input_name`` input.

    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> rows = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    >>> one = evaluate(model, None, [{"input_ids": rows, "labels": rows}], speed_metrics=False,
    ...                compute_metrics=lambda p: {"rows": p.predictions.shape[0]})
    >>> sorted(one), one["eval_rows"]
    (['eval_loss', 'eval_rows'], 2)
    >>> two = evaluate(model, None, [{"input_ids": r[None], "labels": r[None]} for r in rows], speed_metrics=False)
    >>> round(one["eval_loss"], 5) == round(two["eval_loss"], 5)  # the token mean: batch size does not matter
    True
    """
    _, metrics = _evaluated(
        model_or_forward,
        params,
        batches,
        gather=compute_metrics is not None,
        prediction_loss_only=prediction_loss_only,
        compute_metrics=compute_metrics,
        preprocess=preprocess_logits_for_metrics,
        include_for_metrics=include_for_metrics,
        eval_accumulation_steps=eval_accumulation_steps,
        prefix=metric_key_prefix,
        as_numpy=as_numpy,
        speed_metrics=speed_metrics,
        loss=loss,
        label_key=label_key,
        main_input_name=main_input_name,
        buffers=buffers,
        predictions_of=predictions_of,
        move=move,
        objective=objective,
    )
    return metrics


def _evaluated(
    model_or_forward: Any,
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    gather: bool,
    prediction_loss_only: bool,
    compute_metrics: Any,
    preprocess: Any,
    include_for_metrics: Iterable[str],
    eval_accumulation_steps: int | None,
    prefix: str,
    as_numpy: bool,
    speed_metrics: bool,
    **run: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    # What evaluate and predict share: check the settings, run the pipeline, time it, make the metrics.
    include = tuple(include_for_metrics)
    errors = _validate(
        eval_accumulation_steps, prediction_loss_only, compute_metrics, preprocess, include, run.get("objective")
    )
    if errors:
        raise ValueError("; ".join(errors))
    start = time.perf_counter()
    out = _run(
        model_or_forward,
        params,
        batches,
        gather=gather,
        preprocess=preprocess,
        eval_accumulation_steps=eval_accumulation_steps,
        include=include,
        **run,
    )
    speed = throughput(time.perf_counter() - start, out["samples"], out["batches"]) if speed_metrics else None
    loss = out["loss"] if out["labelled"] else None
    metrics = final_metrics(
        out.get("tensors") or {},
        loss,
        compute_metrics,
        prefix=prefix,
        as_numpy=as_numpy,
        speed=speed,
        objective_metrics=out["metrics"],
    )
    return out, metrics


def predict(
    model_or_forward: nn.Module | Callable[..., Any],
    params: Any,
    batches: Iterable[Mapping[str, Any]],
    *,
    loss: Callable[..., Tensor] = causal_lm,
    compute_metrics: Callable[[EvalPrediction], Mapping[str, Any]] | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    eval_accumulation_steps: int | None = None,
    metric_key_prefix: str = "test",
    include_for_metrics: Iterable[str] = (),
    label_key: str = "labels",
    main_input_name: str = "input_ids",
    buffers: Mapping[str, Tensor] | None = None,
    predictions_of: Callable[[Any], Any] = logits_of,
    as_numpy: bool = True,
    speed_metrics: bool = True,
    move: Callable[[Tensor], Tensor] | None = None,
    objective: Callable[..., Any] | None = None,
) -> PredictionOutput:
    """Return predictions and labels for ``batches`` in their order, and the metrics ``evaluate`` gives.

    Predictions are ``predictions_of(outputs)`` after ``preprocess_logits_for_metrics``, padded
    with -100 along dim 1; ``label_ids`` is ``None`` when batches have no labels. Metric names
    are prefixed with ``test`` by default, as in HF.

    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> batches = [{"input_ids": torch.tensor([[1, 2, 3, 4]]), "labels": torch.tensor([[1, 2, 3, 4]])},
    ...            {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, 6, 7]])}]
    >>> out = predict(model, None, batches, speed_metrics=False)
    >>> list(out.predictions.shape), out.label_ids.tolist(), sorted(out.metrics)
    ([2, 4, 16], [[1, 2, 3, 4], [5, 6, 7, -100]], ['test_loss'])
    """
    out, metrics = _evaluated(
        model_or_forward,
        params,
        batches,
        gather=True,
        prediction_loss_only=False,
        compute_metrics=compute_metrics,
        preprocess=preprocess_logits_for_metrics,
        include_for_metrics=include_for_metrics,
        eval_accumulation_steps=eval_accumulation_steps,
        prefix=metric_key_prefix,
        as_numpy=as_numpy,
        speed_metrics=speed_metrics,
        loss=loss,
        label_key=label_key,
        main_input_name=main_input_name,
        buffers=buffers,
        predictions_of=predictions_of,
        move=move,
        objective=objective,
    )
    tensors = out.get("tensors") or {}
    conv = to_numpy if as_numpy else (lambda x: x)
    return PredictionOutput(conv(tensors.get("predictions")), conv(tensors.get("label_ids")), metrics)
