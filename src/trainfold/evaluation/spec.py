"""The evaluation spec: one record of how an eval run scores, gathers and names what it sees.

>>> spec = EvalSpec(metric_key_prefix="test", include_for_metrics=["inputs"])
>>> spec.metric_key_prefix, spec.include_for_metrics, spec.gathers
('test', ('inputs',), False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
from torch import Tensor

from trainfold.core.losses import causal_lm, logits_of

__all__ = ["EvalSpec", "spec_errors"]


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class EvalSpec:
    """How to evaluate: what ``evaluate``, ``predict`` and their sharded forms take besides the model and data.

    ``loss(outputs, labels, num_items)`` scores each batch's ``label_key`` labels (taken out of the
    batch before the forward pass); the eval loss is HF ``Trainer.evaluate``'s, each batch's mean loss
    weighted by its rows, and ``{prefix}_token_loss`` the mean over all items, sum of losses over the
    summed item counts (``loss.count_items``, else the labels that are not -100). Predictions are
    gathered only when ``compute_metrics`` is given (``predict`` always gathers): ``predictions_of(outputs)``
    (the logits), reduced per batch on the device by ``preprocess_logits_for_metrics(logits, labels)``,
    padded with -100 along dim 1 and moved to the host with ``move`` (default: to the CPU) every
    ``eval_accumulation_steps`` batches, or once at the end. ``compute_metrics`` gets an
    ``EvalPrediction`` of numpy arrays (torch tensors with ``as_numpy=False``) and returns a dict of
    scalars; ``include_for_metrics`` may add ``"inputs"`` (the batches' ``main_input_name``) and
    ``"loss"`` (each sample's own token-mean loss, not HF's batch mean repeated).
    ``prediction_loss_only=True`` gathers nothing. Metrics are named ``{metric_key_prefix}_*``, with
    ``_runtime``, ``_samples_per_second`` and ``_steps_per_second`` unless ``speed_metrics=False``.

    ``objective`` (the one the run trains with, e.g. ``dpo_objective``) scores each batch instead
    of ``loss``: ``objective(forward, params, batch, n, key) -> (loss, metrics)``, means over the
    batch's ``n`` items (``objective.count_items``, else its labels, else its rows); ``eval_loss`` is its
    batch means weighted by rows (``objective.count_samples``, else dim 0), as HF's, and each metric is an exact
    mean over all items. With ``compute_metrics`` its predictions come from
    ``objective.predictions(forward, params, batch) -> (outputs, label_ids)``, else from the model
    on the batch without its labels, with ``label_ids`` the labels, else the ``main_input_name`` input.

    Every bad setting is reported at once:

    >>> try:
    ...     EvalSpec(eval_accumulation_steps=0, include_for_metrics=["logits"])
    ... except ValueError as e:
    ...     print(*str(e).split("; "), sep="\\n")
    eval_accumulation_steps must be a positive int or None, got 0
    include_for_metrics takes 'inputs' and 'loss', got ['logits']
    """

    loss: Callable[..., Tensor] = causal_lm
    compute_metrics: Callable[[Any], Mapping[str, Any]] | None = None
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None
    eval_accumulation_steps: int | None = None
    prediction_loss_only: bool = False
    metric_key_prefix: str = "eval"
    include_for_metrics: tuple[str, ...] = attrs.field(default=(), converter=_names)
    label_key: str = "labels"
    main_input_name: str = "input_ids"
    predictions_of: Callable[[Any], Any] = logits_of
    as_numpy: bool = True
    speed_metrics: bool = True
    move: Callable[[Tensor], Tensor] | None = None
    objective: Callable[..., Any] | None = None

    def __attrs_post_init__(self) -> None:
        errors = spec_errors(self)
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def gathers(self) -> bool:
        """Whether ``evaluate`` gathers predictions: only for ``compute_metrics``."""
        return self.compute_metrics is not None

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> EvalSpec:
        """Return the spec of the fields named in ``settings`` (other keys, e.g. a function's ``locals()``, are left).

        >>> EvalSpec.of({"label_key": "y", "model": None}).label_key
        'y'
        """
        return cls(**{f.name: settings[f.name] for f in attrs.fields(cls) if f.name in settings})


def spec_errors(spec: EvalSpec) -> list[str]:
    """Return what is wrong with ``spec``'s settings, one message each (empty when nothing is).

    >>> spec_errors(EvalSpec())
    []
    """
    errors = []
    objective, every, include = spec.objective, spec.eval_accumulation_steps, spec.include_for_metrics
    if objective is not None and not callable(objective):
        errors.append(
            f"objective must be a function objective(forward, params, batch, num_items, key) -> (loss, "
            f"metrics), got {type(objective).__name__}"
        )
    if objective is not None and "loss" in include:
        errors.append(
            "include_for_metrics=['loss'] scores each sample with the loss, but an objective scores whole "
            "batches; drop 'loss', or compute per-sample values in compute_metrics"
        )
    if every is not None and (not isinstance(every, int) or every < 1):
        errors.append(f"eval_accumulation_steps must be a positive int or None, got {every!r}")
    if spec.prediction_loss_only and spec.compute_metrics is not None:
        errors.append(
            "prediction_loss_only=True gathers no predictions, so compute_metrics would never run; drop one of them"
        )
    for name in ("compute_metrics", "preprocess_logits_for_metrics"):
        f = getattr(spec, name)
        if f is not None and not callable(f):
            errors.append(f"{name} must be a function, got {type(f).__name__}")
    unknown = sorted(set(include) - {"inputs", "loss"})
    if unknown:
        errors.append(f"include_for_metrics takes 'inputs' and 'loss', got {unknown}")
    return errors
