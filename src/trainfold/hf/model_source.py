"""The model a TRL-style run trains: a module as given, or one loaded by name or path, then wrapped by PEFT.

>>> import torch
>>> lin = torch.nn.Linear(2, 2)
>>> model_from(lin) is lin
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["model_from"]


def model_from(
    model: nn.Module | str, model_init_kwargs: Mapping[str, Any] | None = None, peft_config: Any = None
) -> Any:
    """Return ``model`` (or ``AutoModelForCausalLM.from_pretrained(model, **model_init_kwargs)`` for a name or
    path), wrapped by ``peft.get_peft_model`` when ``peft_config`` is given, as TRL's trainers take it."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, **(model_init_kwargs or {}))
    elif model_init_kwargs:
        raise ValueError("model_init_kwargs apply when the model is a name or path; drop them for a built module")
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    return model
