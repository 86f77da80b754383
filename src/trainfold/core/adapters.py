"""PEFT's adapter on disk: the files ``PeftModel.save_pretrained`` writes, which tensors go there under which keys,
and its ``adapter_config.json``, for a ``PeftModel`` or the base module ``get_peft_model`` injected adapters into.

The checkpoint layout (``trainfold.ckpt.layout``), an ensemble's adapters (``trainfold.step.ensemble.lora``) and
``save_model`` write adapters with these. ``peft`` is imported only for a peft model.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any, TypeGuard, cast

from torch import Tensor, nn

from trainfold.core.state import with_aliases

__all__ = [
    "ADAPTER_FILE",
    "ADAPTER_CONFIG_FILE",
    "is_peft_model",
    "adapter_keys",
    "adapter_config_text",
    "has_injected_adapter",
    "injected_adapter_weights",
]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def is_peft_model(model: Any) -> TypeGuard[nn.Module]:
    """Say whether ``model`` is a ``peft.PeftModel`` (without importing ``peft`` when it is not loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _adapter_name(model: Any) -> str:
    names = sorted(model.peft_config)
    if len(names) != 1:
        raise ValueError(
            f"the PeftModel has adapters {names}: a trainfold checkpoint holds one adapter (as "
            "adapter_model.safetensors); train one at a time (model.delete_adapter(name) for the others)"
        )
    config = model.peft_config[names[0]]
    if config.is_prompt_learning:
        raise ValueError(
            f"the PeftModel's adapter {names[0]!r} is {config.peft_type} (prompt learning): peft saves prompt "
            "embeddings computed from the module, not the trained tensors, so trainfold cannot write them from "
            "the state; use an adapter such as LoRA, or save with model.save_pretrained after apply_to(model)"
        )
    return names[0]


def adapter_keys(model: Any, weights: Mapping[str, Tensor]) -> dict[str, str]:
    """Return ``{state_dict name: adapter file key}`` of what ``PeftModel.save_pretrained`` would write.

    ``weights`` maps ``model``'s ``state_dict`` names to the state's tensors; peft's own
    ``get_peft_model_state_dict`` chooses among them (adapter tensors, ``modules_to_save``, embedding
    layers when it saves them) and names them. Each one it returns must be one of ``weights``' tensors.
    """
    from peft.utils import get_peft_model_state_dict

    name = _adapter_name(model)
    chosen = get_peft_model_state_dict(model, state_dict=with_aliases(model, weights), adapter_name=name)
    by_id = {id(v): k for k, v in weights.items()}
    foreign = sorted(k for k, v in chosen.items() if id(v) not in by_id)
    if foreign:
        raise ValueError(
            f"peft's adapter state dict has {foreign[:5]}, which are not tensors of the state; trainfold "
            "writes adapter_model.safetensors from the trained state only"
        )
    return {by_id[id(v)]: k for k, v in chosen.items()}


def has_injected_adapter(model: Any) -> bool:
    """Say whether ``model`` is the base module a ``PeftModel`` wraps (``get_peft_model(model, config)`` injects
    the adapter layers into it and leaves it ``peft_config``), not the ``PeftModel`` itself."""
    peft = sys.modules.get("peft")
    if peft is None or is_peft_model(model) or not isinstance(getattr(model, "peft_config", None), dict):
        return False
    if getattr(model, "_hf_peft_config_loaded", False):  # transformers' own adapters: its save_pretrained saves them
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def injected_adapter_weights(model: Any) -> dict[str, Tensor]:
    """Return what ``PeftModel.save_pretrained`` writes to ``adapter_model.safetensors`` for the ``PeftModel``
    that wraps ``model`` (see :func:`has_injected_adapter`): peft's adapter state dict under the wrapper's names."""
    from peft.utils import PeftType, get_peft_model_state_dict

    name = _adapter_name(model)
    if model.peft_config[name].peft_type != PeftType.LORA:
        raise ValueError(
            f"{type(model).__name__} holds a {model.peft_config[name].peft_type} adapter injected by "
            "get_peft_model, whose PeftModel is not at hand: wrap the model yourself (model = "
            "peft.get_peft_model(model, peft_config)), train that module, and save it"
        )
    chosen = get_peft_model_state_dict(model, adapter_name=name)
    return {f"base_model.model.{k}": v.contiguous() for k, v in chosen.items()}


def adapter_config_text(model: Any) -> str:
    """Return ``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (``inference_mode`` true), for
    a ``PeftModel`` or the base module it wraps."""
    config = model.peft_config[_adapter_name(model)]
    inner = cast(Any, model).base_model.model if is_peft_model(model) else model  # PeftModel._get_base_model_class's
    # the user's config is not changed; ``to_dict`` of the config itself (no deep copy first) lists each set
    # (``target_modules``) in the order PEFT's own save lists it: a copied set may iterate in another order
    out = config.to_dict()
    if out.get("base_model_name_or_path") is None:
        out["base_model_name_or_path"] = inner.__dict__.get("name_or_path", None) or None
    out["inference_mode"] = True
    out = {k: list(v) if isinstance(v, set) else v for k, v in out.items()}
    if config.task_type is None:
        cls = type(inner)
        out["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return json.dumps(out, indent=2, sort_keys=True)
