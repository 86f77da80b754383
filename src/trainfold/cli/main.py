"""Command line: ``python -m trainfold.cli demo``, ``python -m trainfold.cli train --config run.toml`` and
``python -m trainfold.cli replay OUTPUT_DIR --step K`` (``trainfold.trainer.replay``), parsed by jsonargparse.

A config (TOML, JSON or YAML, by the file's extension) has three tables, and optionally
``resume_from_checkpoint`` at the top level or in ``[args]``::

    [model]                 # "tinylm" (this project's byte-level GPT), "hf" (a transformers config)
    type = "tinylm"         # or "pretrained": name_or_path = "gpt2" or a save_pretrained directory
    config = { d_model = 96, n_layers = 3 }      # or, for "hf", a path to config.json (or a table)

    [data]                  # "stdlib" (Python's own source), or a local .json/.jsonl/.csv/.parquet/.txt
    train = "stdlib"        # file read by ``datasets``: rows with input_ids, or text (tokenized, cut)
    seq_len = 128
    eval_fraction = 0.03

    [args]                  # trainfold.TrainingArguments, HF names
    output_dir = "runs/cli"
    max_steps = 100

The tables are typed arguments (``trainfold.cli.config.train_parser``): ``--args.max_steps=10`` or
``--set args.max_steps=10`` overrides one value (a dotted path; the value is read as YAML/JSON against
the declared type), ``--print_config`` prints the merged config. ``--resume`` continues from the latest
complete checkpoint in ``output_dir`` (and starts at step 0 when there is none yet); ``--resume PATH``
from that one. Exit status: 0 when the run ends, 2 for a bad command line or config (the problems are
printed without a traceback), 3 when it diverged (params inf/NaN), 143 when preempted (SIGTERM with
``enable_jit_checkpoint = true``), 130 for Ctrl-C (SIGINT) in such a run.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

from trainfold.cli.build import build_data, build_model, length_problems, tokenizer_of
from trainfold.cli.config import ConfigError, read_config, recorded, split_resume, train_parser

__all__ = [
    "main",
    "command",
    "read_config",
    "split_resume",
    "build_model",
    "build_data",
    "ConfigError",
    "EXIT_USAGE",
]

EXIT_USAGE = 2  # argparse's status for a bad command line; also a bad config

_HELP = """\
The config is a TOML, JSON or YAML file, by its extension (.toml, .json, .yaml/.yml), with three tables:

  [model]  type = "tinylm" (trainfold.core.models.TinyLM; config = its TinyLMConfig fields),
           "hf" (config = a path to a transformers config.json, or a table of it: random weights),
           or "pretrained" (name_or_path = a model name or a save_pretrained directory: its weights)
  [data]   train = "stdlib" (Python's own source), or a local file that `datasets` reads by its
           extension (.json, .jsonl, .csv, .parquet, .txt): rows with input_ids (and labels) are
           taken as they are; a text column (a .txt file is one text) is tokenized (the pretrained
           model's tokenizer; bytes for tinylm) and cut into rows of seq_len tokens;
           seq_len, max_bytes (stdlib), eval_fraction (the held-out tail)
  [args]   trainfold.TrainingArguments under their Hugging Face names
  resume_from_checkpoint (top level or in [args]): true (latest checkpoint), or a checkpoint path

Example (run.toml):

  [model]
  type = "tinylm"
  config = { d_model = 96, n_layers = 3 }
  [data]
  train = "stdlib"
  seq_len = 128
  [args]
  output_dir = "runs/cli"
  max_steps = 200
  logging_steps = 10
  enable_jit_checkpoint = true

The same as JSON: {"model": {"type": "tinylm", "config": {"d_model": 96, "n_layers": 3}},
                   "data": {"train": "stdlib", "seq_len": 128},
                   "args": {"output_dir": "runs/cli", "max_steps": 200}}

  python -m trainfold.cli train --config run.toml --set args.max_steps=10 --set args.report_to='["jsonl"]'
  python -m trainfold.cli train --config run.toml --args.max_steps=10 --model.config.d_model=64
  python -m trainfold.cli train --config run.toml --print_config     # the merged config, as YAML
  python -m trainfold.cli train --config run.toml --resume   # after exit 143: continue where it stopped

Fine-tuning a pretrained model on a CSV file with a text column:

  [model]
  name_or_path = "path/to/model"     # type = "pretrained" is implied
  [data]
  train = "data/train.csv"
  seq_len = 256
  [args]
  output_dir = "runs/ft"
  num_train_epochs = 1

Output: one JSON line (status, global_step, last_checkpoint, the run's metrics) on stdout, from rank 0
only under torchrun. Exit status: 0 done, 2 bad command line or config (printed without a traceback;
the [args] problems all at once; a malformed .jsonl line is named by file and line), 3 diverged,
143 preempted (SIGTERM with enable_jit_checkpoint; rerun with --resume), 130 interrupted (SIGINT).
"""


def _resume_source(value: bool | str | None, output_dir: str) -> bool | str | None:
    """What ``train`` gets: True only when ``output_dir`` holds a checkpoint (else a fresh start), or a checked path."""
    from trainfold import ckpt

    if value is None or value is False:
        return None
    if value is True:
        if ckpt.latest_checkpoint(output_dir) is None:
            print(f"trainfold train: no complete checkpoint in {output_dir} yet; starting at step 0", file=sys.stderr)
            return None
        return True
    try:
        ckpt.resume_checkpoint(value, output_dir)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--resume {value}: {err}") from None
    return value


def _prepare(config: dict[str, Any], resume_flag: bool | str | None) -> tuple[Any, Any, Any, bool | str | None]:
    """Build (args, model, data, resume) from the parsed tables, collecting every problem into one ConfigError."""
    from trainfold.trainer.args import TrainingArguments

    config, resume = split_resume(config)
    problems, args, model, data = [], None, None, None
    try:
        args = TrainingArguments.from_dict(config["args"])
    except (TypeError, ValueError) as err:
        problems.append(f"[args]: {err}")
    import torch

    from trainfold.core.determinism import warm_up_kernels

    warm_up_kernels()  # before the model's random init too (see trainfold.core.determinism)
    torch.manual_seed(args.seed if args is not None else 0)
    model_spec, data_spec = dict(config.get("model", {})), dict(config.get("data", {}))
    try:
        model = build_model(model_spec)
    except (TypeError, ValueError, OSError) as err:
        problems.append(f"[model]: {err}")
    try:
        data = build_data(data_spec, tokenizer_of(model_spec))
    except Exception as err:  # any failure to read the user's data is a configuration error: named, exit 2
        problems.append(f"[data]: {err}" if isinstance(err, (ValueError, OSError)) else f"[data]: {err!r}")
    problems += length_problems(model, data_spec)
    if problems or args is None:
        raise ConfigError("\n".join(problems))
    return args, model, data, _resume_source(resume_flag if resume_flag is not None else resume, args.output_dir)


def _train(argv: list[str]) -> int:
    from trainfold.core.preempt import ignore_signals_until_exit
    from trainfold.distributed.distributed import collective_from_env
    from trainfold.trainer.train import train

    try:
        config = read_config(argv, _train_parser())
        resume_flag = config.pop("resume")
        args, model, (train_rows, eval_rows), resume = _prepare(config, resume_flag)
        keeping_ignored = _keeping_ignored(args.enable_jit_checkpoint)
    except ConfigError as err:
        print(f"trainfold train: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    _record_config(config, args.output_dir)  # what `trainfold replay` rebuilds the model and data from
    with collective_from_env() as collective:
        with keeping_ignored:
            result = train(
                model,
                args,
                train_rows,
                eval_rows if args.eval_strategy != "no" else None,
                collective=collective,
                resume_from_checkpoint=resume,
            )
        ignore_signals_until_exit()  # the run is over: a signal in the teardown must not turn its status into -15
    if collective is not None and collective.rank != 0:
        return _exit_status(result)  # one result line per run: rank 0's
    print(
        json.dumps(
            {
                "status": result.status,
                "global_step": result.global_step,
                "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
                **{k: v for k, v in result.metrics.items() if isinstance(v, (int, float))},
            }
        )
    )
    return _exit_status(result)


def _keeping_ignored(jit: bool) -> Any:
    """Enter around ``train``: with ``enable_jit_checkpoint``, a guard for the signals this command catches, so
    ``train``'s own guard (nested in it) leaves a signal the process inherited as ignored (``nohup ... &``) ignored."""
    import contextlib

    from trainfold.core.preempt import JIT_SIGNALS, preemption_guard

    caught = [s for s in JIT_SIGNALS if signal.getsignal(s) != signal.SIG_IGN]
    if not jit or len(caught) == len(JIT_SIGNALS):
        return contextlib.nullcontext()
    if not caught:
        raise ConfigError(
            "enable_jit_checkpoint = true, but this process ignores both SIGTERM and SIGINT (it inherited them as "
            "ignored), so nothing can preempt the run; set enable_jit_checkpoint = false, or start the command "
            "without ignoring SIGTERM"
        )
    return preemption_guard(caught)


def _exit_status(result: Any) -> int:
    """Return the process's exit status for a run's result: 3 diverged, 130/143 preempted by SIGINT/SIGTERM, else 0."""
    from trainfold.core.preempt import exit_status
    from trainfold.observe.divergence import DIVERGED, EXIT_DIVERGED

    return EXIT_DIVERGED if result.status == DIVERGED else exit_status(result.status, result.signal)


def _formatter() -> Any:
    import argparse

    import jsonargparse

    class Help(jsonargparse.DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """jsonargparse's help, with the description's example kept as written."""

    return Help


def _train_parser() -> Any:
    return train_parser(
        prog="trainfold train",
        description="Train from a config (TOML, JSON or YAML).\n\n" + _HELP,
        formatter_class=_formatter(),
    )


# -- replay: recompute a step of a CLI run and print its rows ------------------------------------------

RUN_CONFIG = "trainfold-config.json"  # the config `train` ran with (after --set), in its output_dir


def _record_config(config: dict[str, Any], output_dir: str) -> None:
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / RUN_CONFIG).write_text(recorded(config))


def _replay(output_dir: str, step: int, config_path: str | None) -> int:
    """Recompute step ``step`` of the run in ``output_dir`` (``trainfold.trainer.replay``); print its loss and rows."""
    from trainfold.trainer.replay import replay

    source = Path(config_path) if config_path else Path(output_dir) / RUN_CONFIG
    try:
        if not source.is_file():
            raise ConfigError(f"{source} does not exist: pass --config (the config the run was trained with)")
        config = read_config(["--config", str(source), f"--args.output_dir={output_dir}"])
        config.pop("resume")
        _, model, (train_rows, _), _ = _prepare(config, None)  # the model as the run built it (same seed)
        again = replay(output_dir, step, model=model, train_dataset=train_rows)
    except (ConfigError, ValueError, OSError) as err:
        print(f"trainfold replay: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    shown = {"step": again.step, "loss": again.loss, "logged_loss": again.logged_loss}
    print(json.dumps({**shown, "start": str(again.start) if again.start else None, "rows": again.rows}))
    return 0


def _parser() -> Any:
    """The command line: ``demo``, ``train`` (its own parser, run on the rest of the line) and ``replay``."""
    import jsonargparse

    parser = jsonargparse.ArgumentParser(
        prog="trainfold", description="Train PyTorch models as a fold of a pure step.", exit_on_error=False
    )
    commands = parser.add_subcommands(dest="command")
    demo = jsonargparse.ArgumentParser(description="Train a small LM on Python's own source (no downloads).")
    demo.add_argument("--output_dir", "--output-dir", default="runs/demo")
    demo.add_argument("--max_steps", "--max-steps", type=int, default=800)
    commands.add_subcommand("demo", demo, help="train a small LM on Python's own source (no downloads)")
    commands.add_subcommand("train", _train_parser(), help="train from a config (TOML, JSON or YAML)")
    again = jsonargparse.ArgumentParser(
        description="Recompute step K (the update that made state K) of the run in OUTPUT_DIR from the newest "
        "checkpoint before it; print its loss, the logged loss and the dataset rows of each micro-batch as JSON."
    )
    again.add_argument("output_dir", metavar="OUTPUT_DIR")
    again.add_argument("--step", type=int, required=True, metavar="K")
    again.add_argument("--config", help=f"the run's config (default: OUTPUT_DIR/{RUN_CONFIG}, which train writes)")
    commands.add_subcommand(
        "replay", again, help="recompute one step of a run from its nearest checkpoint and print the rows that made it"
    )
    return parser


def _leave(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _exit_on_signals() -> dict[int, Any]:
    """Make SIGTERM/SIGINT end the command with 143/130 (``finally`` blocks run: nothing is left half-written);
    return the handlers they replace.

    The command's module imports nothing heavy at its top, so this is in place within milliseconds of the
    start: a signal during the imports (a few seconds with torch), the setup or after the run (its
    teardown) ends the job the way a scheduler expects, never by the bare signal (-15); ``train``'s own
    guard takes the signals over while it runs. A signal the process inherited as ignored (SIGINT under
    ``nohup ... &``) keeps no handler: it stays ignored, through ``train`` too (``_keeping_ignored``).
    ``trainfold.core.preempt.exit_on_signals`` is the same for a script that has imported the layers already.
    """
    caught = [s for s in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(s) != signal.SIG_IGN]
    return {s: signal.signal(s, _leave) for s in caught}


def command() -> int:
    """The ``trainfold`` script and ``python -m trainfold.cli``: ``main`` with the handlers kept up to the exit.

    Once a run is over (its result printed, its status final), SIGTERM and SIGINT are ignored up to the exit
    (``ignore_signals_until_exit``): a signal during the interpreter's teardown (about a second with torch)
    does not turn a completed run into -15 / -2.
    """
    _exit_on_signals()
    return _command(sys.argv[1:])


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status. The signal handlers it sets are undone on return (a
    process that calls it keeps its own); ``command`` keeps them up to the process's exit."""
    previous = _exit_on_signals()  # before torch and the layers are imported; train's own guard takes over
    try:
        return _command(sys.argv[1:] if argv is None else list(argv))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _command(argv: list[str]) -> int:
    import jsonargparse  # a dependency of trainfold, imported after the signal handlers are in place

    if argv[:1] == ["train"]:  # its parser reads the rest (--set spelled as overrides first: read_config)
        return _train(argv[1:])
    try:
        ns = _parser().parse_args(argv)
    except jsonargparse.ArgumentError as err:
        print(f"trainfold: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if ns.command == "demo":
        from trainfold.cli.demo import run_demo
        from trainfold.core.preempt import ignore_signals_until_exit

        result = run_demo(ns.demo.output_dir, ns.demo.max_steps)
        ignore_signals_until_exit()  # the run is over (see _train)
        return _exit_status(result)
    return _replay(ns.replay.output_dir, ns.replay.step, ns.replay.config)


if __name__ == "__main__":
    sys.exit(command())
