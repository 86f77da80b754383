"""PEFT adapters in checkpoints: what ``PeftModel.save_pretrained`` writes, taken from the state.

A ``peft`` model (``get_peft_model(base, LoraConfig(...))``) trains as any module: its adapter
tensors are the trainable params, the frozen base weights are buffers of the state. A checkpoint
of it holds ``adapter_model.safetensors`` (the adapter under peft's own key names, the adapter
name removed: ``...q_proj.lora_A.weight``) and ``adapter_config.json`` (the ``LoraConfig``,
``inference_mode`` true, as peft writes it), so ``PeftModel.from_pretrained(base, checkpoint)``
loads it; the frozen base is not written at all (see ``trainfold.ckpt.layout``: it is the module's,
fingerprinted at save and checked at resume). Nothing here imports ``peft`` unless the model is one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any, TypeGuard

from torch import Tensor, nn

__all__ = [
    "ADAPTER_FILE",
    "ADAPTER_CONFIG_FILE",
    "is_peft_model",
    "adapter_keys",
    "adapter_config_text",
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
    chosen = get_peft_model_state_dict(model, state_dict=dict(weights), adapter_name=name)
    by_id = {id(v): k for k, v in weights.items()}
    foreign = sorted(k for k, v in chosen.items() if id(v) not in by_id)
    if foreign:
        raise ValueError(
            f"peft's adapter state dict has {foreign[:5]}, which are not tensors of the state; trainfold "
            "writes adapter_model.safetensors from the trained state only"
        )
    return {by_id[id(v)]: k for k, v in chosen.items()}


def adapter_config_text(model: Any) -> str:
    """Return ``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (``inference_mode`` true)."""
    config = model.peft_config[_adapter_name(model)]
    # the user's config is not changed; ``to_dict`` of the config itself (no deep copy first) lists each set
    # (``target_modules``) in the order PEFT's own save lists it: a copied set may iterate in another order
    out = config.to_dict()
    if out.get("base_model_name_or_path") is None:
        out["base_model_name_or_path"] = model.base_model.model.__dict__.get("name_or_path", None) or None
    out["inference_mode"] = True
    out = {k: list(v) if isinstance(v, set) else v for k, v in out.items()}
    if config.task_type is None:
        cls = model._get_base_model_class(is_prompt_tuning=False)
        out["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return json.dumps(out, indent=2, sort_keys=True)
