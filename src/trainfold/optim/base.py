"""Optimizers as pure ``(init, update)`` pairs over ``dict[str, Tensor]``, composed with ``chain``.

``update(grads, opt_state, params) -> (updates, opt_state)`` returns deltas to add to the
params; ``apply(grads, opt_state, params) -> (new_params, opt_state)`` returns the new params
directly (for ``adamw`` it runs torch's fused kernel on fresh copies). Hyperparameters live in
closures; learning rates may be schedules of the step. Nothing passed in is changed.

The step's own path is ``apply_owned(grads, opt_state, params, norm=, donate=)``: the caller owns
``grads`` (clipping rescales them in place, reusing the global ``norm`` it already computed) and,
with ``donate=True``, params and optimizer state are updated in place too (``adamw``: the fused
kernel on the state's own buffers) and the returned ones are the same tensors. Results are bitwise
equal to ``apply``.

>>> import torch
>>> opt = chain(clip_by_global_norm(1.0), sgd(0.1))
>>> params = {"w": torch.tensor([1.0])}
>>> new, state = opt.apply({"w": torch.tensor([10.0])}, opt.init(params), params)
>>> round(new["w"].item(), 4)  # the gradient was clipped to norm 1
0.9
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.state import scalar
from trainfold.core.tree import Tree, check_keys, global_norm
from trainfold.optim.schedules import Schedule, as_schedule

__all__ = [
    "GradientTransformation",
    "AdamState",
    "SgdState",
    "adamw",
    "sgd",
    "clip_by_global_norm",
    "chain",
    "apply_updates",
    "decay_mask",
    "decay_mask_by_name",
]

Mask = Mapping[str, bool] | Callable[[Mapping[str, Tensor]], Mapping[str, bool]]


@attrs.frozen
class GradientTransformation:
    """A pure optimizer: ``init(params)``, ``update(grads, state, params)``, and optional fast paths.

    ``learning_rate(state)`` returns the rate the next update will use (for logging). ``spec``
    describes the transformation as data (its ``name`` and hyperparameters), so other paths
    (the compiled and the ensemble step) can rebuild the same math without peeking into closures.

    A stateless one that steps by half the negative gradient:

    >>> half = GradientTransformation(init=lambda params: None,
    ...                               update=lambda g, s, p: ({k: -0.5 * v for k, v in g.items()}, s))
    >>> p = {"w": torch.tensor(1.0)}
    >>> half.apply({"w": torch.tensor(4.0)}, half.init(p), p)[0]["w"].item()
    -1.0
    """

    init: Callable[[Tree], Any]
    update: Callable[[Tree, Any, Tree], tuple[Tree, Any]]
    apply_fn: Callable[[Tree, Any, Tree], tuple[Tree, Any]] | None = None
    learning_rate: Callable[[Any], float] | None = None
    spec: Mapping[str, Any] = attrs.field(factory=dict)
    # update_in_place(grads, state, params, norm) -> state: ``update`` written into ``grads`` (``norm``: their
    # global norm when the caller has it, else None); owned_fn(grads, state, params, norm, donate) -> (params,
    # state): ``apply_owned``'s fast path
    update_in_place: Callable[[Tree, Any, Tree, Tensor | None], Any] | None = None
    owned_fn: Callable[[Tree, Any, Tree, Tensor | None, bool], tuple[Tree, Any]] | None = None

    def apply(self, grads: Tree, state: Any, params: Tree) -> tuple[Tree, Any]:
        """Return ``(new_params, new_state)`` for one update."""
        if self.apply_fn is not None:
            return self.apply_fn(grads, state, params)
        updates, state = self.update(grads, state, params)
        return apply_updates(params, updates), state

    def apply_owned(
        self, grads: Tree, state: Any, params: Tree, *, norm: Tensor | None = None, donate: bool = False
    ) -> tuple[Tree, Any]:
        """Return ``(new_params, new_state)`` as ``apply``, overwriting ``grads`` (the caller's to lose).

        ``norm`` is the global norm of ``grads`` if the caller computed it (clipping reuses it). With
        ``donate`` the params and state tensors are updated in place and returned (bitwise what
        ``apply`` returns); a transformation without an in-place path computes ``apply`` and copies
        the result into them.

        >>> opt = chain(clip_by_global_norm(1.0), sgd(0.5))
        >>> p = {"w": torch.tensor([1.0])}
        >>> new, _ = opt.apply_owned({"w": torch.tensor([4.0])}, opt.init(p), p, donate=True)
        >>> new["w"] is p["w"], round(p["w"].item(), 4)
        (True, 0.5)
        """
        if self.owned_fn is not None:
            return self.owned_fn(grads, state, params, norm, donate)
        new_params, new_state = self.apply(grads, state, params)
        if not donate:
            return new_params, new_state
        return overwrite(params, new_params), overwrite(state, new_state)


def overwrite(old: Any, new: Any) -> Any:
    """Copy ``new``'s tensors into ``old``'s at the same places and return ``old``'s structure holding them.

    Where the structures differ (other keys, shapes or dtypes) ``new``'s part is returned as it is; 0-d
    tensors (counters) are never overwritten, so a record's old counters keep their values.

    >>> old = {"w": torch.zeros(2)}
    >>> out = overwrite(old, {"w": torch.ones(2)})
    >>> out["w"] is old["w"], old["w"].tolist()
    (True, [1.0, 1.0])
    """
    if isinstance(new, Tensor):
        same = (
            isinstance(old, Tensor)
            and old.dim() > 0
            and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
        )
        if not same:
            return new
        if old.data_ptr() != new.data_ptr():
            old.copy_(new)
        return old
    if attrs.has(type(new)) and type(old) is type(new):
        return attrs.evolve(
            new,
            **{
                f.name: overwrite(getattr(old, f.name), getattr(new, f.name)) for f in attrs.fields(type(new)) if f.init
            },
        )
    if isinstance(new, Mapping) and isinstance(old, Mapping):
        return {k: overwrite(old[k], v) if k in old else v for k, v in new.items()}
    if isinstance(new, tuple) and isinstance(old, tuple) and len(old) == len(new):
        return type(new)(overwrite(a, b) for a, b in zip(old, new)) if type(new) is tuple else new
    return new


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """Return ``params + updates`` as new tensors.

    >>> import torch
    >>> apply_updates({"w": torch.tensor(1.0)}, {"w": torch.tensor(0.5)})["w"].item()
    1.5
    """
    check_keys(updates, params, "updates", "params")
    keys = list(params)
    return dict(zip(keys, torch._foreach_add([params[k] for k in keys], [updates[k] for k in keys])))


def _check_state(grads: Tree, moments: Tree, params: Tree, what: str) -> None:
    check_keys(grads, params, "grads", "params")
    check_keys(moments, params, f"{what} state", "params")


# -- clipping ---------------------------------------------------------------------------------------


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale gradients so their global 2-norm is at most ``max_norm`` (as ``clip_grad_norm_``).

    >>> import torch
    >>> clip = clip_by_global_norm(1.0)
    >>> g, _ = clip.update({"a": torch.tensor([3.0, 4.0])}, clip.init({}), {})
    >>> [round(x, 4) for x in g["a"].tolist()]
    [0.6, 0.8]
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}; leave clipping out of the chain instead")

    def init(params: Tree) -> tuple:
        return ()

    def update(grads: Tree, state: tuple, params: Tree | None = None) -> tuple[Tree, tuple]:
        keys = list(grads)
        if not keys:
            return {}, state
        norm = global_norm(grads)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return dict(zip(keys, torch._foreach_mul([grads[k] for k in keys], coef))), state

    def update_in_place(grads: Tree, state: tuple, params: Tree | None, norm: Tensor | None) -> tuple:
        if grads:
            norm = global_norm(grads) if norm is None else norm
            torch._foreach_mul_(list(grads.values()), torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return state

    return GradientTransformation(
        init, update, spec={"name": "clip_by_global_norm", "max_norm": float(max_norm)}, update_in_place=update_in_place
    )


# -- SGD ----------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class SgdState:
    """What :func:`sgd` carries between updates: the update count and the momentum buffers.

    >>> opt = sgd(0.1, momentum=0.9)
    >>> p = {"w": torch.tensor(1.0)}
    >>> _, state = opt.apply({"w": torch.tensor(2.0)}, opt.init(p), p)
    >>> state.count.item(), {k: v.item() for k, v in state.momentum.items()}
    (1, {'w': 2.0})
    """

    count: Tensor
    momentum: dict[str, Tensor]


def _resolve_mask(mask: Mask | None, params: Tree) -> dict[str, bool]:
    """Return ``{name: decay?}`` for every param from a mask (mapping, function of the params, or None: all)."""
    m = mask(params) if callable(mask) else (mask or {k: True for k in params})
    missing = sorted(set(params) - set(m))
    if missing:
        raise KeyError(f"the weight-decay mask has no entry for params {missing}; give every param a bool")
    return {k: bool(m[k]) for k in params}


def sgd(
    learning_rate: float | Schedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
    mask: Mask | None = None,
) -> GradientTransformation:
    """SGD with optional momentum, dampening, Nesterov and (coupled) weight decay, as ``torch.optim.SGD``.

    ``mask`` (as in :func:`adamw`; ``None`` decays every param) picks the params weight decay applies to.

    >>> import torch
    >>> opt = sgd(0.5)
    >>> p = {"w": torch.tensor(1.0)}
    >>> opt.apply({"w": torch.tensor(2.0)}, opt.init(p), p)[0]["w"].item()
    0.0
    """
    lr = as_schedule(learning_rate)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov=True needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
    masks: dict[tuple[str, ...], list[str]] = {}

    def decayed(params: Tree) -> list[str]:
        key = tuple(params)
        if key not in masks:
            masks[key] = [k for k, d in _resolve_mask(mask, params).items() if d]
        return masks[key]

    def init(params: Tree) -> SgdState:
        buf = {k: torch.zeros_like(v) for k, v in params.items()} if momentum else {}
        return SgdState(scalar(0), buf)

    def update(grads: Tree, state: SgdState, params: Tree) -> tuple[Tree, SgdState]:
        check_keys(grads, params, "grads", "params")
        keys = list(params)
        if weight_decay:
            with_decay = dict(grads)
            names = decayed(params)
            with_decay.update(
                zip(
                    names, torch._foreach_add([grads[k] for k in names], [params[k] for k in names], alpha=weight_decay)
                )
            )
            grads = with_decay
        g = [grads[k] for k in keys]
        buf = state.momentum
        if momentum:
            check_keys(buf, params, "SGD momentum state", "params")
            first = int(state.count) == 0  # torch starts the buffer at the first gradient
            if first:
                new = [x.clone() for x in g]
            else:
                new = torch._foreach_mul([buf[k] for k in keys], momentum)
                torch._foreach_add_(new, g, alpha=1.0 - dampening)
            buf = dict(zip(keys, new))
            g = torch._foreach_add(g, new, alpha=momentum) if nesterov else new
        rate = lr(int(state.count))
        updates = dict(zip(keys, torch._foreach_mul(g, -rate)))
        return updates, SgdState(state.count + 1, buf)

    spec = {
        "name": "sgd",
        "learning_rate": lr,
        "momentum": momentum,
        "nesterov": nesterov,
        "weight_decay": weight_decay,
        "dampening": dampening,
    }
    return GradientTransformation(init, update, learning_rate=lambda s: lr(int(s.count)), spec=spec)


# -- AdamW ---------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class AdamState:
    """What :func:`adamw` carries between updates: the update count and the two moment estimates.

    >>> opt = adamw(0.1)
    >>> p = {"w": torch.tensor([1.0])}
    >>> _, state = opt.apply({"w": torch.tensor([2.0])}, opt.init(p), p)
    >>> state.count.item(), round(state.mu["w"].item(), 4), round(state.nu["w"].item(), 4)
    (1, 0.2, 0.004)
    """

    count: Tensor
    mu: dict[str, Tensor]
    nu: dict[str, Tensor]


_NORM_NAME = re.compile(r"(^|[._])(ln|norm)(\d+|_|$)|norm|layernorm|rmsnorm", re.IGNORECASE)


def decay_mask_by_name(params: Mapping[str, Any]) -> dict[str, bool]:
    """Return ``{name: decay?}``: biases and normalisation weights (judged by name) are not decayed.

    >>> decay_mask_by_name({"h.0.ln_1.weight": 0, "h.0.attn.bias": 0, "wte.weight": 0, "norm1.weight": 0})
    {'h.0.ln_1.weight': False, 'h.0.attn.bias': False, 'wte.weight': True, 'norm1.weight': False}
    """

    def decays(name: str) -> bool:
        parts = name.lower().split(".")
        if "bias" in parts[-1]:
            return False
        return not any(_NORM_NAME.search(p) for p in parts[:-1] or parts)

    return {name: decays(name) for name in params}


def decay_mask(model: nn.Module) -> dict[str, bool]:
    """Return the decay mask of ``model``'s trainable params: not biases, not any norm layer's weights.

    Norm layers are found by module type (torch's norm layers, and any class whose name ends in
    ``Norm``, like HF's ``LlamaRMSNorm``) as well as by name.

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    >>> decay_mask(m)
    {'0.weight': True, '0.bias': False, '1.weight': False, '1.bias': False}
    """
    norm_types = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
    norm_types += (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()
    in_norm: set[str] = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, norm_types) or type(module).__name__.lower().endswith("norm"):
            in_norm.update(_join(mod_name, n) for n, _ in module.named_parameters(recurse=False))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    by_name = decay_mask_by_name(dict.fromkeys(names))
    return {n: by_name[n] and n not in in_norm for n in names}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def adamw(
    learning_rate: float | Schedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask | None = decay_mask_by_name,
    implementation: str = "fused",
) -> GradientTransformation:
    """AdamW as ``torch.optim.AdamW``: decoupled weight decay on the params ``mask`` marks True.

    ``mask`` is a ``{name: bool}`` mapping, a function of the params returning one, or ``None``
    to decay every param. ``implementation="fused"`` runs torch's fused kernel on fresh copies
    (bitwise equal to ``AdamW(fused=True)``); ``"foreach"`` uses ``torch._foreach_*`` ops.

    >>> import torch
    >>> opt = adamw(0.1)
    >>> p = {"w": torch.tensor([1.0])}
    >>> new, s = opt.apply({"w": torch.tensor([5.0])}, opt.init(p), p)
    >>> round(new["w"].item(), 4), s.count.item()
    (0.9, 1)
    """
    if implementation not in ("fused", "foreach"):
        raise ValueError(f"implementation must be 'fused' or 'foreach', got {implementation!r}")
    for name, value, low in (("b1", b1, 0.0), ("b2", b2, 0.0)):
        if not low <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    lr = as_schedule(learning_rate)
    masks: dict[tuple[str, ...], dict[str, bool]] = {}

    def groups(params: Tree) -> list[tuple[list[str], float]]:
        key = tuple(params)
        if key not in masks:
            masks[key] = _resolve_mask(mask, params)
        decided = masks[key]
        decay = [k for k in params if decided[k]]
        rest = [k for k in params if not decided[k]]
        return [(g, wd) for g, wd in ((decay, weight_decay), (rest, 0.0)) if g]

    def init(params: Tree) -> AdamState:
        return AdamState(
            scalar(0),
            {k: torch.zeros_like(v) for k, v in params.items()},
            {k: torch.zeros_like(v) for k, v in params.items()},
        )

    def moments(
        grads: Tree, state: AdamState, keys: list[str], in_place: bool = False
    ) -> tuple[list[Tensor], list[Tensor]]:
        g = [grads[k] for k in keys]
        mu, nu = [state.mu[k] for k in keys], [state.nu[k] for k in keys]
        if in_place:  # the same kernels, written into the state's own tensors
            torch._foreach_lerp_(mu, g, 1.0 - b1)
            torch._foreach_mul_(nu, b2)
        else:
            mu = torch._foreach_lerp(mu, g, 1.0 - b1)
            nu = torch._foreach_mul(nu, b2)
        torch._foreach_addcmul_(nu, g, g, 1.0 - b2)
        return mu, nu

    def direction(state: AdamState, mu: list[Tensor], nu: list[Tensor]) -> tuple[float, list[Tensor]]:
        count = int(state.count) + 1
        rate = lr(count - 1)
        denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, (1.0 - b2**count) ** 0.5)
        torch._foreach_add_(denom, eps)
        return rate, denom

    def foreach_groups(
        grads: Tree, state: AdamState, params: Tree, finish: Callable[..., list[Tensor]], in_place: bool = False
    ) -> tuple[Tree, AdamState]:
        # One Adam step per decay group with _foreach ops: new moments and denominators, then
        # finish(keys, wd, mu, denom, rate, step_size) gives the group's outputs (deltas or new params).
        _check_state(grads, state.mu, params, "Adam")
        out, mu_all, nu_all = {}, {}, {}
        for keys, wd in groups(params):
            mu, nu = moments(grads, state, keys, in_place)
            rate, denom = direction(state, mu, nu)
            step_size = rate / (1.0 - b1 ** (int(state.count) + 1))
            out.update(zip(keys, finish(keys, wd, mu, denom, rate, step_size)))
            mu_all.update(zip(keys, mu))
            nu_all.update(zip(keys, nu))
        return out, AdamState(state.count + 1, mu_all, nu_all)

    def update(grads: Tree, state: AdamState, params: Tree) -> tuple[Tree, AdamState]:
        def deltas(
            keys: list[str], wd: float, mu: list[Tensor], denom: list[Tensor], rate: float, step_size: float
        ) -> list[Tensor]:
            upd = torch._foreach_div(mu, denom)
            torch._foreach_mul_(upd, -step_size)
            if wd:
                torch._foreach_add_(upd, torch._foreach_mul([params[k] for k in keys], -rate * wd))
            return upd

        return foreach_groups(grads, state, params, deltas)

    def apply_foreach(grads: Tree, state: AdamState, params: Tree, in_place: bool = False) -> tuple[Tree, AdamState]:
        def stepped(
            keys: list[str], wd: float, mu: list[Tensor], denom: list[Tensor], rate: float, step_size: float
        ) -> list[Tensor]:
            p = [params[k] for k in keys]
            if in_place:
                torch._foreach_mul_(p, 1.0 - rate * wd)
            else:
                p = torch._foreach_mul(p, 1.0 - rate * wd)
            torch._foreach_addcdiv_(p, mu, denom, -step_size)
            return p

        new_p, new_state = foreach_groups(grads, state, params, stepped, in_place)
        return {k: new_p[k] for k in params}, new_state

    def apply_fused(grads: Tree, state: AdamState, params: Tree, in_place: bool = False) -> tuple[Tree, AdamState]:
        _check_state(grads, state.mu, params, "Adam")
        rate = lr(int(state.count))
        new_p, mu_all, nu_all = {}, {}, {}
        fresh = (lambda t: t) if in_place else (lambda t: t.clone())  # in place: the state's own buffers
        for keys, wd in groups(params):
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
                lr=rate,
                beta1=b1,
                beta2=b2,
                weight_decay=wd,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )
            new_p.update(zip(keys, p))
            mu_all.update(zip(keys, mu))
            nu_all.update(zip(keys, nu))
        return {k: new_p[k] for k in params}, AdamState(state.count + 1, mu_all, nu_all)

    def apply(grads: Tree, state: AdamState, params: Tree, in_place: bool = False) -> tuple[Tree, AdamState]:
        fusable = implementation == "fused" and all(
            p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params.values()
        )
        return (apply_fused if fusable else apply_foreach)(grads, state, params, in_place)

    def owned(grads: Tree, state: AdamState, params: Tree, norm: Tensor | None, donate: bool) -> tuple[Tree, AdamState]:
        return apply(grads, state, params, donate)

    spec = {
        "name": "adamw",
        "learning_rate": lr,
        "b1": b1,
        "b2": b2,
        "eps": eps,
        "weight_decay": weight_decay,
        "groups": groups,
    }
    return GradientTransformation(
        init, update, apply, learning_rate=lambda s: lr(int(s.count)), spec=spec, owned_fn=owned
    )


# -- composition ---------------------------------------------------------------------------------------


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations left to right; the state is the tuple of their states.

    The last transformation's fast ``apply`` is used when it has one.

    >>> import torch
    >>> opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
    >>> len(opt.init({"w": torch.zeros(2)}))
    2
    """
    if not transforms:
        raise ValueError("chain needs at least one transformation")

    def init(params: Tree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def _check(state: tuple) -> None:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state of "
                f"{len(state) if isinstance(state, tuple) else type(state).__name__} parts; "
                "build the state with this optimizer's init"
            )

    def update(grads: Tree, state: tuple, params: Tree) -> tuple[Tree, tuple]:
        _check(state)
        new_states = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)

    def apply(grads: Tree, state: tuple, params: Tree) -> tuple[Tree, tuple]:
        _check(state)
        new_states = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        new_params, last = transforms[-1].apply(grads, state[-1], params)
        return new_params, (*new_states, last)

    def owned(grads: Tree, state: tuple, params: Tree, norm: Tensor | None, donate: bool) -> tuple[Tree, tuple]:
        _check(state)
        new_states = []
        for t, s in zip(transforms[:-1], state[:-1]):
            if t.update_in_place is not None:  # the grads are the caller's: rescale them where they are
                s = t.update_in_place(grads, s, params, norm)
            else:
                grads, s = t.update(grads, s, params)
            norm = None  # the grads changed: a later part computes its own
            new_states.append(s)
        new_params, last = transforms[-1].apply_owned(grads, state[-1], params, norm=norm, donate=donate)
        return new_params, (*new_states, last)

    def learning_rate(state: tuple) -> float:
        for t, s in zip(transforms, state):
            if t.learning_rate is not None:
                return t.learning_rate(s)
        return float("nan")

    return GradientTransformation(
        init, update, apply, learning_rate, spec={"name": "chain", "transforms": transforms}, owned_fn=owned
    )
