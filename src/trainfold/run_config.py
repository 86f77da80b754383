"""A run's config: a TOML, JSON or YAML file of ``[model]``, ``[data]`` and ``[args]``, and ``--set`` overrides.

>>> config = apply_overrides(parse_config('[args]\\nmax_steps = 3', "toml"), ["args.max_steps=10"])
>>> split_resume({**config, "resume_from_checkpoint": True})
({'args': {'max_steps': 10}}, True)
"""

from __future__ import annotations

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
    "apply_overrides",
    "load_config",
    "parse_config",
    "split_resume",
]

TABLES = ("model", "data", "args")
RESUME = "resume_from_checkpoint"  # a `train` parameter, not a TrainingArguments field


class ConfigError(ValueError):
    """A bad config or command line; the CLI prints it without a traceback and exits with status 2."""


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the tomli backport (a dependency there)
        import tomli as tomllib
    return tomllib


def parse_config(text: str, kind: str, source: str = "<config>") -> dict[str, Any]:
    """Parse a config's ``text`` as ``kind`` (``"toml"``, ``"json"`` or ``"yaml"``); errors name ``source``.

    >>> parse_config('{"args": {"max_steps": 3}}', "json")
    {'args': {'max_steps': 3}}
    >>> parse_config('[args]\\nmax_steps = 3', "toml") == parse_config('args:\\n  max_steps: 3', "yaml")
    True
    >>> parse_config('{"args": ', "json", "run.json")
    Traceback (most recent call last):
    ...
    trainfold.run_config.ConfigError: run.json is not valid JSON: Expecting value: line 1 column 10 (char 9)
    """
    try:
        if kind == "toml":
            config = _toml().loads(text)
        elif kind == "json":
            config = json.loads(text)
        elif kind == "yaml":
            try:
                import yaml
            except ModuleNotFoundError:
                raise ConfigError(
                    f"{source} is YAML, which needs pyyaml: pip install pyyaml (or write the config as .toml or .json)"
                ) from None
            config = yaml.safe_load(text)
        else:
            raise ConfigError(f"{source}: unknown config kind {kind!r}; use toml, json or yaml")
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"{source} is not valid {kind.upper()}: {err}") from None
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"{source}: a config is a table (mapping) of [model], [data] and [args]; got {type(config).__name__}"
        )
    return dict(config)


CONFIG_KINDS = {".toml": "toml", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a run config (TOML, JSON or YAML, by extension) and check its tables."""
    path = Path(path)
    kind = CONFIG_KINDS.get(path.suffix.lower())
    if kind is None:
        raise ConfigError(f"config {str(path)!r} has the extension {path.suffix!r}; use one of {sorted(CONFIG_KINDS)}")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    config = parse_config(path.read_text(), kind, str(path))
    problems = _table_problems(config)
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))
    return config


def _table_problems(config: Mapping[str, Any]) -> list[str]:
    out = []
    unknown = sorted(set(config) - {*TABLES, RESUME})
    if unknown:
        out.append(f"a config has the tables [model], [data] and [args] (and {RESUME}); unknown {unknown}")
    if "args" not in config:
        out.append("the [args] table is missing (it needs at least output_dir and max_steps or num_train_epochs)")
    out += [
        f"[{t}] must be a table, got {config[t]!r}"
        for t in TABLES
        if t in config and not isinstance(config[t], Mapping)
    ]
    return out


def _literal(text: str) -> Any:
    """Read a ``--set`` value: JSON, else a TOML literal, else the text itself.

    >>> [_literal(v) for v in ("10", "1e-3", "true", "null", '["jsonl"]', "{ a = 1 }", "runs/x", "'7'")]
    [10, 0.001, True, None, ['jsonl'], {'a': 1}, 'runs/x', '7']
    """
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return _toml().loads(f"v = {text}")["v"]
    except Exception:
        return text


def apply_overrides(config: Mapping[str, Any], assignments: list[str]) -> dict[str, Any]:
    """Return ``config`` with each ``key=value`` of ``assignments`` set (a new dict; dotted keys nest).

    >>> apply_overrides({"args": {"max_steps": 5}}, ["args.max_steps=10", "model.config.d_model=8"])
    {'args': {'max_steps': 10}, 'model': {'config': {'d_model': 8}}}
    >>> apply_overrides({}, ["max_steps=10"])
    Traceback (most recent call last):
    ...
    trainfold.run_config.ConfigError: --set max_steps=10: the key names its table: --set args.max_steps=...
    """
    out = json.loads(json.dumps(config))  # a deep copy of plain data
    problems = []
    for item in assignments:
        key, eq, text = item.partition("=")
        path = key.strip().split(".")
        if not eq or not all(path):
            problems.append(f"--set {item!r} must be key=value, e.g. --set args.max_steps=10")
            continue
        if path[0] not in (*TABLES, RESUME):
            import attrs

            from trainfold.hf.args import TrainingArguments

            known = [f.name for f in attrs.fields(TrainingArguments)]
            hint = (
                f"--set args.{key}=..."
                if key in known
                else f"one of {[*TABLES, RESUME]}"
                + (f" (did you mean args.{close[0]}?)" if (close := difflib.get_close_matches(key, known, n=1)) else "")
            )
            problems.append(f"--set {item}: the key names its table: {hint}")
            continue
        node = out
        for i, name in enumerate(path[:-1]):
            child = node.setdefault(name, {})
            if not isinstance(child, dict):
                problems.append(f"--set {item}: {'.'.join(path[: i + 1])} is {child!r}, not a table")
                break
            node = child
        else:
            node[path[-1]] = _literal(text.strip())
    if problems:
        raise ConfigError("\n".join(problems))
    return out


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
