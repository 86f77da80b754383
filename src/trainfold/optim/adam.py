"""``scale_by_adam``: Adam's moments and bias corrections, with torch's fused and foreach steps.

Followed by ``add_decayed_weights`` and ``scale_by_learning_rate`` (as in ``adamw``) the three fold
into one step on the params: torch's fused AdamW kernel (bitwise ``AdamW(fused=True)``) or its
``_foreach`` ops (bitwise ``AdamW(foreach=True)``). ``adamw_update`` is the same step written with
element-wise ops only, which traces under ``torch.compile`` and works on stacked ensemble tensors.

>>> import torch
>>> from trainfold.optim import adamw
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

from trainfold.core.state import scalar
from trainfold.core.tree import Tree, check_keys
from trainfold.optim.transform import GradientTransformation, StepRule

__all__ = ["AdamState", "ElementwiseAdam", "ScaleByAdam", "adamw_update", "scale_by_adam"]

IMPLEMENTATIONS = ("fused", "foreach")


@attrs.frozen(eq=False)
class AdamState:
    """What :func:`scale_by_adam` (and so ``adamw``) carries between updates: the count and the two moments.

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


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, implementation: str = "fused") -> ScaleByAdam:
    """Scale gradients to Adam's bias-corrected ``mu / (sqrt(nu) + eps)`` (torch's form of the denominator).

    ``implementation`` picks the step once the learning rate folds in: ``"fused"`` (torch's fused
    kernel, on CPU and CUDA float params; elsewhere ``"foreach"``) or ``"foreach"``.

    >>> scale_by_adam(b1=1.0)
    Traceback (most recent call last):
    ...
    ValueError: b1 must be in [0, 1), got 1.0
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be 'fused' or 'foreach', got {implementation!r}")
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    return ScaleByAdam(float(b1), float(b2), float(eps), implementation)


@attrs.frozen
class ScaleByAdam(GradientTransformation):
    """See :func:`scale_by_adam`; its state is an :class:`AdamState`."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    implementation: str = "fused"
    name = "scale_by_adam"

    def init(self, params: Tree) -> AdamState:
        zeros = lambda: {k: torch.zeros_like(v) for k, v in params.items()}
        return AdamState(scalar(0), zeros(), zeros())

    def counter(self, state: AdamState) -> Tensor:
        return state.count

    def _moments(self, grads: Tree, state: AdamState, keys: list[str], in_place: bool) -> tuple[list, list, list]:
        """Return the new moments of ``keys`` and the denominators ``sqrt(nu) / sqrt(bc2) + eps``."""
        g = [grads[k] for k in keys]
        mu, nu = [state.mu[k] for k in keys], [state.nu[k] for k in keys]
        if in_place:  # the same kernels, written into the state's own tensors
            torch._foreach_lerp_(mu, g, 1.0 - self.b1)
            torch._foreach_mul_(nu, self.b2)
        else:
            mu = list(torch._foreach_lerp(mu, g, 1.0 - self.b1))  # list(): the stubs say tuple, torch gives a list
            nu = list(torch._foreach_mul(nu, self.b2))
        torch._foreach_addcmul_(nu, g, g, 1.0 - self.b2)
        denom, correction = list(torch._foreach_sqrt(nu)), (1.0 - self.b2 ** (int(state.count) + 1)) ** 0.5
        if in_place:
            torch._foreach_div_(denom, correction)
        else:  # sqrt's backward needs its output: a differentiable update must not overwrite it
            denom = list(torch._foreach_div(denom, correction))
        torch._foreach_add_(denom, self.eps)
        return mu, nu, denom

    def update_at(
        self,
        grads: Tree,
        state: AdamState,
        params: Tree,
        count: int | None = None,
        *,
        owned: bool = False,
        norm: Tensor | None = None,
    ) -> tuple[Tree, AdamState]:
        _check(grads, state, params)
        keys = list(params)
        mu, nu, denom = self._moments(grads, state, keys, in_place=False)
        upd = torch._foreach_div(mu, denom)
        torch._foreach_mul_(upd, 1.0 / (1.0 - self.b1 ** (int(state.count) + 1)))
        return dict(zip(keys, upd)), AdamState(state.count + 1, dict(zip(keys, mu)), dict(zip(keys, nu)))

    def apply_at(
        self,
        grads: Tree,
        state: AdamState,
        params: Tree,
        count: int | None = None,
        rule: StepRule | None = None,
        *,
        owned: bool = False,
        norm: Tensor | None = None,
        donate: bool = False,
    ) -> tuple[Tree, AdamState]:
        if rule is None:  # no learning rate after it: the generic path
            return super().apply_at(grads, state, params, count, owned=owned, norm=norm, donate=donate)
        _check(grads, state, params)
        fusable = self.implementation == "fused" and all(
            p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params.values()
        )
        new_p, mu_all, nu_all = dict[str, Tensor](), dict[str, Tensor](), dict[str, Tensor]()
        for keys, wd in rule.groups(params):
            step = self._fused if fusable else self._foreach
            p, mu, nu = step(grads, state, params, keys, rule.lr, wd, donate)
            new_p.update(zip(keys, p))
            mu_all.update(zip(keys, mu))
            nu_all.update(zip(keys, nu))
        return {k: new_p[k] for k in params}, AdamState(state.count + 1, mu_all, nu_all)

    def _foreach(self, grads: Tree, state: AdamState, params: Tree, keys: list[str], lr: float, wd: float, in_place):
        """One group's step with ``_foreach`` ops, as ``torch.optim.AdamW(foreach=True)``."""
        mu, nu, denom = self._moments(grads, state, keys, in_place)
        step_size = lr / (1.0 - self.b1 ** (int(state.count) + 1))
        p = [params[k] for k in keys]
        if in_place:
            torch._foreach_mul_(p, 1.0 - lr * wd)
        else:
            p = list(torch._foreach_mul(p, 1.0 - lr * wd))
        torch._foreach_addcdiv_(p, mu, denom, -step_size)
        return p, mu, nu

    def _fused(self, grads: Tree, state: AdamState, params: Tree, keys: list[str], lr: float, wd: float, in_place):
        """One group's step with torch's fused kernel, on fresh copies (in place: the state's own buffers)."""
        fresh = (lambda t: t) if in_place else (lambda t: t.clone())
        p = [fresh(params[k]) for k in keys]
        mu = [fresh(state.mu[k]) for k in keys]
        nu = [fresh(state.nu[k]) for k in keys]
        steps = torch.full((len(keys),), float(int(state.count) + 1), device=p[0].device).unbind()
        torch._fused_adamw_(
            p,
            [grads[k] for k in keys],
            mu,
            nu,
            [],
            list(steps),
            lr=lr,
            beta1=self.b1,
            beta2=self.b2,
            weight_decay=wd,
            eps=self.eps,
            amsgrad=False,
            maximize=False,
        )
        return p, mu, nu

    def elementwise(self) -> tuple[ElementwiseAdam]:
        return (ElementwiseAdam(self.b1, self.b2, self.eps),)


def _check(grads: Tree, state: AdamState, params: Tree) -> None:
    check_keys(grads, params, "grads", "params")
    check_keys(state.mu, params, "Adam state", "params")


@attrs.frozen
class ElementwiseAdam:
    """Adam's hyperparameters for :func:`adamw_update`, the element-wise step."""

    b1: float
    b2: float
    eps: float

    def __call__(self, params, grads, mu, nu, decay, lr, step_size, bc2_sqrt):
        """Return new ``(params, mu, nu)``: :func:`adamw_update` with these hyperparameters."""
        return adamw_update(params, grads, mu, nu, decay, lr, step_size, bc2_sqrt, self.b1, self.b2, self.eps)


def adamw_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    mu: Sequence[Tensor],
    nu: Sequence[Tensor],
    decay: Sequence[float | Tensor],
    lr: Tensor,
    step_size: Tensor,
    bc2_sqrt: Tensor,
    b1: float | Tensor,
    b2: float | Tensor,
    eps: float | Tensor,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Return new ``(params, mu, nu)`` of one AdamW update, as ``torch.optim.AdamW`` computes it.

    Element-wise ops only (no foreach), so it traces under ``torch.compile`` and works on
    stacked ensemble tensors: ``lr``, ``step_size`` and ``bc2_sqrt`` broadcast against each tensor.

    >>> one = torch.tensor(1.0)
    >>> p, m, v = adamw_update([one], [torch.tensor(5.0)], [0 * one], [0 * one], [0.0],
    ...                        torch.tensor(0.1), torch.tensor(1.0), torch.tensor(0.0316227766), 0.9, 0.999, 1e-8)
    >>> round(p[0].item(), 4), round(m[0].item(), 4)
    (0.9, 0.5)
    """
    new_p, new_mu, new_nu = [], [], []
    for p, g, m, v, wd in zip(params, grads, mu, nu, decay):
        m = torch.lerp(m, g, 1.0 - b1)
        v = v * b2 + (1.0 - b2) * g * g
        denom = v.sqrt() / bc2_sqrt + eps
        scaled = p if isinstance(wd, (int, float)) and wd == 0 else p * (1.0 - lr * wd)
        new_p.append(scaled - step_size * m / denom)
        new_mu.append(m)
        new_nu.append(v)
    return new_p, new_mu, new_nu
