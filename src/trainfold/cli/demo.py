"""The ``make demo`` job: train a small byte-level LM on Python's own standard library source.

Nothing is downloaded: the text is the ``.py`` files that ship with the running Python. The run
evaluates held-out loss before and after training, logs to ``runs/demo/log.jsonl``, checkpoints
under ``runs/demo/``, and prints where everything is.
"""

from __future__ import annotations

import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from trainfold.core.models import TinyLM, TinyLMConfig, byte_decode, byte_encode
from trainfold.trainer.args import TrainingArguments

__all__ = ["stdlib_text", "byte_chunks", "run_demo"]


def stdlib_text(max_bytes: int = 2_000_000) -> str:
    """Return up to ``max_bytes`` of the standard library's ``.py`` source, files in name order.

    >>> text = stdlib_text(max_bytes=1000)
    >>> len(text), text == stdlib_text(max_bytes=2000)[:1000]
    (1000, True)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    if not parts:
        raise FileNotFoundError(f"no .py files under {root}; the demo needs Python's standard library source")
    return "".join(parts)[:max_bytes]


def byte_chunks(text: str, seq_len: int) -> list[dict[str, list[int]]]:
    """Cut text into non-overlapping rows of ``seq_len`` bytes, as ``input_ids``/``labels``.

    >>> [row["input_ids"] for row in byte_chunks("abcdefg", 3)]
    [[97, 98, 99], [100, 101, 102]]
    """
    ids = byte_encode(text)
    return [
        {"input_ids": ids[i : i + seq_len], "labels": ids[i : i + seq_len]}
        for i in range(0, len(ids) - seq_len + 1, seq_len)
    ]


def _sample(model: TinyLM, state: Any, prompt: str, n: int = 80, temperature: float = 0.7, seed: int = 0) -> str:
    """Sample a continuation of ``prompt`` with the state's params (a look at what was learned)."""
    from trainfold.core.forward import make_forward, train_mode

    forward = make_forward(model, state.buffers)
    ids = byte_encode(prompt)
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode(), train_mode(model, False):
        for _ in range(n):
            x = torch.tensor([ids[-model.config.max_len :]])
            probs = torch.softmax(forward(state.params, {"input_ids": x})[0, -1] / temperature, -1)
            ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return byte_decode(ids[len(byte_encode(prompt)) :])


def _print_log(max_steps: int) -> Any:
    """Return an observer printing each log entry as one line (progress without a terminal too)."""

    def show(state: Any, logs: dict[str, Any]) -> None:
        if "eval_loss" in logs:
            print(f"  step {int(logs['step']):>5}/{max_steps}  held-out loss {logs['eval_loss']:.3f}", flush=True)
        elif "loss" in logs:
            print(
                f"  step {int(logs['step']):>5}/{max_steps}  loss {logs['loss']:.3f}  "
                f"lr {logs['learning_rate']:.2e}  grad norm {logs['grad_norm']:.2f}",
                flush=True,
            )

    return show


def demo_args(output_dir: str, max_steps: int, seed: int = 0) -> TrainingArguments:
    """Return the demo's settings: cosine schedule, a log every 1/16 of the run, evaluation and saves at halves.

    >>> args = demo_args("runs/demo", 800)
    >>> args.logging_steps, args.eval_steps, args.lr_scheduler_type
    (50, 400, 'cosine')
    """
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        learning_rate=3e-3,
        warmup_steps=0.05,
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        seed=seed,
        logging_steps=max(1, max_steps // 16),
        eval_strategy="steps",
        eval_steps=max(1, max_steps // 2),
        eval_on_start=True,
        save_steps=max(1, max_steps // 2),
        save_total_limit=2,
        report_to=["jsonl"],
        metric_for_best_model="loss",
        enable_jit_checkpoint=True,
        disable_tqdm=True,
        log_level="warning",  # the observer below prints each log
    )


def _report(result: Any, model: TinyLM, output_dir: str, started: float) -> None:
    """Print the held-out loss before and after, a sample, and where the results are."""
    evals = [h for h in result.log_history if "eval_loss" in h]
    first, last = evals[0]["eval_loss"], evals[-1]["eval_loss"]
    print(
        f"\nheld-out loss: {first:.3f} before training -> {last:.3f} after {result.global_step} steps "
        f"({result.status}, {time.monotonic() - started:.0f} s)"
    )
    prompt = "def __init__(self"
    print(f"sample: {prompt!r} -> {_sample(model, result.state, prompt)!r}")
    where = Path(output_dir).resolve()
    full = lambda p: Path(p).resolve() if p is not None else None
    print(
        f"results in {where}:\n  log        {where / 'log.jsonl'}\n  checkpoint {full(result.last_checkpoint)}"
        f"\n  best       {full(result.best_checkpoint)}"
    )


def run_demo(
    output_dir: str = "runs/demo", max_steps: int = 800, seq_len: int = 128, max_bytes: int = 2_000_000, seed: int = 0
) -> Any:
    """Train TinyLM on stdlib source and report held-out loss before and after; return the result.

    >>> import contextlib, io, tempfile
    >>> with contextlib.redirect_stdout(io.StringIO()) as printed:   # a one-step run, quietly
    ...     result = run_demo(tempfile.mkdtemp(), max_steps=1, seq_len=16, max_bytes=2000)
    >>> result.global_step, result.status, printed.getvalue().count("held-out loss")
    (1, 'completed', 3)
    """
    from trainfold.core.determinism import warm_up_kernels
    from trainfold.trainer.train import train

    warm_up_kernels()  # a process's first tanh/exp/... calls can race on threads (trainfold.core.determinism)
    started = time.monotonic()
    rows = byte_chunks(stdlib_text(max_bytes), seq_len)
    cut = int(len(rows) * 0.97)
    train_rows, eval_rows = rows[:cut], rows[cut:][:96]
    torch.manual_seed(seed)
    model = TinyLM(TinyLMConfig(max_len=seq_len, dropout=0.0))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"trainfold demo: TinyLM with {params / 1e3:.0f}k parameters, {len(train_rows)} training rows of "
        f"{seq_len} bytes of Python's standard library, {len(eval_rows)} held out"
    )
    args = demo_args(output_dir, max_steps, seed)
    result = train(model, args, train_rows, eval_rows, observers=[_print_log(max_steps)])
    _report(result, model, output_dir, started)
    return result


if __name__ == "__main__":  # pragma: no cover
    run_demo()
    sys.exit(0)
