"""Which params a transformation touches: weight-decay masks, by name or by module type.

>>> import torch
>>> resolve_mask(decay_mask_by_name, {"w": torch.zeros(1), "b.bias": torch.zeros(1)})
{'w': True, 'b.bias': False}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["Mask", "decay_mask", "decay_mask_by_name", "resolve_mask"]

Mask = Mapping[str, bool] | Callable[[Mapping[str, Tensor]], Mapping[str, bool]]

_NORM_NAME = re.compile(r"(^|[._])(ln|norm)(\d+|_|$)|norm|layernorm|rmsnorm", re.IGNORECASE)


def resolve_mask(mask: Mask | None, params: Mapping[str, Any]) -> dict[str, bool]:
    """Return ``{name: decay?}`` for every param from a mask (mapping, function of the params, or None: all).

    >>> resolve_mask({"w": True}, {"w": 0, "b": 0})
    Traceback (most recent call last):
    ...
    KeyError: "the weight-decay mask has no entry for params ['b']; give every param a bool"
    """
    m = mask(params) if callable(mask) else (mask or {k: True for k in params})
    missing = sorted(set(params) - set(m))
    if missing:
        raise KeyError(f"the weight-decay mask has no entry for params {missing}; give every param a bool")
    return {k: bool(m[k]) for k in params}


def decay_mask_by_name(params: Mapping[str, Any]) -> dict[str, bool]:
    """Return ``{name: decay?}``: biases and normalisation weights (judged by name) are not decayed.

    A name with ``bias`` anywhere is not decayed, as in HF (T5's ``relative_attention_bias.weight``).

    >>> decay_mask_by_name({"h.0.ln_1.weight": 0, "h.0.attn.bias": 0, "wte.weight": 0, "norm1.weight": 0})
    {'h.0.ln_1.weight': False, 'h.0.attn.bias': False, 'wte.weight': True, 'norm1.weight': False}
    >>> decay_mask_by_name({"block.0.relative_attention_bias.weight": 0})
    {'block.0.relative_attention_bias.weight': False}
    """

    def decays(name: str) -> bool:
        parts = name.lower().split(".")
        if "bias" in name.lower():
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
    norm_types: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)
    norm_types += (nn.modules.batchnorm._NormBase,)
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
