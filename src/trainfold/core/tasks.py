"""Which task a model's own loss trains (causal LM, sequence classification, ...), read from its class.

>>> import torch
>>> model_task(torch.nn.Linear(2, 2)) is None
True
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["model_task"]

# The head of a transformers class name, and the task its own loss trains.
_HF_TASKS = (
    ("ForCausalLM", "causal_lm"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForTokenClassification", "token_classification"),
    ("ForMaskedLM", "masked_lm"),
)
_HF_MAPPINGS = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal_lm"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence_classification"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token_classification"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked_lm"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
)


@functools.cache
def _hf_class_tasks() -> dict[str, frozenset[str]]:
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:  # pragma: no cover - transformers is optional
        return {}
    tasks: dict[str, set[str]] = {}
    for mapping, task in _HF_MAPPINGS:
        for names in getattr(modeling_auto, mapping, {}).values():
            for name in (names,) if isinstance(names, str) else names:
                tasks.setdefault(name, set()).add(task)
    return {name: frozenset(t) for name, t in tasks.items()}


def model_task(model: Any) -> str | None:
    """Return the task a model's own loss trains (``"causal_lm"``, ``"sequence_classification"``, ...), or None.

    Read from the class (and its bases): trainfold's ``TinyLM``, transformers' auto-model
    mappings and class-name heads (``...ForCausalLM``); ``"ambiguous"`` when HF lists the class
    under several tasks.

    >>> import torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> model_task(TinyLM(TinyLMConfig(vocab_size=8, d_model=4, n_layers=1, n_heads=1, max_len=4)))
    'causal_lm'
    >>> model_task(torch.nn.Linear(2, 2)) is None
    True
    """
    from trainfold.core.models import TinyLM

    if isinstance(model, TinyLM):
        return "causal_lm"
    if type(model).__name__ == "PeftModel" and hasattr(model, "get_base_model"):  # made without task_type
        return model_task(model.get_base_model())  # it forwards everything to its base model, loss included
    hf = _hf_class_tasks() if any(c.__module__.startswith("transformers.") for c in type(model).__mro__) else {}
    for cls in type(model).__mro__:
        tasks = hf.get(cls.__name__)
        if tasks:
            return next(iter(tasks)) if len(tasks) == 1 else "ambiguous"
        for head, task in _HF_TASKS:
            if cls.__name__.endswith(head):
                return task
    return None
