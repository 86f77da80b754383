"""The optimizers users pick, ``adamw`` and ``sgd``: aliases, each a ``chain`` of the small transforms.

``adamw(lr, ...)`` is ``chain(scale_by_adam(...), add_decayed_weights(wd, mask), scale_by_learning_rate(lr))``
and ``sgd(lr, ...)`` is ``chain(add_decayed_weights(wd, mask), trace(momentum, ...), scale_by_learning_rate(lr))``,
named for error messages. Their states are the stateful part's: an ``AdamState``, an ``SgdState``.

>>> import torch
>>> from trainfold.optim import clip_by_global_norm
>>> opt = chain(clip_by_global_norm(1.0), sgd(0.1))
>>> params = {"w": torch.tensor([1.0])}
>>> new, state = opt.apply({"w": torch.tensor([10.0])}, opt.init(params), params)
>>> round(new["w"].item(), 4)  # the gradient was clipped to norm 1
0.9
"""

from __future__ import annotations

from trainfold.optim.adam import scale_by_adam
from trainfold.optim.chain import Chain, chain
from trainfold.optim.masks import Mask, decay_mask_by_name
from trainfold.optim.schedules import Schedule
from trainfold.optim.transforms import add_decayed_weights, scale_by_learning_rate, trace

__all__ = ["adamw", "sgd"]


def adamw(
    learning_rate: float | Schedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Mask | None = decay_mask_by_name,
    implementation: str = "fused",
) -> Chain:
    """AdamW as ``torch.optim.AdamW``: decoupled weight decay on the params ``mask`` marks True.

    ``mask`` is a ``{name: bool}`` mapping, a function of the params returning one, or ``None``
    to decay every param. ``implementation="fused"`` runs torch's fused kernel on fresh copies
    (bitwise equal to ``AdamW(fused=True)``); ``"foreach"`` uses ``torch._foreach_*`` ops.

    >>> import torch
    >>> opt = adamw(0.1)
    >>> p = {"w": torch.tensor([1.0])}
    >>> new, s = opt.apply({"w": torch.tensor([5.0])}, opt.init(p), p)
    >>> round(new["w"].item(), 4), s.count.item(), [t.name for t in opt.parts]
    (0.9, 1, ['scale_by_adam', 'add_decayed_weights', 'scale_by_learning_rate'])
    """
    return chain(
        scale_by_adam(b1, b2, eps, implementation),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
        name="adamw",
    )


def sgd(
    learning_rate: float | Schedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
    mask: Mask | None = None,
) -> Chain:
    """SGD with optional momentum, dampening, Nesterov and (coupled) weight decay, as ``torch.optim.SGD``.

    ``mask`` (as in :func:`adamw`; ``None`` decays every param) picks the params weight decay applies to.

    >>> import torch
    >>> opt = sgd(0.5)
    >>> p = {"w": torch.tensor(1.0)}
    >>> opt.apply({"w": torch.tensor(2.0)}, opt.init(p), p)[0]["w"].item()
    0.0
    """
    return chain(
        add_decayed_weights(weight_decay, mask),
        trace(momentum, dampening, nesterov),
        scale_by_learning_rate(learning_rate),
        name="sgd",
    )
