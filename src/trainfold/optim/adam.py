"""Adam, computed by torch's own kernels: ``adamw`` steps the params, ``scale_by_adam`` is its chain part.

Both call torch's functional Adam (``torch.optim.adam.adam``, what ``torch.optim.Adam`` and
``AdamW`` run), which picks the fused, foreach or single-tensor kernel as ``torch.optim.AdamW``
does (``fused=`` / ``foreach=`` as there). So ``adamw`` is bitwise ``torch.optim.AdamW`` with the
same arguments, ``fused`` and ``foreach`` included: there is one AdamW, torch's. (torch's kernels differ from
each other in the last bits on some CPUs, AVX-512 ones among them: the fused kernel is not bitwise the
single-tensor one.) The moments live in an :class:`AdamState`.

>>> import torch
>>> opt = adamw(0.1)
>>> p = {"w": torch.tensor([1.0])}
>>> new, s = opt.apply({"w": torch.tensor([5.0])}, opt.init(p), p)
>>> round(new["w"].item(), 4), s.count.item()
(0.9, 1)
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam

from trainfold.core.state import scalar
from trainfold.core.tree import Tree, check_keys
from trainfold.optim.masks import Mask, decay_mask_by_name
from trainfold.optim.schedules import Schedule, as_schedule
from trainfold.optim.transform import GradientTransformation, rate_value
from trainfold.optim.transforms import AddDecayedWeights

__all__ = ["AdamState", "AdamW", "ScaleByAdam", "adamw", "scale_by_adam"]


@attrs.frozen(eq=False)
class AdamState:
    """What :func:`scale_by_adam` and ``adamw`` carry between updates: the count and the two moments.

    >>> from trainfold.optim import adamw
    >>> opt = adamw(0.1)
    >>> p = {"w": torch.tensor([1.0])}
    >>> _, state = opt.apply({"w": torch.tensor([2.0])}, opt.init(p), p)
    >>> state.count.item(), round(state.mu["w"].item(), 4), round(state.nu["w"].item(), 4)
    (1, 0.2, 0.004)
    """

    count: Tensor
    mu: dict[str, Tensor]
    nu: dict[str, Tensor]


def _check_betas(b1: float, b2: float) -> None:
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")


def _zeros(params: Tree) -> AdamState:
    return AdamState(
        scalar(0),
        {k: torch.zeros_like(v) for k, v in params.items()},
        {k: torch.zeros_like(v) for k, v in params.items()},
    )


@attrs.frozen
class _Kernel:
    """torch's functional AdamW (decoupled decay) with its settings: betas, eps, which kernel, direction."""

    b1: float
    b2: float
    eps: float
    fused: bool | None = None
    foreach: bool | None = None
    maximize: bool = False

    def run(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        mu: Sequence[Tensor],
        nu: Sequence[Tensor],
        count: int,
        *,
        lr: float | Tensor,
        weight_decay: float,
    ) -> None:
        """Step the lists in place as update ``count + 1`` (torch picks its kernel as ``torch.optim.AdamW``)."""
        if not params:
            return
        differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in [*params, *grads, *mu, *nu])
        # torch differentiates its single-tensor kernel only
        fused, foreach = (None, False) if differentiable else (self.fused, self.foreach)
        if fused:  # torch's fused kernel assumes each grad has its param's strides (pytorch/pytorch#106951; on CPU
            # it reads a transposed or vmapped grad in the param's layout, silently): give it copies in that layout
            grads = [g if g.stride() == p.stride() else torch.empty_like(p).copy_(g) for g, p in zip(grads, params)]
        torch_adam(
            list(params),
            list(grads),
            list(mu),
            list(nu),
            [],
            _step_counts(params, count, on_device=bool(fused), differentiable=differentiable),
            foreach=foreach,
            fused=fused,
            differentiable=differentiable,
            has_complex=any(p.is_complex() for p in params),
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=self.b1,
            beta2=self.b2,
            lr=lr,
            weight_decay=weight_decay,
            eps=self.eps,
            maximize=self.maximize,
        )


def _step_counts(params: Sequence[Tensor], count: int, *, on_device: bool, differentiable: bool) -> list[Tensor]:
    """Return torch's per-param step tensors for update ``count + 1`` (torch increments them first).

    A fused optimizer keeps them on the params' device; the differentiable kernel computes the bias corrections
    from the step tensor, so float64 there, as the other kernels compute them in Python.
    """
    dtype = torch.float64 if differentiable else torch.float32
    return [torch.tensor(float(count), dtype=dtype, device=p.device if on_device else "cpu") for p in params]


@attrs.frozen(eq=False)
class AdamW(GradientTransformation):
    """``torch.optim.AdamW`` as a transformation (``adamw`` builds it); its state is an :class:`AdamState`.

    ``apply`` runs torch's kernel once per weight-decay group (as torch's decay / no-decay param
    groups); ``update`` is ``apply``'s new params minus the old.
    """

    schedule: Schedule
    kernel: _Kernel  # betas, eps, fused / foreach, maximize
    decay: AddDecayedWeights
    name = "adamw"

    def init(self, params: Tree) -> AdamState:
        return _zeros(params)

    def learning_rate(self, state: AdamState) -> float:
        return rate_value(self.schedule(int(state.count)))

    def update(self, grads: Tree, state: AdamState, params: Tree) -> tuple[Tree, AdamState]:
        new, new_state = self.apply(grads, state, params)
        return {k: new[k] - params[k] for k in params}, new_state

    def apply(self, grads: Tree, state: AdamState, params: Tree, *, donate: bool = False) -> tuple[Tree, AdamState]:
        check_keys(grads, params, "grads", "params")
        check_keys(state.mu, params, "Adam state", "params")
        fresh = (lambda t: t) if donate else (lambda t: t.clone())
        keys = list(params)
        p = {k: fresh(params[k]) for k in keys}
        mu = {k: fresh(state.mu[k]) for k in keys}
        nu = {k: fresh(state.nu[k]) for k in keys}
        count = int(state.count)
        on = set(self.decay.decayed(params)) if self.decay.weight_decay else set()
        for names, wd in (
            ([k for k in keys if k in on], self.decay.weight_decay),
            ([k for k in keys if k not in on], 0.0),
        ):
            self.kernel.run(
                [p[k] for k in names],
                [grads[k] for k in names],
                [mu[k] for k in names],
                [nu[k] for k in names],
                count,
                lr=self.schedule(count),
                weight_decay=wd,
            )
        return p, AdamState(state.count + 1, mu, nu)


def adamw(
    learning_rate: float | Schedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask | None = decay_mask_by_name,
    *,
    fused: bool | None = None,
    foreach: bool | None = None,
    maximize: bool = False,
    amsgrad: bool = False,
) -> AdamW:
    """AdamW as ``torch.optim.AdamW`` (its kernels): decoupled weight decay on the params ``mask`` marks True.

    Two defaults are HF ``TrainingArguments``', not ``torch.optim.AdamW``'s: ``weight_decay`` 0.0 (torch: 0.01)
    and ``mask`` :func:`decay_mask_by_name` (no decay for biases and norms; torch decays every param, as
    ``mask=None`` does). With the same arguments the results are torch's, bitwise.

    ``mask`` is a ``{name: bool}`` mapping, a function of the params returning one, or ``None``
    to decay every param. ``fused`` and ``foreach`` pick torch's kernel as in ``torch.optim.AdamW``
    (``None``: torch's default for the params' device); ``maximize`` ascends the objective, as there.
    ``amsgrad=True`` is refused by name: ``from_torch(torch.optim.AdamW, amsgrad=True, ...)`` runs it.

    >>> opt = adamw(0.1, fused=True)
    >>> p = {"w": torch.tensor([1.0])}
    >>> new, s = opt.apply({"w": torch.tensor([5.0])}, opt.init(p), p)
    >>> round(new["w"].item(), 4), s.count.item(), opt.name
    (0.9, 1, 'adamw')
    """
    _check_betas(b1, b2)
    if fused and foreach:
        raise ValueError("adamw takes fused=True or foreach=True, not both (as torch.optim.AdamW)")
    if amsgrad:
        raise ValueError(
            "adamw(amsgrad=True) is not supported (its state holds the two moments only); use "
            "trainfold.optim.from_torch(torch.optim.AdamW, lr=..., amsgrad=True, weight_decay=..., mask=...), which "
            "runs torch's AdamW with its state in the TrainState"
        )
    decay = AddDecayedWeights(float(weight_decay), mask)
    schedule = as_schedule(learning_rate)
    return AdamW(schedule, _Kernel(float(b1), float(b2), float(eps), fused, foreach, bool(maximize)), decay)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> ScaleByAdam:
    """Scale gradients to Adam's bias-corrected ``mu / (sqrt(nu) + eps)`` (torch's kernel, torch's denominator).

    >>> opt = scale_by_adam()
    >>> p = {"w": torch.tensor([1.0])}
    >>> u, s = opt.update({"w": torch.tensor([5.0])}, opt.init(p), p)
    >>> round(u["w"].item(), 4), s.count.item()
    (1.0, 1)
    >>> scale_by_adam(b1=1.0)
    Traceback (most recent call last):
    ...
    ValueError: b1 must be in [0, 1), got 1.0
    """
    _check_betas(b1, b2)
    return ScaleByAdam(float(b1), float(b2), float(eps))


@attrs.frozen
class ScaleByAdam(GradientTransformation):
    """See :func:`scale_by_adam`; its state is an :class:`AdamState`."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    name = "scale_by_adam"

    def init(self, params: Tree) -> AdamState:
        return _zeros(params)

    def update(self, grads: Tree, state: AdamState, params: Tree) -> tuple[Tree, AdamState]:
        check_keys(grads, params, "grads", "params")
        check_keys(state.mu, params, "Adam state", "params")
        keys = list(params)
        # torch's step at lr 1 from zero params is exactly minus the update
        out = [torch.zeros_like(grads[k]) for k in keys]
        mu, nu = [state.mu[k].clone() for k in keys], [state.nu[k].clone() for k in keys]
        _Kernel(self.b1, self.b2, self.eps).run(
            out, [grads[k] for k in keys], mu, nu, int(state.count), lr=1.0, weight_decay=0.0
        )
        return dict(zip(keys, torch._foreach_neg(out))), AdamState(
            state.count + 1, dict(zip(keys, mu)), dict(zip(keys, nu))
        )
