"""The model's own loss as an objective: what ``transformers.Trainer`` trains with when no ``compute_loss_func``
is given, for a model whose task trainfold has no loss for (a module that computes its loss from the labels it is
given, as transformers' own test models and many research models do).

Each micro-batch reaches the forward whole, labels included, and the step trains with ``outputs["loss"]`` (a
tuple's first element), normalised as the Trainer normalises it:

- a model whose ``forward`` takes ``**kwargs`` (or says ``accepts_loss_kwargs``) is given ``num_items_in_batch``,
  the step's labelled items (labels other than -100), and its loss is taken as it returns it;
- any other model's loss is its micro-batch's mean, and the step's loss is the mean over its micro-batches (the
  Trainer's division by the accumulation steps).

Evaluation weighs each batch's loss by its rows, as the Trainer's ``eval_loss``; its predictions are the outputs
but the loss (one tensor: itself; several: their tuple), from the same forward.

>>> import torch
>>> class Regression(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a = torch.nn.Parameter(torch.tensor(2.0))
...     def forward(self, x, labels=None):
...         y = self.a * x
...         return y if labels is None else (torch.nn.functional.mse_loss(y, labels), y)
>>> objective = model_loss(Regression())
>>> forward = lambda params, inputs: torch.func.functional_call(Regression(), params, (), inputs)
>>> loss, _ = objective(forward, {"a": torch.tensor(1.0)}, {"x": torch.ones(2), "labels": torch.zeros(2)},
...                     torch.tensor(2), None)
>>> loss.item(), objective.count_items({"x": torch.ones(2)}).item()        # a mean of 1, over 2 micro-batches
(0.5, 1)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from trainfold.core.losses import IGNORE_INDEX

__all__ = ["model_loss", "accepts_loss_kwargs"]


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Say whether ``model``'s loss takes ``num_items_in_batch`` (as ``transformers.Trainer`` decides it).

    >>> accepts_loss_kwargs(torch.nn.Linear(2, 1))
    False
    """
    said = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(said, bool):
        return said
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _loss_of(outputs: Any, model: nn.Module) -> Tensor:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
    if isinstance(outputs, (tuple, list)) and outputs:
        loss = outputs[0]
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        what = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise ValueError(
            f"{type(model).__name__} returned no loss (its outputs: {what}); trainfold trains a model whose task it "
            "does not know with the loss the model returns for the labels, as transformers.Trainer does: return "
            "the loss as a 0-d tensor (outputs['loss'], or a tuple's first element) when labels are given, or pass "
            "compute_loss_func=loss(outputs, labels, num_items_in_batch)"
        )
    return loss


def _rows(batch: Mapping[str, Any]) -> int:
    return next((v.shape[0] for v in batch.values() if isinstance(v, Tensor) and v.dim() > 0), 1)


def _without_loss(outputs: Any) -> Any:
    """The outputs but the loss, as the Trainer's predictions: one tensor as itself, several as a tuple (under
    ``"logits"``, where ``losses.logits_of`` finds the predictions)."""
    if isinstance(outputs, Mapping):
        rest = [v for k, v in outputs.items() if k != "loss"]
    elif isinstance(outputs, (tuple, list)):
        rest = list(outputs[1:])
    else:
        return outputs
    return rest[0] if len(rest) == 1 else {"logits": tuple(rest)}


def model_loss(model: nn.Module, *, label_key: str = "labels", evaluation: bool = False) -> Any:
    """Return the objective training ``model`` with its own loss (see the module); ``evaluation``: the one scoring
    it (each batch weighed by its rows), which the training one also carries as ``for_evaluation``."""
    scaled = accepts_loss_kwargs(model) and not evaluation  # the Trainer passes it in training only
    last: list[Any] = []  # the outputs of the batch just scored, for its predictions (one forward per batch)

    def count_items(micro: Mapping[str, Any]) -> Tensor:
        if evaluation:
            return torch.tensor(_rows(micro))
        if scaled and label_key in micro:
            return (micro[label_key] != IGNORE_INDEX).sum()
        return torch.tensor(1)  # a micro-batch: the loss is its mean

    def objective(forward: Any, params: Any, micro: Mapping[str, Any], num_items: Tensor, key: Any) -> Any:
        kwargs = {"num_items_in_batch": num_items} if scaled and label_key in micro else {}
        outputs = forward(params, {**micro, **kwargs})
        if evaluation:
            last[:] = [micro, outputs]
        loss = _loss_of(outputs, model)
        return (loss if kwargs or evaluation else loss / num_items), {}

    def predictions(forward: Any, params: Any, batch: Mapping[str, Any]) -> tuple[Any, Any]:
        outputs = last[1] if last and last[0] is batch else forward(params, dict(batch))
        last.clear()
        return _without_loss(outputs), batch.get(label_key)

    objective.count_items = count_items  # type: ignore[attr-defined]
    objective.model_loss = True  # type: ignore[attr-defined]
    if evaluation:
        objective.predictions = predictions  # type: ignore[attr-defined]
    else:
        objective.for_evaluation = model_loss(model, label_key=label_key, evaluation=True)  # type: ignore[attr-defined]
    return objective
