"""The ``loop.run`` the loop tests train, here and in fresh processes.

``python loop_runs.py OUTPUT_DIR MODE [HOLD_AT]``: MODE ``fresh`` or ``resume``; with ``HOLD_AT`` the run prints
``held <step>`` after that step's hooks and waits for a line on standard input (a test kills or signals it there,
no sleeps). It prints ``status <status> <step>`` at the end and exits with ``log.exit_code`` (143 when preempted).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainfold import loop
from trainfold.core.losses import cross_entropy
from trainfold.core.state import TrainState, init_state
from trainfold.data import Sampler, stream
from trainfold.optim import adamw
from trainfold.step import make_step

STEPS = 24
SAVE_EVERY = 5


def rows(n: int = 40, seed: int = 3) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x.sum(-1) > 0).long() + (x[:, 0] > 1).long()
    return [{"input": x[i], "labels": y[i]} for i in range(n)]


def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"input": torch.stack([r["input"] for r in items]), "labels": torch.stack([r["labels"] for r in items])}


def parts(seed: int = 0) -> tuple[nn.Module, Any, TrainState, Any]:
    """Return ``(model, step, state, data)``: a dropout MLP, AdamW, random order with 2 micro-batches a step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    optimizer = adamw(3e-2)
    dataset = rows()
    sampler = Sampler("random", len(dataset), per_device_train_batch_size=4, gradient_accumulation_steps=2, seed=7)

    def data(state: TrainState) -> Any:
        return stream(dataset, sampler, collate, start=state.cursor)

    return model, make_step(model, cross_entropy, optimizer), init_state(model, optimizer, seed=5), data


def train(
    output_dir: str | None, resume: bool = False, hooks: tuple[Any, ...] = (), steps: int = STEPS
) -> tuple[TrainState, Any]:
    model, step, state, data = parts()
    eval_rows = [collate(rows(8, seed=9))]
    built = (
        loop.log(every=2),
        loop.evaluate(eval_rows, every=4, model=model, loss=cross_entropy),
        loop.save(every=SAVE_EVERY, keep=2) if output_dir is not None else (),
    )
    return loop.run(
        step,
        state,
        data,
        hooks=(*built, *hooks),
        stop=lambda s: int(s.step) >= steps,
        output_dir=output_dir,
        resume=resume,
    )


def _hold(at: int) -> loop.Hook:
    def held(state: TrainState, log: loop.RunLog) -> None:
        if log.step == at:
            print(f"held {at}", flush=True)
            sys.stdin.readline()

    return loop.every(1, held)


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    extra = (_hold(int(sys.argv[3])),) if len(sys.argv) > 3 else ()
    final, log = train(out, resume=mode == "resume", hooks=extra)
    print(f"status {log.status} {int(final.step)}", flush=True)
    sys.exit(log.exit_code)


__all__ = ["STEPS", "SAVE_EVERY", "rows", "collate", "parts", "train", "Path"]
