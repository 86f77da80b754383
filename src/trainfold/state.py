"""The training state: one immutable record that a checkpoint snapshots and a resume restores.

>>> import torch
>>> from trainfold.optim import sgd
>>> state = init_state(torch.nn.Linear(2, 1), sgd(0.1), seed=3)
>>> sorted(state.params), state.step.item(), state.seed.item()
(['bias', 'weight'], 0, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.tree import check_keys

__all__ = ["Cursor", "TrainState", "init_state", "scalar", "METRIC_KEYS"]

# What every step reports about itself; present from the first state so the record's
# structure never changes (a checkpoint loads into the template of a fresh state).
METRIC_KEYS = ("loss", "grad_norm", "learning_rate", "num_items")


def scalar(value: float | int, dtype: torch.dtype = torch.int64) -> Tensor:
    """Return a 0-d CPU tensor: the form counters take in a state record.

    >>> scalar(5).dtype, scalar(0.5, torch.float64).item()
    (torch.int64, 0.5)
    """
    return torch.tensor(value, dtype=dtype)


def initial_metrics() -> dict[str, Tensor]:
    """Return the metrics of a state before its first step (zeros; the learning rate in float64)."""
    return {k: scalar(0.0, torch.float64 if k == "learning_rate" else torch.float32) for k in METRIC_KEYS}


@attrs.frozen(eq=False)
class Cursor:
    """Where the data stream stands: the epoch, and optimizer steps consumed within it.

    >>> Cursor().as_tuple(), Cursor(epoch=scalar(1), position=scalar(4)).as_tuple()
    ((0, 0), (1, 4))
    """

    epoch: Tensor = attrs.field(factory=lambda: scalar(0))
    position: Tensor = attrs.field(factory=lambda: scalar(0))

    def as_tuple(self) -> tuple[int, int]:
        """Return ``(epoch, position)`` as Python ints.

        >>> Cursor(scalar(2), scalar(5)).as_tuple()
        (2, 5)
        """
        return int(self.epoch), int(self.position)


@attrs.frozen(eq=False)
class TrainState:
    """Everything that changes during training, and nothing that configures it.

    ``params`` are the trainable tensors; ``buffers`` the module buffers and frozen parameters.
    ``step`` counts optimizer updates done. ``metrics`` holds what the last step reports
    (``loss``, pre-clip ``grad_norm``, ``learning_rate``, ``num_items``) as 0-d tensors,
    ``loss_total`` the float64 sum of all finite step losses, so any logging window's mean is exact,
    and ``nonfinite_losses`` the count of steps whose loss was inf or NaN (left out of the sum, so
    one overflowing float16 step does not turn every later window's mean into inf).
    ``extras`` carries named records owned by higher layers (logging marks, best-model and
    early-stopping counters) so they survive a resume.

    >>> import torch
    >>> s = TrainState(params={"w": torch.zeros(2)}, buffers={}, opt_state=None)
    >>> s.step.item(), s.cursor.as_tuple(), sorted(s.metrics)
    (0, (0, 0), ['grad_norm', 'learning_rate', 'loss', 'num_items'])
    """

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    opt_state: Any
    step: Tensor = attrs.field(factory=lambda: scalar(0))
    seed: Tensor = attrs.field(factory=lambda: scalar(0))
    cursor: Cursor = attrs.field(factory=Cursor)
    metrics: dict[str, Tensor] = attrs.field(factory=lambda: initial_metrics())
    loss_total: Tensor = attrs.field(factory=lambda: scalar(0.0, torch.float64))
    nonfinite_losses: Tensor = attrs.field(factory=lambda: scalar(0))
    extras: dict[str, Any] = attrs.field(factory=dict)


def split_module(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Return ``(params, buffers)`` of ``model`` as detached copies.

    Trainable parameters go to ``params``; frozen parameters and buffers to ``buffers``. Tied
    parameters appear once, under their first name.

    >>> import torch
    >>> m = torch.nn.BatchNorm1d(2)
    >>> p, b = split_module(m)
    >>> sorted(p), sorted(b)
    (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
    """
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        (params if p.requires_grad else buffers)[name] = p.detach().clone()
    for name, b in model.named_buffers():
        buffers[name] = b.detach().clone()
    return params, buffers


def init_state(
    model: nn.Module,
    optimizer: Any,
    *,
    seed: int = 0,
    extras: Mapping[str, Any] | None = None,
    params: Mapping[str, Tensor] | None = None,
) -> TrainState:
    """Return the first state of a run: copies of the model's tensors and a fresh optimizer state.

    ``params`` starts from other trainable tensors than the model's own (e.g. an SFT result before
    DPO); they must have the model's parameter names. The model itself is never changed.

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> s = init_state(torch.nn.Linear(2, 1), sgd(0.1), seed=7, params={"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
    >>> s.params["weight"].tolist(), s.seed.item(), s.step.item()
    ([[1.0, 1.0]], 7, 0)
    """
    own, buffers = split_module(model)
    if params is not None:
        check_keys(params, own, "params", f"{type(model).__name__}'s trainable parameters")
        own = {k: v.detach().clone() for k, v in params.items()}
    params = own
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters: every parameter has "
            "requires_grad=False; unfreeze at least one parameter to train it"
        )
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=optimizer.init(params),
        seed=scalar(seed),
        extras=dict(extras or {}),
    )
