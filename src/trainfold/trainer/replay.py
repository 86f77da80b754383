"""Exact replay: recompute step k of a finished (or running) ``train`` run, with the dataset rows that made it.

A run is a fold of a pure step over a stream that is a function of the state's cursor, so any step
can be recomputed from the newest checkpoint before it: load the checkpoint, rebuild the stream
from its cursor, and run the same step on the same micro-batches. :func:`replay` does that and
returns the step's loss, the state after it and the dataset indices of each micro-batch, e.g.
to find the rows behind a loss spike. On the CPU (and on GPUs with deterministic algorithms) the
replayed loss is the logged one bitwise, and replaying to a checkpoint's step gives its params bitwise.

Step ``k`` is the update that took the run from state ``k - 1`` to state ``k`` (the one logged as
``"step": k``); it is recomputed from the newest complete checkpoint at or before step ``k - 1``,
or from the model's initial weights when there is none (then ``model`` must hold the weights the
run started from, as a fresh ``torch.manual_seed(...)`` before building it gives).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
from torch import nn

from trainfold import ckpt
from trainfold.ckpt.listing import catalog
from trainfold.core.state import TrainState, init_state
from trainfold.data import StepBatch, is_stream_source, source_steps, stream, stream_cursor
from trainfold.observe.divergence import first_hash_divergence, first_sample_divergence, state_hash
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.inputs import to_device
from trainfold.trainer.planning import TrainCall, plan_for, process_settings
from trainfold.trainer.resume import on_device

__all__ = ["Divergence", "Replay", "first_divergence", "replay", "saved_arguments"]


@attrs.frozen(eq=False)
class Replay:
    """What :func:`replay` returns: the step's loss, the state after it, and its rows.

    ``rows`` holds the dataset indices of each micro-batch of the step (``rows[i]`` for micro-batch
    ``i``); ``logged_loss`` is the loss the run logged for exactly this step (``None`` when its log
    entry covers more steps, or there is none); ``start`` the checkpoint the replay began from
    (``None``: the initial weights). ``state`` is what the step returned: its ``extras`` are the start's
    (replay runs no logging, evaluation or saving, whose marks ``train`` keeps there).
    """

    step: int
    loss: float
    state: TrainState
    rows: tuple[tuple[int, ...], ...]
    logged_loss: float | None
    start: Path | None


def saved_arguments(output_dir: str | os.PathLike) -> TrainingArguments:
    """Return the ``TrainingArguments`` a run in ``output_dir`` recorded in its newest complete checkpoint.

    >>> saved_arguments("no/such/dir")
    Traceback (most recent call last):
    ...
    FileNotFoundError: no complete checkpoint in no/such/dir records the run's arguments; pass args= ...
    """
    found = catalog(output_dir)
    if not found:
        raise FileNotFoundError(
            f"no complete checkpoint in {output_dir} records the run's arguments; "
            "pass args= (the run's TrainingArguments)"
        )
    settings = found[-1][1]["settings"]
    world_size = int(settings.get("world_size", 1))
    if world_size != 1:
        raise ValueError(
            f"the run in {output_dir} ran on {world_size} processes; replay recomputes the steps of a one-process "
            "run (each rank of a distributed run holds other rows)"
        )
    fields = attrs.fields_dict(TrainingArguments)
    return TrainingArguments.from_dict({k: v for k, v in settings.items() if k in fields})


def replay(
    output_dir: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    train_dataset: Any,
    args: TrainingArguments | None = None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    compute_loss_func: Callable[..., Any] | None = None,
    objective: Callable[..., Any] | None = None,
    optimizer: Any = None,
) -> Replay:
    """Recompute step ``step`` of the run in ``output_dir``; return its loss, the state after it and its rows.

    Give what ``train`` was given (the model, the dataset, and any collator, loss, objective or
    optimizer passed to it); ``args`` defaults to the arguments the run recorded (:func:`saved_arguments`).
    ``model`` is not changed. Refused by name: a step past the end of the run's data, a run of several
    processes (each rank holds other rows), a run through ``train_stream`` (GRPO: its batches are generated).

    >>> import tempfile, torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> from trainfold.trainer.train import train
    >>> def model():
    ...     _ = torch.manual_seed(0)
    ...     return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> rows = [{"input_ids": [i, i + 1, i + 2], "labels": [i, i + 1, i + 2]} for i in range(8)]
    >>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=2,
    ...                          logging_steps=1, save_steps=2, report_to="none", disable_tqdm=True)
    >>> _ = train(model(), args, rows)
    >>> again = replay(args.output_dir, 4, model=model(), train_dataset=rows)
    >>> again.start.name, again.loss == again.logged_loss, len(again.rows[0])
    ('checkpoint-2', True, 2)
    """
    if step < 1:
        raise ValueError(f"step must be >= 1 (step k is the update that made state k), got {step}")
    args = (args or saved_arguments(output_dir)).replace(report_to="none", disable_tqdm=True)
    process_settings(args, main_process=True)  # as the run's own start: its kernels warmed up, the same verbosity
    call = TrainCall(model, train_dataset, None, data_collator, compute_loss_func, objective, optimizer=optimizer)
    plan = plan_for(args, call)
    if step > plan.schedule.total_steps:
        raise ValueError(
            f"the run in {output_dir} has {plan.schedule.total_steps} steps; there is no step {step} to replay"
        )
    start = _start_checkpoint(output_dir, step)
    state = _first_state(plan, start)
    for batch in _steps(plan, state):
        state = plan.step(state, batch)
        if int(state.step) == step:
            loss = float(state.metrics["loss"])
            return Replay(step, loss, state, batch.indices, _logged_loss(output_dir, step), start)
    raise ValueError(f"the run's data ends before step {step}: its stream stops at step {int(state.step)}")


def _start_checkpoint(output_dir: str | os.PathLike, step: int) -> Path | None:
    """Return the newest complete checkpoint at or before step ``step - 1`` (``None``: start from the model)."""
    before = [p for p, meta in catalog(output_dir) if meta["step"] < step]
    return before[-1] if before else None


def _first_state(plan: Any, start: Path | None) -> TrainState:
    """Return the state the replay starts from: the run's initial state (copies), loaded from ``start`` if given."""
    state = init_state(plan.model, plan.optimizer, seed=plan.seed, extras=plan.extras)  # copies: model untouched
    if plan.device.type != "cpu":
        state = attrs.evolve(
            state,
            params={k: v.to(plan.device) for k, v in state.params.items()},
            buffers={k: v.to(plan.device) for k, v in state.buffers.items()},
            opt_state=on_device(state.opt_state, plan.device),
        )
    if is_stream_source(plan.inputs.train_dataset):  # the cursor holds each source's row position from step 0
        state = attrs.evolve(state, cursor=stream_cursor(plan.inputs.train_dataset))
    return state if start is None else ckpt.load(start, like=state)


def _steps(plan: Any, state: TrainState) -> Iterator[StepBatch]:
    """Yield the run's steps of data from ``state``'s cursor (the sampler's stream)."""
    if plan.stream is not None:
        raise ValueError("replay cannot recompute a run trained through train_stream (its batches are generated)")
    batches = (source_steps if is_stream_source(plan.inputs.train_dataset) else stream)(  # files(...): its cursor
        plan.inputs.train_dataset,
        plan.sampler,
        plan.inputs.collate,
        start=state.cursor,
        num_epochs=plan.schedule.num_epochs,
    )
    return to_device(batches, plan.device)


def _logged_loss(output_dir: str | os.PathLike, step: int) -> float | None:
    """Return the training loss the run logged for exactly step ``step`` (a log window of that step alone)."""
    path = Path(output_dir) / "log_history.jsonl"
    if not path.is_file():
        return None
    steps = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line) if line.strip() else {}
        if "loss" in entry and "step" in entry:
            steps[int(entry["step"])] = float(entry["loss"])
    one_step_window = step - 1 in steps or step == 1
    return steps.get(step) if one_step_window else None


# -- the first step where two runs differ -------------------------------------------------------------


@attrs.frozen
class Divergence:
    """Where two runs part ways: the first ``step`` whose state differs, and how it was found.

    ``by`` is ``"samples"`` when the steps' sample certificates pin it (the rows of that step differ: runs on a
    streaming source), ``"hashes"`` when the hash logs pin it (the runs agreed at the step before), ``"replay"``
    when replaying the steps after the last agreeing hash found it; ``last_agreed`` is the last step
    known equal (``None``: none).
    """

    step: int
    last_agreed: int | None
    by: str


def first_divergence(
    run_a: str | os.PathLike,
    run_b: str | os.PathLike,
    *,
    model: Callable[[], nn.Module] | None = None,
    train_dataset: Any = None,
    train_dataset_b: Any = None,
) -> Divergence | None:
    """Return the first step where two runs of one configuration differ (``None``: they agree everywhere logged).

    Both runs must log state hashes (``train(observers=[hash_log(output_dir)])``, per step with
    ``logging_steps=1``). The first logged step whose hashes differ is the answer when the runs
    agreed at the step before it. Otherwise, with ``model`` (a function returning the model as the
    runs built it) and ``train_dataset`` (``train_dataset_b`` for run b, default the same), each step
    in between is replayed in both runs (:func:`replay`) and the first whose states hash differently
    is named; without them the logged interval is returned as ``Divergence(first_logged, last_agreed, "hashes")``.
    Runs on a streaming source also log each step's sample certificate: a step whose rows differ (a changed
    shard read there for the first time) is named ``Divergence(step, step - 1, "samples")`` when no earlier
    step's state differs.
    """
    first, last = first_hash_divergence(run_a, run_b)
    sample_first, sample_last = first_sample_divergence(run_a, run_b)  # runs on streaming sources log these
    if sample_first is not None and (first is None or sample_first <= first) and sample_last == _before(sample_first):
        return Divergence(sample_first, sample_last, "samples")
    if first is None:
        return None
    if last == first - 1 or (last is None and first == 1) or model is None or train_dataset is None:
        return Divergence(first, last, "hashes")
    for step in range((last or 0) + 1, first):
        a = replay(run_a, step, model=model(), train_dataset=train_dataset)
        b = replay(
            run_b, step, model=model(), train_dataset=train_dataset if train_dataset_b is None else train_dataset_b
        )
        if state_hash(a.state) != state_hash(b.state):
            return Divergence(step, step - 1 if step > 1 else None, "replay")
    return Divergence(first, first - 1, "replay")


def _before(step: int) -> int | None:
    return step - 1 if step > 1 else None
