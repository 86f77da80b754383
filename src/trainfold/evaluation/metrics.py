"""What an eval run returns: ``EvalPrediction``, ``PredictionOutput`` and the metrics dict (names, checks, speed).

>>> prefix_metrics({"loss": 0.5}, "test")
{'test_loss': 0.5}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch
from torch import Tensor

from trainfold.core.tree import map_tensors

__all__ = [
    "EvalPrediction",
    "PredictionOutput",
    "check_metrics",
    "eval_sets",
    "final_metrics",
    "prefix_metrics",
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


def to_numpy(tree: Any) -> Any:
    """Convert tensors (nested in tuples/lists/dicts/records) to numpy arrays; bfloat16 becomes float32.

    >>> to_numpy({"a": torch.tensor([1.5], dtype=torch.bfloat16)})["a"].dtype.name
    'float32'
    """
    return map_tensors(_array, tree)


def _array(t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16,) or t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        t = t.float()
    return t.numpy()


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
    token_loss: float | None = None,
) -> dict[str, Any]:
    """Return an eval run's metrics named ``{prefix}_*``: ``compute_metrics``' results, the loss, ``speed``, then
    ``objective_metrics`` (the means of an objective's metrics over the eval items: ``eval_rewards/chosen``...).

    ``gathered`` holds the run's ``predictions`` and ``label_ids`` (and optionally ``inputs`` and
    ``losses``); ``compute_metrics`` runs on them (as numpy arrays unless ``as_numpy=False``) only
    when both are there. ``loss`` is the eval loss, ``None`` when no batch had labels; ``token_loss`` (the
    mean over all items, tokens for a token task) follows it when given; ``speed``
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
    if token_loss is not None:
        if "token_loss" in metrics or f"{prefix}_token_loss" in metrics:
            raise ValueError(
                f"compute_metrics returned a 'token_loss' metric, which would hide {prefix}_token_loss; rename it"
            )
        metrics["token_loss"] = token_loss
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
