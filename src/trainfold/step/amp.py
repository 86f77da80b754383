"""Dynamic loss scaling for float16 training, as values: the scale lives in the state.

float16 gradients underflow to zero unless the loss is scaled up before the backward pass. This is
``torch.amp.GradScaler``'s algorithm, written as pure functions over a small record kept in
``state.extras[SCALER]`` (so a checkpoint carries it and a resume continues it bitwise):

* the step differentiates ``loss * scale`` and unscales the gradients (``scale``'s float32
  reciprocal, as torch does) after summing them over micro-batches and ranks;
* if any gradient is inf or NaN, the update is skipped: params and optimizer state stay as they
  were (the step counter still advances, the loss is still logged), and the scale is multiplied by
  ``backoff_factor``;
* after ``growth_interval`` finite steps in a row the scale is multiplied by ``growth_factor``.

The learning-rate schedule follows the optimizer's own update count, so a skipped step does not
advance it (HF's scheduler advances anyway and warns).

>>> import torch
>>> scaling = LossScaling(init_scale=8.0, growth_interval=2)
>>> s = initial_scaler(scaling)
>>> grads = [torch.tensor([16.0])]
>>> found = unscale_(grads, s)
>>> grads[0].item(), bool(found)
(2.0, False)
>>> s = updated(s, found, scaling); s = updated(s, found, scaling)
>>> s.scale.item(), updated(s, torch.ones(()), scaling).scale.item()
(16.0, 8.0)
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

__all__ = ["SCALER", "LossScaling", "ScalerState", "initial_scaler", "unscale_", "updated"]

SCALER = "grad_scaler"  # the key of the scaler record in state.extras


@attrs.frozen
class LossScaling:
    """The settings of dynamic loss scaling (``torch.amp.GradScaler``'s defaults)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __attrs_post_init__(self) -> None:
        if not (
            self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1 and self.growth_interval >= 1
        ):
            raise ValueError(
                f"invalid loss scaling {self}: needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                "and growth_interval >= 1"
            )


@attrs.frozen(eq=False)
class ScalerState:
    """The scale (float32) and the count of finite steps since it last changed (int32), both 0-d."""

    scale: Tensor
    growth_tracker: Tensor


def initial_scaler(scaling: LossScaling, device: torch.device | str = "cpu") -> ScalerState:
    """Return the scaler record a run starts with (put it in ``state.extras[SCALER]``)."""
    return ScalerState(
        torch.full((), scaling.init_scale, dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int32, device=device),
    )


def unscale_(grads: list[Tensor], scaler: ScalerState) -> Tensor:
    """Divide ``grads`` (fresh tensors the caller owns) by the scale in place; return 1.0 if any is not finite."""
    found_inf = torch.zeros((), dtype=torch.float32, device=scaler.scale.device)
    inv_scale = scaler.scale.double().reciprocal().float()
    by_device: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in by_device.items():
        flag = found_inf.to(device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv_scale.to(device))
        found_inf = torch.maximum(found_inf, flag.to(found_inf.device))
    return found_inf


def updated(scaler: ScalerState, found_inf: Tensor, scaling: LossScaling) -> ScalerState:
    """Return the scaler after a step that found (1.0) or did not find (0.0) non-finite gradients."""
    scale, tracker = scaler.scale.clone(), scaler.growth_tracker.clone()
    torch._amp_update_scale_(
        scale,
        tracker,
        found_inf.to(scale.device),
        scaling.growth_factor,
        scaling.backoff_factor,
        scaling.growth_interval,
    )
    return ScalerState(scale, tracker)
