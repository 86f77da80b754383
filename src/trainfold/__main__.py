"""Command line: ``python -m trainfold demo`` and ``python -m trainfold train --config run.toml``.

A config is TOML with three tables::

    [model]                 # "tinylm" (this project's byte-level GPT) or "hf" (a transformers config)
    type = "tinylm"
    config = { d_model = 96, n_layers = 3 }      # or, for "hf", a path to config.json

    [data]                  # "stdlib" (Python's own source), a .txt file (bytes) or a .jsonl of rows
    train = "stdlib"
    seq_len = 128
    eval_fraction = 0.03

    [args]                  # trainfold.TrainingArguments, HF names
    output_dir = "runs/cli"
    max_steps = 100

A preempted run (SIGTERM with ``enable_jit_checkpoint = true``) exits with status 143, Ctrl-C (SIGINT) with 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainfold.preempt import exit_on_signals, exit_status

__all__ = ["main", "load_config", "build_model", "build_data"]


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a TOML run config and check its tables."""
    try:
        import tomllib  # noqa: PLC0415
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]  # noqa: PLC0415
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    config = tomllib.loads(path.read_text())
    unknown = sorted(set(config) - {"model", "data", "args"})
    if unknown or "args" not in config:
        raise ValueError(f"{path}: a config has the tables [model], [data] and [args]; got {sorted(config)}")
    return config


def build_model(spec: dict[str, Any]) -> Any:
    """Build a model with random weights from the ``[model]`` table."""
    kind = spec.get("type", "tinylm")
    if kind == "tinylm":
        from trainfold.models import TinyLM, TinyLMConfig  # noqa: PLC0415

        return TinyLM(TinyLMConfig(**spec.get("config", {})))
    if kind == "hf":
        import transformers  # noqa: PLC0415

        source = spec.get("config")
        settings = json.loads(Path(source).read_text()) if isinstance(source, str) else dict(source or {})
        config = transformers.AutoConfig.for_model(**settings)
        return transformers.AutoModelForCausalLM.from_config(config)
    raise ValueError(f"[model] type {kind!r} is not 'tinylm' or 'hf'")


def build_data(spec: dict[str, Any]) -> tuple[list[dict[str, list[int]]], list[dict[str, list[int]]]]:
    """Return ``(train_rows, eval_rows)`` from the ``[data]`` table."""
    from trainfold.demo import byte_chunks, stdlib_text  # noqa: PLC0415

    source, seq_len = spec.get("train", "stdlib"), int(spec.get("seq_len", 128))
    if source == "stdlib":
        rows = byte_chunks(stdlib_text(int(spec.get("max_bytes", 1_500_000))), seq_len)
    elif str(source).endswith(".jsonl"):
        rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    else:
        rows = byte_chunks(Path(source).read_text(encoding="utf-8", errors="replace"), seq_len)
    cut = len(rows) - max(1, int(len(rows) * float(spec.get("eval_fraction", 0.03))))
    return rows[:cut], rows[cut:]


def _train(config_path: str) -> int:
    from trainfold.args import TrainingArguments  # noqa: PLC0415
    from trainfold.determinism import warm_up_kernels  # noqa: PLC0415
    from trainfold.distributed import collective_from_env  # noqa: PLC0415
    from trainfold.train import train  # noqa: PLC0415

    config = load_config(config_path)
    args = TrainingArguments.from_dict(config["args"])
    import torch  # noqa: PLC0415

    warm_up_kernels()  # before the model's random init too (see trainfold.determinism)
    torch.manual_seed(args.seed)
    model = build_model(config.get("model", {}))
    train_rows, eval_rows = build_data(config.get("data", {}))
    with collective_from_env() as collective:
        result = train(model, args, train_rows, eval_rows if args.eval_strategy != "no" else None, collective=collective)
    print(json.dumps({"status": result.status, "global_step": result.global_step,
                      "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
                      **{k: v for k, v in result.metrics.items() if isinstance(v, (int, float))}}))
    return exit_status(result.status, result.signal)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    exit_on_signals()  # a SIGTERM during imports and setup ends with 143 (cleanups run); train then catches it
    parser = argparse.ArgumentParser(prog="trainfold", description="Train PyTorch models as a fold of a pure step.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small LM on Python's own source (no downloads)")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("--max-steps", type=int, default=800)
    run = sub.add_parser("train", help="train from a TOML config")
    run.add_argument("--config", required=True, help="path to a TOML file with [model], [data], [args]")
    ns = parser.parse_args(argv)
    if ns.command == "demo":
        from trainfold.demo import run_demo  # noqa: PLC0415

        result = run_demo(ns.output_dir, ns.max_steps)
        return exit_status(result.status, result.signal)
    return _train(ns.config)


if __name__ == "__main__":
    sys.exit(main())
