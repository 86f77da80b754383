"""Divergence: a run whose parameters turned inf or NaN, told apart from a step that was only skipped.

A float16 step whose gradients overflow reports an inf loss or grad norm, but loss scaling skips
its update, so the parameters stay finite: that is not divergence. A run has diverged when its
*parameters* are no longer finite. The check is cheap on the common path: the loss and grad norm a
step already reports are looked at first, and the parameters only when one of them is not finite
(or when the caller is about to write them, ``confirm=True``).

>>> import attrs, torch
>>> from trainfold.core.state import TrainState
>>> ok = TrainState(params={"w": torch.ones(2)}, buffers={}, opt_state=None)
>>> skipped = attrs.evolve(ok, metrics={**ok.metrics, "loss": torch.tensor(float("inf"))})
>>> diverged(ok), diverged(skipped)                      # a skipped float16 step keeps finite params
(False, False)
>>> broken = attrs.evolve(skipped, params={"w": torch.tensor([1.0, float("nan")])})
>>> diverged(broken), nonfinite_params(broken.params)
(True, ['w'])
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from trainfold.core.state import TrainState

__all__ = ["DIVERGED", "EXIT_DIVERGED", "diverged", "nonfinite_params", "divergence_message"]

DIVERGED = "diverged"  # the status of a run stopped because its parameters are no longer finite
EXIT_DIVERGED = 3  # the exit status of ``python -m trainfold train`` for such a run (a failure, not to be retried)


def nonfinite_params(params: Mapping[str, Tensor]) -> list[str]:
    """Return the names of the tensors in ``params`` that hold an inf or NaN (one reduction per tensor).

    >>> nonfinite_params({"a": torch.zeros(2), "b": torch.tensor([float("inf")])})
    ['b']
    """
    return [name for name, t in params.items() if t.is_floating_point() and not _finite(t.detach())]


def _finite(t: Tensor) -> bool:
    # Any inf/NaN element makes the float32 sum inf/NaN, so a finite sum settles it in one reduction (5x faster
    # than isfinite(t).all() on CPU); only a sum that overflows from finite values needs the exact check.
    # A DTensor shard's reductions are partial: reduced over every rank, so all ranks agree (trainfold.step.sharded).
    return math.isfinite(float(_whole(torch.sum(t, dtype=torch.float32)))) or bool(_whole(torch.isfinite(t).all()))


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _metrics_finite(state: TrainState) -> bool:
    return all(math.isfinite(float(state.metrics[k])) for k in ("loss", "grad_norm") if k in state.metrics)


def diverged(state: TrainState, *, confirm: bool = False) -> bool:
    """Say whether ``state``'s parameters are no longer finite.

    Without ``confirm`` the parameters are only read when the step's loss or grad norm is not
    finite (a parameter that overflows shows up in the next step's loss); with ``confirm`` (before a
    checkpoint is written, at the end of a run) they are always read.

    >>> from trainfold.core.state import TrainState
    >>> quiet = TrainState(params={"w": torch.tensor([float("nan")])}, buffers={}, opt_state=None)
    >>> diverged(quiet), diverged(quiet, confirm=True)     # finite metrics: the params are not read
    (False, True)
    """
    if not confirm and _metrics_finite(state):
        return False
    return bool(nonfinite_params(state.params))


def divergence_message(state: TrainState, last_checkpoint: object = None) -> str:
    """Return the warning for a run that diverged at ``state``'s step: where, which tensors, what is kept.

    >>> from trainfold.core.state import TrainState, scalar
    >>> s = TrainState(params={"w": torch.tensor([float("nan")])}, buffers={}, opt_state=None, step=scalar(7))
    >>> print(*divergence_message(s, "out/checkpoint-5").split("; "), sep="\\n")
    training diverged at step 7: parameters inf/NaN after the update (w)
    stopped without saving them
    the last finite checkpoint is out/checkpoint-5
    """
    names = nonfinite_params(state.params)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    kept = f"the last finite checkpoint is {last_checkpoint}"
    if not last_checkpoint:
        kept = "no checkpoint was saved in this run"
    return (
        f"training diverged at step {int(state.step)}: parameters inf/NaN after the update ({shown}); "
        f"stopped without saving them; {kept}"
    )
