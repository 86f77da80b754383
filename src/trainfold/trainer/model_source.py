"""The model a TRL-style run trains: a module as given, or one loaded by name or path, then wrapped by PEFT.

>>> import torch
>>> lin = torch.nn.Linear(2, 2)
>>> model_from(lin) is lin
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["model_from", "processing_class_for"]


def model_from(
    model: nn.Module | str,
    model_init_kwargs: Mapping[str, Any] | None = None,
    peft_config: Any = None,
    seed: int | None = None,
) -> nn.Module:
    """Return ``model`` (or ``AutoModelForCausalLM.from_pretrained(model, **model_init_kwargs)`` for a name or
    path), wrapped by ``peft.get_peft_model`` when ``peft_config`` is given, as TRL's trainers take it.

    With ``seed`` (the run's), what is initialised at random here (PEFT's adapter weights, weights missing
    from the checkpoint) is drawn as TRL draws it, after ``set_seed(args.seed)``; the global generators are
    left as they were.

    >>> lin, before = nn.Linear(2, 2), torch.random.get_rng_state()
    >>> model_from(lin, seed=3) is lin, torch.equal(before, torch.random.get_rng_state())
    (True, True)
    """
    if seed is None:
        return _built(model, model_init_kwargs, peft_config)
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):  # every device, named: no warning
        torch.manual_seed(seed)
        return _built(model, model_init_kwargs, peft_config)


def _built(model: nn.Module | str, model_init_kwargs: Mapping[str, Any] | None, peft_config: Any) -> nn.Module:
    if model_init_kwargs and not isinstance(model, str):
        raise ValueError("model_init_kwargs apply when the model is a name or path; drop them for a built module")
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, **(model_init_kwargs or {}))
    if peft_config is not None:
        from peft import get_peft_model

        return get_peft_model(model, peft_config)
    return model


def without_dropout(model: nn.Module) -> nn.Module:
    """Turn off every ``nn.Dropout`` of ``model`` (``p=0``, in place; TRL's ``disable_dropout``) and return it.

    >>> without_dropout(nn.Sequential(nn.Dropout(0.1)))[0].p
    0.0
    """
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def processing_class_for(model: Any, processing_class: Any = None) -> Any:
    """Return ``processing_class``, or, as TRL's trainers do without one, the tokenizer saved beside the
    model (``AutoTokenizer.from_pretrained`` of the path it was loaded from); ``None`` for a model built
    from a config.

    >>> processing_class_for(nn.Linear(2, 2)) is None
    True
    """
    if processing_class is not None:
        return processing_class
    source = getattr(getattr(model, "config", None), "_name_or_path", "")
    if not source:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
