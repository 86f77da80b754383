"""The ``transformers.Trainer`` methods a script calls after training, as functions of the run's values.

A migrated script keeps its last lines: ``trainer.save_model()`` becomes ``save_model(model, output_dir,
processing_class)``, ``trainer.log_metrics("train", metrics)`` becomes ``log_metrics("train", metrics)``, and so
on. Each writes or prints on the world's rank 0 only, as the Trainer's do, and does nothing elsewhere.

>>> format_metrics({"train_runtime": 75.5, "train_loss": 0.123456, "total_flos": 3 * 2**30, "epoch": 1})
{'train_runtime': '0:01:15.50', 'train_loss': 0.1235, 'total_flos': '3GF', 'epoch': 1}
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import safetensors.torch
import torch
from torch import nn

from trainfold.core.adapters import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    adapter_config_text,
    has_injected_adapter,
    injected_adapter_weights,
)
from trainfold.trainer.args import TrainingArguments

_F = attrs.fields(TrainingArguments)
_SAME_NAMED = (_F.max_steps, _F.num_train_epochs, _F.logging_steps, _F.eval_steps, _F.save_steps)

__all__ = [
    "is_world_process_zero",
    "format_metrics",
    "log_metrics",
    "save_metrics",
    "save_state",
    "save_model",
    "create_model_card",
]


def is_world_process_zero() -> bool:
    """Say whether this process is rank 0 of the world (the one that writes): always, in one process.

    >>> is_world_process_zero()
    True
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def _runtime(seconds: float) -> str:
    whole = datetime.timedelta(seconds=int(seconds))
    return f"{whole}.{int(round((seconds - int(seconds)) * 100)):02d}"


def format_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``metrics`` as people read them: runtimes as h:mm:ss.cc, memory in MB, flos in GF, floats to 4 places."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if "_mem_" in key:
            out[key] = f"{int(value) >> 20}MB"
        elif "_runtime" in key:
            out[key] = _runtime(float(value))
        elif key == "total_flos":
            out[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            out[key] = round(value, 4)
        else:
            out[key] = value
    return out


def log_metrics(split: str, metrics: Mapping[str, Any]) -> None:
    """Print ``metrics`` under a ``***** {split} metrics *****`` banner, keys aligned (``Trainer.log_metrics``).

    >>> log_metrics("eval", {"eval_loss": 0.5, "epoch": 2.0})
    ***** eval metrics *****
      epoch     = 2.0
      eval_loss = 0.5
    """
    if not is_world_process_zero():
        return
    shown = format_metrics(metrics)
    key_width = max((len(k) for k in shown), default=0)
    value_width = max((len(str(v)) for v in shown.values()), default=0)
    print(f"***** {split} metrics *****")
    for key in sorted(shown):
        print(f"  {key: <{key_width}} = {str(shown[key]):>{value_width}}")


def save_metrics(split: str, metrics: Mapping[str, Any], output_dir: str | os.PathLike, combined: bool = True) -> None:
    """Write ``metrics`` to ``output_dir/{split}_results.json`` and merge them into ``all_results.json``.

    >>> import json, pathlib, tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> save_metrics("train", {"train_loss": 1.5}, out); save_metrics("eval", {"eval_loss": 2.0}, out)
    >>> json.loads((out / "all_results.json").read_text())
    {'eval_loss': 2.0, 'train_loss': 1.5}
    """
    if not is_world_process_zero():
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{split}_results.json").write_text(json.dumps(dict(metrics), indent=4, sort_keys=True))
    if combined:
        path = out / "all_results.json"
        every = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**every, **metrics}, indent=4, sort_keys=True))


def save_state(result: Any, args: TrainingArguments) -> None:
    """Write ``args.output_dir/trainer_state.json``: the run's step, epoch, best checkpoint and log history.

    ``result`` is what ``train`` returned; the file has ``Trainer.save_state``'s main fields.
    """
    if not is_world_process_zero():
        return
    history = list(result.log_history)
    epochs = [e["epoch"] for e in history if "epoch" in e]
    best = result.best_checkpoint
    state = {
        "global_step": result.global_step,
        "epoch": epochs[-1] if epochs else None,
        **{f.name: getattr(args, f.name) for f in _SAME_NAMED},  # TrainerState keeps these under their own names
        "train_batch_size": args.per_device_train_batch_size,
        "best_model_checkpoint": None if best is None else str(best),
        "log_history": history,
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def save_model(model: nn.Module, output_dir: str | os.PathLike, processing_class: Any = None) -> None:
    """Save ``model``'s weights (and ``processing_class``'s files) to ``output_dir`` for ``from_pretrained``.

    After ``train`` the module holds the trained (or best) weights, so this is ``Trainer.save_model``: a
    transformers (or peft) model through its ``save_pretrained``, any other module's ``state_dict`` to
    ``model.safetensors``. Nothing is pickled (no ``training_args.bin``: ``args.to_dict()`` is JSON).
    The base module of a run with ``peft_config`` (TRL's ``--use_peft``: ``get_peft_model`` injected the
    adapter into it) saves what TRL's final ``save_model`` saves, ``PeftModel.save_pretrained``'s adapter
    files (``adapter_model.safetensors``, ``adapter_config.json``), which ``PeftModel.from_pretrained`` loads.

    >>> import pathlib, tempfile, torch
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> save_model(torch.nn.Linear(2, 1), out)
    >>> sorted(p.name for p in out.iterdir())
    ['model.safetensors']
    """
    if not is_world_process_zero():
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if has_injected_adapter(model):  # the base a PeftModel wraps (trainfold.sft.train(model, peft_config=...))
        _save_adapter(model, out)
    elif save_pretrained is not None:
        save_pretrained(out)
    else:
        safetensors.torch.save_model(model, str(out / "model.safetensors"))
    if processing_class is not None:
        processing_class.save_pretrained(out)


def _save_adapter(model: nn.Module, out: Path) -> None:
    weights = injected_adapter_weights(model)
    safetensors.torch.save_file(weights, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG_FILE).write_text(adapter_config_text(model))


def _listed(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _front_matter(language: Any, license: Any, tags: Any, finetuned_from: Any, datasets: list[str]) -> list[str]:
    """Return the card's YAML metadata lines (the Hub reads them), as ``Trainer.create_model_card`` writes them."""
    lines = ["---", "library_name: transformers"]
    if license:
        lines.append(f"license: {license}")
    if finetuned_from:
        lines.append(f"base_model: {finetuned_from}")
    for key, values in (
        ("language", _listed(language)),
        ("tags", ["trainfold", *_listed(tags)]),
        ("datasets", datasets),
    ):
        if values:
            lines += [f"{key}:", *(f"- {v}" for v in values)]
    return [*lines, "---", ""]


def create_model_card(
    output_dir: str | os.PathLike,
    args: TrainingArguments,
    result: Any = None,
    *,
    model_name: str | None = None,
    finetuned_from: str | None = None,
    dataset: str | list[str] | None = None,
    tags: str | list[str] | None = None,
    language: str | list[str] | None = None,
    license: str | None = None,
    tasks: str | list[str] | None = None,
    dataset_tags: str | list[str] | None = None,
    dataset_args: str | list[str] | None = None,
) -> Path | None:
    """Write ``output_dir/README.md``: the model's name, origin, data, the settings and the final metrics.

    A Markdown card with YAML metadata; takes ``Trainer.create_model_card``'s keywords (``language``,
    ``license``, ``tasks``, ``dataset_tags``, ``dataset_args`` too); returns its path on rank 0, ``None`` elsewhere.

    >>> import tempfile
    >>> from trainfold.trainer.args import TrainingArguments
    >>> path = create_model_card(tempfile.mkdtemp(), TrainingArguments(learning_rate=1e-3), model_name="tiny",
    ...                          tasks="text-classification", license="apache-2.0")
    >>> text = path.read_text()
    >>> text.splitlines()[:3], "# tiny" in text, "- learning_rate: 0.001" in text
    (['---', 'library_name: transformers', 'license: apache-2.0'], True, True)
    """
    if not is_world_process_zero():
        return None
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = _listed(dataset)
    lines = _front_matter(language, license, tags, finetuned_from, _listed(dataset_tags) or names)
    lines += [f"# {model_name or out.name}", ""]
    if finetuned_from or names:
        origin = f"fine-tuned from {finetuned_from}" if finetuned_from else "trained"
        data = " on " + ", ".join(
            f"{n} ({a})" if a else n for n, a in zip(names, _listed(dataset_args) + [""] * len(names))
        )
        lines += [f"This model was {origin}" + (data if names else "") + ".", ""]
    if tasks:
        lines += ["Tasks: " + ", ".join(_listed(tasks)), ""]
    lines += ["## Training settings", ""]
    lines += [f"- {k}: {v}" for k, v in sorted(args.to_dict().items()) if v not in (None, (), [], {})]
    if result is not None:
        lines += ["", "## Results", ""]
        lines += [f"- {k}: {v}" for k, v in sorted(format_metrics(result.metrics).items())]
    lines += ["", "Trained with trainfold."]
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
