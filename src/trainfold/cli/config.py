"""A run's config, read by jsonargparse: the ``[model]``, ``[data]`` and ``[args]`` tables and their overrides.

``train_parser`` declares the tables as typed arguments: ``[model]`` and ``[data]`` are the dataclasses
``ModelTable`` and ``DataTable``, ``[args]`` a table of ``trainfold.TrainingArguments`` settings under their
Hugging Face names (checked all at once, with "did you mean", by ``TrainingArguments.from_dict``).
jsonargparse reads the file (``--config``: TOML, JSON or YAML by its extension), applies dotted overrides
(``--args.max_steps=10``; ``--set args.max_steps=10`` is the same), and prints the merged config
(``--print_config``).

>>> read_config(["--args.max_steps=3", "--set", "model.config.d_model=8"])["args"]
{'max_steps': 3}
>>> read_config(["--set", "max_steps=3"])
Traceback (most recent call last):
...
trainfold.cli.config.ConfigError: --set max_steps=3: the key names its table: --set args.max_steps=...
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_KINDS",
    "RESUME",
    "TABLES",
    "ConfigError",
    "DataTable",
    "ModelTable",
    "read_config",
    "recorded",
    "set_items",
    "split_resume",
    "train_parser",
]

TABLES = ("model", "data", "args")
RESUME = "resume_from_checkpoint"  # a `train` parameter, not a TrainingArguments field
CONFIG_KINDS = {".toml": "toml", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}
_MODE = "trainfold"  # jsonargparse's parser mode whose loader reads a file by its extension (``load_text``)


class ConfigError(ValueError):
    """A bad config or command line; the CLI prints it without a traceback and exits with status 2."""


@dataclasses.dataclass
class ModelTable:
    """The ``[model]`` table: random weights from a config, or pretrained ones by name or path.

    Args:
        type: "tinylm" (trainfold.core.models.TinyLM), "hf" (a transformers config, random weights) or
            "pretrained" (implied by name_or_path).
        config: TinyLMConfig's fields (tinylm), or a transformers config.json path or table (hf).
        name_or_path: a model name or a save_pretrained directory (pretrained).
    """

    type: str | None = None
    config: dict[str, Any] | str | None = None
    name_or_path: str | None = None


@dataclasses.dataclass
class DataTable:
    """The ``[data]`` table: where the rows come from and how text is cut.

    Args:
        train: "stdlib" (Python's own source), a local .json/.jsonl/.csv/.parquet/.txt file read by datasets,
            or a glob of Parquet/Arrow/JSON Lines shards ("data/*.parquet") streamed by trainfold.data.files
            (needs args.max_steps; no eval split; resumes exactly at any world size).
        seq_len: tokens per row when text is cut (128 unless set; rows with input_ids keep their lengths).
        max_bytes: how much of the stdlib source to read.
        eval_fraction: the held-out tail for evaluation.
        seed: the streamed shards' order (a glob only; 0 unless set).
        shuffle_window: rows shuffled together in a streamed glob (1024 unless set).
    """

    train: str = "stdlib"
    seq_len: int | None = None
    max_bytes: int = 1_500_000
    eval_fraction: float = 0.03
    seed: int | None = None
    shuffle_window: int | None = None


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the tomli backport (a dependency there)
        import tomli as tomllib
    return tomllib


def load_text(text: str, path: str = "") -> Any:
    """jsonargparse's loader for this CLI: a config file by its extension (TOML; JSON and YAML as YAML), and a
    value given on the command line as a JSON or TOML literal, else the text itself.

    A value is not read as YAML: YAML 1.1 reads ``no``, ``off`` and ``y`` as booleans, so ``save_strategy=no``
    would arrive as ``False``.

    >>> load_text('[args]\\nmax_steps = 3', "run.toml") == load_text('args: {max_steps: 3}', "run.yaml")
    True
    >>> [load_text(v) for v in ("10", "1e-3", "true", "null", '["jsonl"]', "{ a = 1 }", "runs/x", "'7'", "no")]
    [10, 0.001, True, None, ['jsonl'], {'a': 1}, 'runs/x', '7', 'no']
    """
    if path:
        return _file_text(text, str(path))
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return _toml().loads(f"v = {text}")["v"]
    except Exception:
        return text


def _file_text(text: str, path: str) -> Any:
    kind = CONFIG_KINDS.get(Path(path).suffix.lower())
    if kind is None:
        raise ValueError(f"config {path!r} has the extension {Path(path).suffix!r}; use one of {sorted(CONFIG_KINDS)}")
    try:
        if kind == "toml":
            return _toml().loads(text)
        if kind == "json":
            return json.loads(text)
        import jsonargparse

        return jsonargparse.get_loader("yaml")(text)  # jsonargparse's YAML reader (1e-3 is a float there)
    except Exception as err:
        raise ValueError(f"{path} is not valid {kind.upper()}: {err}") from None


def train_parser(**kwargs: Any) -> Any:
    """The ``train`` command's jsonargparse parser: ``--config``, the three tables, ``--resume``, ``--set``."""
    import jsonargparse
    import yaml

    jsonargparse.set_loader(_MODE, load_text, exceptions=(ValueError, yaml.YAMLError))
    parser = jsonargparse.ArgumentParser(exit_on_error=False, parser_mode=_MODE, **kwargs)
    parser.add_argument("--config", action=jsonargparse.ActionConfigFile, help="a .toml, .json or .yaml run config")
    parser.add_argument("--model", type=ModelTable, default=ModelTable(), help="the [model] table")
    parser.add_argument("--data", type=DataTable, default=DataTable(), help="the [data] table")
    parser.add_argument(
        "--args", type=dict[str, Any], required=True, help="the [args] table: trainfold.TrainingArguments, HF names"
    )
    parser.add_argument(f"--{RESUME}", type=bool | str | None, default=None, help="true, or a checkpoint path")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CHECKPOINT",
        help="continue from the latest complete checkpoint in output_dir (a fresh start when there "
        "is none yet), or from CHECKPOINT",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. args.max_steps=10 (repeatable; the same as --args.max_steps=10)",
    )
    return parser


def set_items(argv: list[str]) -> list[str]:
    """Spell each ``--set key=value`` as jsonargparse's ``--key=value``, after everything else (the last wins).

    >>> set_items(["--config", "run.toml", "--set", "args.max_steps=10", "--resume"])
    ['--config', 'run.toml', '--resume', '--args.max_steps=10']
    """
    rest, overrides, problems = [], [], []
    items = iter(argv)
    for item in items:
        if item != "--set" and not item.startswith("--set="):
            rest.append(item)
            continue
        assignment = item.partition("=")[2] if item.startswith("--set=") else next(items, "")
        key, eq, _ = assignment.partition("=")
        if not eq or not all(key.strip().split(".")):
            problems.append(f"--set {assignment!r} must be key=value, e.g. --set args.max_steps=10")
        elif key.split(".")[0] not in (*TABLES, RESUME):
            problems.append(f"--set {assignment}: the key names its table: {_table_hint(key)}")
        else:
            overrides.append(f"--{assignment}")
    if problems:
        raise ConfigError("\n".join(problems))
    return rest + overrides


def _table_hint(key: str) -> str:
    import attrs

    from trainfold.trainer.args import TrainingArguments

    known = [f.name for f in attrs.fields(TrainingArguments)]
    if key in known:
        return f"--set args.{key}=..."
    close = difflib.get_close_matches(key, known, n=1)
    return f"one of {[*TABLES, RESUME]}" + (f" (did you mean args.{close[0]}?)" if close else "")


def read_config(argv: list[str], parser: Any = None) -> dict[str, Any]:
    """Parse the ``train`` command line (``--config``, overrides, ``--resume``) into plain tables.

    Returns ``{"model": ..., "data": ..., "args": ..., "resume_from_checkpoint": ..., "resume": ...}``,
    with the unset ``[model]`` and ``[data]`` keys left out. A bad file or value is a ``ConfigError``.
    """
    import jsonargparse

    parser = parser or train_parser(prog="trainfold train")
    try:
        ns = parser.parse_args(set_items(argv))
    except jsonargparse.ArgumentError as err:
        raise ConfigError(str(err).strip()) from None
    plain = ns.as_dict()
    tables = {t: {k: v for k, v in plain[t].items() if v is not None} for t in ("model", "data")}
    return {**tables, "args": dict(plain["args"]), RESUME: plain[RESUME], "resume": plain["resume"]}


def split_resume(config: Mapping[str, Any]) -> tuple[dict[str, Any], bool | str | None]:
    """Take ``resume_from_checkpoint`` out of a config (top level or ``[args]``); return (config, value).

    >>> split_resume({"args": {"max_steps": 3, "resume_from_checkpoint": True}})
    ({'args': {'max_steps': 3}}, True)
    >>> split_resume({"resume_from_checkpoint": "runs/x/checkpoint-4", "args": {}})[1]
    'runs/x/checkpoint-4'
    """
    config = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    top = config.pop(RESUME, None)
    inner = config.get("args", {}).pop(RESUME, None) if isinstance(config.get("args"), dict) else None
    if top is not None and inner is not None and top != inner:
        raise ConfigError(f"{RESUME} is set twice, to {top!r} (top level) and {inner!r} ([args]); keep one")
    value = top if top is not None else inner
    if not (value is None or isinstance(value, (bool, str))):
        raise ConfigError(f"{RESUME}={value!r} must be true, false or a checkpoint path")
    return config, value


def recorded(config: Mapping[str, Any]) -> str:
    """The config as the run used it (JSON of its tables), which ``trainfold replay`` reads back."""
    return json.dumps({t: config[t] for t in TABLES}, indent=2, sort_keys=True, default=str)
