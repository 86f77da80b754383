"""``from_hf``: a parsed ``transformers.TrainingArguments`` (or TRL config) as trainfold settings.

A migrating script hands over the object ``HfArgumentParser``/``TrlParser`` made, as is. Each of
its fields is one of:

* a trainfold setting of the same name: taken, with transformers' enums as their strings (what
  transformers' ``__post_init__`` filled in, e.g. ``eval_steps`` from ``logging_steps``, is what it runs);
* a field for the script, not the trainer (``resume_from_checkpoint``, ``do_train``,
  ``model_init_kwargs``, the masked ``hub_token`` ...): left to the script (``SCRIPT_FIELDS``);
* a default that acts (DPOConfig's ``disable_dropout=True``: ``ACTING_DEFAULTS``): refused unless turned off;
* any other field at its default (its dataclass default, or the value a default object of the
  same class holds after ``__post_init__``, e.g. ``accelerator_config``, ``ddp_timeout``,
  ``project``, every TRL setting left alone): it asks for nothing, and is ignored;
* any other field set to another value: refused by name with the reason and the fix, all at once.

>>> import transformers
>>> hf = transformers.TrainingArguments(output_dir="out", learning_rate=1e-3, eval_strategy="steps", eval_steps=5)
>>> taken = settings_from_hf(hf, known={"output_dir", "learning_rate", "eval_strategy", "eval_steps"})
>>> taken
{'output_dir': 'out', 'learning_rate': 0.001, 'eval_strategy': 'steps', 'eval_steps': 5}
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar, Protocol

from trainfold.step.fsdp import FSDP_CONFIG_PASSIVE
from trainfold.trainer.args_hf import HF_ONLY, hf_only_problem

__all__ = [
    "PeerArguments",
    "SCRIPT_FIELDS",
    "ACTING_DEFAULTS",
    "settings_from_hf",
    "plain",
    "built_aside",
    "turned_off",
]


class PeerArguments(Protocol):
    """A parsed ``transformers.TrainingArguments`` or TRL config (``trl.SFTConfig``, ``trl.DPOConfig``...), as
    ``from_hf`` reads it: a dataclass whose every field is read by name (``__dataclass_fields__``), and whose
    ``output_dir``, ``use_cpu`` and ``fsdp`` build a default object of its class to compare with. Every
    transformers/TRL arguments object is one; a dict is not (``from_dict``).
    """

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def output_dir(self) -> str | None: ...
    @property
    def use_cpu(self) -> bool: ...
    @property
    def fsdp(self) -> bool | str | list[Any] | None: ...

    def to_dict(self) -> dict[str, Any]: ...


# fields a script reads itself (or that only say how to load the model or the data); the trainer never acts on them
SCRIPT_FIELDS: dict[str, str] = {
    "resume_from_checkpoint": "pass it to train(..., resume_from_checkpoint=training_args.resume_from_checkpoint)",
    "do_train": "the script decides whether to call train",
    "do_eval": "the script decides whether to call evaluate",
    "do_predict": "the script decides whether to call predict",
    "hub_token": "trainfold never uploads",
    "local_rank": "torchrun sets LOCAL_RANK, which train reads",
    "model_init_kwargs": "load the model yourself: from_pretrained(name, **training_args.model_init_kwargs)",
    "trust_remote_code": "pass it to from_pretrained yourself",
}


# TRL fields whose *default* acts on the run: field -> (the value that does nothing, why the other one is refused)
ACTING_DEFAULTS: dict[str, tuple[Any, str]] = {
    "disable_dropout": (
        False,
        "TRL sets every dropout probability of the model to 0; trainfold trains the model as given: build it "
        "without dropout (e.g. from_pretrained(name, attention_dropout=0.0)) and set disable_dropout=False",
    ),
}


def turned_off(name: str, value: Any) -> bool:
    """Say whether ``name=value`` turns off a TRL default that acts (``disable_dropout=False``): nothing to set.

    >>> turned_off("disable_dropout", False), turned_off("disable_dropout", True), turned_off("beta", 0.1)
    (True, False, False)
    """
    return name in ACTING_DEFAULTS and value == ACTING_DEFAULTS[name][0]


def plain(value: Any) -> Any:
    """Return ``value`` with enums as their values, lists (of enums) as lists of values; JSON strings of dicts parsed.

    >>> from transformers.trainer_utils import IntervalStrategy
    >>> plain(IntervalStrategy.STEPS), plain([IntervalStrategy.NO])
    ('steps', ['no'])
    """
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def built_aside(cls: Any, **kwargs: Any) -> Any:
    """Return ``cls(**kwargs)`` (a transformers or TRL arguments class), leaving accelerate's state as it was.

    transformers' ``TrainingArguments.__post_init__`` clears accelerate's shared ``AcceleratorState``
    and ``PartialState``: a ``Trainer`` of the same process would fail at its next ``train``/``evaluate``
    (``'AcceleratorState' object has no attribute 'distributed_type'``). Their contents are restored.
    """
    try:
        from accelerate.state import AcceleratorState, PartialState
    except ImportError:  # no accelerate: nothing to keep
        return cls(**kwargs)
    kept = [(shared, dict(shared)) for shared in (AcceleratorState._shared_state, PartialState._shared_state)]
    try:
        return cls(**kwargs)
    finally:
        for shared, before in kept:
            if before:  # an initialised state: back as it was (an empty one may keep what was built)
                shared.clear()
                shared.update(before)


def _defaults(config: PeerArguments) -> dict[str, Any]:
    """Return each field's dataclass default, and what a default object of the class holds after ``__post_init__``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = [plain(f.default)]
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = [plain(f.default_factory())]
        else:
            out[f.name] = []
    try:  # the values transformers' __post_init__ fills in (accelerator_config, report_to, fsdp_config ...)
        fresh = built_aside(type(config), output_dir=config.output_dir, use_cpu=config.use_cpu, fsdp=config.fsdp)
    except Exception:  # a config class that cannot be built this way: the dataclass defaults alone
        return out
    for f in dataclasses.fields(config):
        out.setdefault(f.name, []).append(plain(getattr(fresh, f.name, None)))
    return out


def _source(config: PeerArguments) -> str:
    return f"{type(config).__module__.split('.')[0]}.{type(config).__name__}"


def _fsdp_config(value: Any) -> Any:
    """Return an ``fsdp_config`` without what transformers fills in by itself (None when nothing is left)."""
    if not isinstance(value, Mapping):
        return value
    left = {k: v for k, v in value.items() if FSDP_CONFIG_PASSIVE.get(k, object()) != v}
    return left or None


def _fsdp(value: Any, config: PeerArguments) -> Any:
    """Return transformers 5's ``fsdp=True`` (its strings turn into it) as trainfold's ``fsdp``."""
    if value is True:
        return "full_shard"  # reshard_after_forward travels in fsdp_config (trainfold.step.fsdp)
    return None if value is False else value


def _taken(name: str, value: Any, default: Any) -> tuple[bool, Any]:
    """Return ``(keep?, value)`` for a field trainfold has under the same name."""
    if name == "report_to" and value == []:  # transformers' "none", after __post_init__
        return True, "none"
    if name == "lr_scheduler_kwargs" and isinstance(value, str):
        return True, json.loads(value) if value.strip() else None
    if value is None and default is not None:  # e.g. label_names=None: the model's own (trainfold: "labels")
        return False, None
    return True, value


def settings_from_hf(
    config: PeerArguments,
    *,
    known: Collection[str],
    defaults: Mapping[str, Any] | None = None,
    checked: Mapping[str, Callable[[Any], str | None]] | None = None,
    overridden: Collection[str] = (),
) -> dict[str, Any]:
    """Return the settings of ``config`` (a transformers/TRL dataclass) that a class with fields ``known`` takes.

    ``defaults``: that class's own defaults (a ``None`` in ``config`` over a non-None default is left
    out). ``checked``: the class's own judges of fields it does not have (``GRPOArguments``' ``TRL_ONLY``):
    each returns why a value is refused, or ``None`` for a value that asks for nothing. ``overridden``: the
    fields the caller sets itself (``from_hf``'s keywords), neither read nor judged. Raises ``TypeError``
    naming every field that cannot be honoured.
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(
            f"from_hf takes a parsed transformers.TrainingArguments or TRL config object, got "
            f"{type(config).__name__}; for a dict use from_dict"
        )
    reference, source, defaults = _defaults(config), _source(config), defaults or {}
    settings: dict[str, Any] = {}
    refused: list[str] = []
    for f in dataclasses.fields(config):
        name, value = f.name, plain(getattr(config, f.name, None))
        if name in SCRIPT_FIELDS or name in overridden:
            continue
        if name in known:
            value = _fsdp(value, config) if name == "fsdp" else _fsdp_config(value) if name == "fsdp_config" else value
            keep, value = _taken(name, value, defaults.get(name))
            if keep:
                settings[name] = value
            continue
        if name in ACTING_DEFAULTS and name not in (checked or {}):
            passive, why = ACTING_DEFAULTS[name]
            if value != passive:
                refused.append(f"{name}={value!r} (a {source} default that acts) is not taken: {why}")
            continue
        if any(value == d for d in reference.get(name, [])):
            continue  # at its default: asks for nothing
        problem = checked[name](value) if checked is not None and name in checked else _refusal(name, value, source)
        if problem is not None:
            refused.append(problem)
    if refused:
        raise TypeError(f"{source} settings that trainfold cannot honour:\n  - " + "\n  - ".join(refused))
    return settings


def _refusal(name: str, value: Any, source: str) -> str:
    """Say why trainfold refuses ``name=value`` of ``source``: HF's own reason, or that no trainfold setting has it."""
    if name in HF_ONLY:
        problem = hf_only_problem(name, value)
        if problem is not None:
            return problem.replace("a transformers.TrainingArguments setting", f"a {source} setting", 1)
    return (
        f"{name}={value!r} is a {source} setting that trainfold does not take (no trainfold setting does what "
        "it does); leave it at its default, or do it in your script (tokenization, model loading) before train"
    )
