"""Where a state's tensors go in a checkpoint: the weights file under the model's names, the state file, or nowhere.

The params and persistent buffers go to ``model.safetensors`` under the model's ``state_dict`` names
(tied weights once). A ``peft`` model (``get_peft_model(base, LoraConfig(...))``) trains as any module,
its adapter tensors the trainable params and its frozen base weights buffers of the state; its
checkpoint holds what ``PeftModel.save_pretrained`` writes: ``adapter_model.safetensors`` (peft's key
names, the adapter name removed) and ``adapter_config.json`` (``inference_mode`` true), so
``PeftModel.from_pretrained(base, checkpoint)`` loads it. The frozen base goes nowhere: its
``fingerprint`` goes into the sidecar and is checked at resume. ``peft`` is imported only for a peft model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
from torch import nn

from trainfold.ckpt.sidecar import CONFIG_FILE, MODEL_FILE
from trainfold.core.adapters import ADAPTER_CONFIG_FILE, ADAPTER_FILE, adapter_config_text, adapter_keys, is_peft_model
from trainfold.core.state import TrainState
from trainfold.core.tree import Tree, flatten

__all__ = ["Layout", "layout_of", "model_weights"]


def _state_keys(state: TrainState, model: nn.Module | None) -> dict[str, str]:
    """Return ``{state_dict name: flattened state key}`` of ``model``'s weights, each tied tensor once."""
    if model is None:
        return {**{k: f"buffers.{k}" for k in state.buffers}, **{k: f"params.{k}" for k in state.params}}
    source = {id(b): n for n, b in model.named_buffers()} | {id(p): n for n, p in model.named_parameters()}
    out: dict[str, str] = {}
    done: set[str] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        name = source.get(id(value), key)
        if name in done:
            continue  # a tied alias: saved once, under its first name
        if name in state.params:
            out[key] = f"params.{name}"
        elif name in state.buffers:
            out[key] = f"buffers.{name}"
        else:
            raise KeyError(
                f"the model's {key!r} is not in the state (params and buffers); pass the model the "
                "state was made from (init_state(model, ...))"
            )
        done.add(name)
    return out


def model_weights(state: TrainState, model: nn.Module | None = None) -> Tree:
    """Return the state's weights under ``model``'s ``state_dict`` names, each tied tensor once.

    Non-persistent buffers are left out, as ``state_dict`` leaves them out. Without ``model`` the
    state's own names are used (params, then all buffers).

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> m = torch.nn.BatchNorm1d(2)
    >>> sorted(model_weights(init_state(m, sgd(0.1)), m))
    ['bias', 'num_batches_tracked', 'running_mean', 'running_var', 'weight']
    """
    flat = flatten({"buffers": state.buffers, "params": state.params})
    return {name: flat[key] for name, key in _state_keys(state, model).items()}


@attrs.frozen
class Layout:
    """Where each tensor of a state goes: a weights file (under its names), the state file, or nowhere (frozen)."""

    weights_file: str
    weights: dict[str, str]  # flattened state key -> key in weights_file
    frozen: tuple[str, ...]  # flattened state keys of frozen base weights, written nowhere
    config_file: str | None
    config_text: str | None


def layout_of(state: TrainState, model: nn.Module | None, config: Any) -> Layout:
    """Return where each tensor of ``state`` goes, for ``model`` (``None``: the state's own names) and ``config``."""
    keys = _state_keys(state, model)
    if not is_peft_model(model):
        if config is None and model is not None:
            config = getattr(model, "config", None)
        text = _config_text(config)
        return Layout(MODEL_FILE, {v: k for k, v in keys.items()}, (), None if text is None else CONFIG_FILE, text)
    chosen = adapter_keys(model, model_weights(state, model))
    weights = {keys[k]: v for k, v in chosen.items()}
    frozen = tuple(
        f"buffers.{n}"
        for n, p in model.named_parameters()
        if not p.requires_grad and f"buffers.{n}" not in weights and n in state.buffers
    )
    if config is not None:
        raise ValueError(
            "config= was given for a peft model: its checkpoint holds adapter_config.json (the adapter's "
            "config, from the model), not a config.json; leave config unset"
        )
    return Layout(ADAPTER_FILE, weights, frozen, ADAPTER_CONFIG_FILE, adapter_config_text(model))


def _config_text(config: Any) -> str | None:
    if config is None:
        return None
    if hasattr(config, "to_json_string"):
        return config.to_json_string()
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, Mapping):
        return json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    raise TypeError(
        f"config of type {type(config).__name__} cannot be written as config.json: pass a dict, "
        "or an object with to_dict() or to_json_string() (e.g. a transformers PretrainedConfig)"
    )
