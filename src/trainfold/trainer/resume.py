"""A run's first state: made from its ``Plan``, then (on a resume) loaded by the run's ``loop.directory.RunDir``."""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from trainfold import ckpt
from trainfold.ckpt import policy
from trainfold.ckpt.sharded import is_sharded
from trainfold.ckpt.sidecar import SIDECAR_FILE, CheckpointWarning, field_error
from trainfold.core.adapters import ADAPTER_CONFIG_FILE, adapter_config_text, is_peft_model
from trainfold.core.rng import global_rng_states, restore_global_rng
from trainfold.core.state import TrainState, init_state, lend
from trainfold.core.tree import flatten, map_tensors, unflatten
from trainfold.data import close_loader
from trainfold.data.mixture import is_stream_source, stream_cursor
from trainfold.loop.directory import RunDir
from trainfold.observe import history as log_file
from trainfold.observe.observers import MetricWindow
from trainfold.step.fsdp import placed_like
from trainfold.trainer.plan import Plan

__all__ = ["initial_state", "on_device", "Start", "start_run", "continuing_global_rng", "Lookahead"]


def on_device(opt_state: Any, device: torch.device) -> Any:
    """Return a record with every tensor on ``device``, except integer counters (they stay on the CPU).

    >>> out = on_device({"step": torch.tensor(3), "m": [torch.zeros(2)]}, torch.device("meta"))
    >>> out["step"].device.type, out["m"][0].device.type
    ('cpu', 'meta')
    """
    return map_tensors(lambda t: t if t.dim() == 0 and not t.is_floating_point() else t.to(device), opt_state)


def initial_state(plan: Plan) -> TrainState:
    """Return the run's first state: the module's own tensors lent (one copy), on the device (a ``fully_shard``
    module's: its DTensor shards, and optimizer state of the same layout)."""
    state = init_state(plan.model, plan.optimizer, seed=plan.seed, extras=plan.extras, copy=False)
    if is_stream_source(plan.inputs.train_dataset):  # the cursor holds each source's row position from step 0
        state = attrs.evolve(state, cursor=stream_cursor(plan.inputs.train_dataset))
    if plan.device.type != "cpu":
        device = plan.device
        state = attrs.evolve(
            state,
            params={k: v.to(device) for k, v in state.params.items()},
            buffers={k: v.to(device) for k, v in state.buffers.items()},
            opt_state=on_device(state.opt_state, device),
        )
    return state


def _check_resumable(plan: Plan, meta: Mapping[str, Any], source: str | os.PathLike) -> None:
    """Refuse a checkpoint of another run: its step beyond the plan's total, or another sample order."""
    if meta["step"] > plan.schedule.total_steps:
        raise field_error(
            Path(source) / SIDECAR_FILE,
            "step",
            f"is {meta['step']}, beyond this run's {plan.schedule.total_steps} steps (max_steps / num_train_epochs): "
            "it is not a checkpoint of this run",
            "resume from another checkpoint, or raise max_steps",
        )
    policy.check_compatible(meta.get("settings", {}), plan.run_settings, source=source)
    _check_adapter(plan.model, source)


_ADAPTER_PLACE = ("base_model_name_or_path", "revision")  # where the base came from: its weights are checked apart


def _check_adapter(model: torch.nn.Module, source: str | os.PathLike) -> None:
    """Refuse a PEFT checkpoint whose ``adapter_config.json`` differs from the model's adapter config.

    Another ``lora_alpha``, ``use_rslora`` or dropout keeps every shape (the run's fingerprint) but changes the
    forward: the resumed run would continue another trajectory without a word.
    """
    path = Path(source) / ADAPTER_CONFIG_FILE
    if not (is_peft_model(model) and path.is_file()):
        return
    saved, now = json.loads(path.read_text()), json.loads(adapter_config_text(model))
    differ = sorted(k for k in saved.keys() | now.keys() if k not in _ADAPTER_PLACE and saved.get(k) != now.get(k))
    if differ:
        shown = ", ".join(f"{k}: {saved.get(k)!r} there, {now.get(k)!r} here" for k in differ[:4])
        raise ckpt.CheckpointError(
            f"{path}: the checkpoint's adapter config is not the model's ({shown}); resume with the adapter config "
            "that wrote it (PeftModel.from_pretrained(base, checkpoint, is_trainable=True) rebuilds it), or start a "
            "new run in another output_dir"
        )


@attrs.frozen(eq=False)
class Start:
    """Where a run starts: its state, metric window and log history, and the checkpoint it resumed (or None)."""

    state: TrainState
    window: MetricWindow
    history: Any  # a history.HistoryFile on the writer rank, a list elsewhere
    source: Any = None
    global_rng: Mapping[str, Any] | None = None  # the checkpoint's global generator states, by rank
    global_rng_ahead: Mapping[str, Any] | None = None  # and before its look-ahead collation (Lookahead)


def start_run(plan: Plan, directory: RunDir, state: TrainState, *, weights_only_warm_start: bool = False) -> Start:
    """Return the run's ``Start``: ``state`` as made, or loaded by ``directory`` (each candidate checked against the
    plan) and lent to the module again (one copy of the weights).

    What the run opens is closed when the directory is released: the log history, the eval loaders' workers.
    """
    check = functools.partial(_check_resumable, plan)  # another run's checkpoint: refused, never set aside
    loaded, source = directory.start(state, check, weights_only=weights_only_warm_start)
    window, meta = MetricWindow(), (directory.resumed or {}).get("metadata", {})
    if "window" in meta and source is not None:
        log_file.restore_window(window, meta["window"], source)
    if source is not None and plan.sharding is not None:  # a fully_shard module: into its DTensor shards
        loaded = lend_sharded(plan.model, loaded, like=state)
    elif source is not None and not is_sharded(loaded):  # the loaded tensors go into the module's own
        loaded = lend(plan.model, loaded)
    for eval_set in plan.evals.sets:  # persistent eval workers stop with the run, also when it raises
        directory.claim.callback(functools.partial(close_loader, eval_set.loader))
    return Start(loaded, window, directory.history, source, meta.get("global_rng"), meta.get("global_rng_ahead"))


@attrs.define(eq=False)
class Lookahead:
    """The global generators around the stream's look-ahead collation (``stream(..., collate_ahead=...)``).

    accelerate's ``DataLoaderShard`` (HF's training loader) collates the epoch's next micro-batch before it yields
    one, so an evaluation or save after a step comes after that collation. ``ahead`` holds this rank's generator
    states right before the latest step's look-ahead collation (None: the step closed its epoch, nothing was
    collated ahead); a checkpoint keeps them beside the states at the save (``global_rng_ahead``). A resume sets
    the generators to them before its first collation (that look-ahead micro-batch), then to the save's
    (``resuming``) right after it: each collation draws as in the run that never stopped.
    """

    saved_ahead: Mapping[str, Any] | None = None  # a resume's: the checkpoint's ``global_rng_ahead``, by rank
    ahead: dict[str, Any] | None = None
    resuming: Mapping[str, Any] | None = None  # a resume's states at the save, set after its first collation

    def note(self, collates: bool) -> None:
        """Keep the states of this moment, right before a look-ahead collation (``collates``), else None."""
        self.ahead = global_rng_states() if collates else None

    def after_first(self) -> None:
        """Set the resume's states at the save, once: its look-ahead micro-batch is collated."""
        if self.resuming is not None:
            restore_global_rng(self.resuming)
            self.resuming = None


def continuing_global_rng(
    batches: Iterable[Any],
    saved: Mapping[str, Any] | None,
    rank: int,
    lookahead: Lookahead | None = None,
) -> Iterator[Any]:
    """Yield ``batches``, the global generators first set to this rank's ``saved`` states (a resume's).

    Set when the first batch is drawn, right before its collation (after what ran since the checkpoint was
    loaded: ``on_train_begin`` callbacks), so a collator drawing from torch's, numpy's or ``random``'s global
    generator continues the draws of the run that saved them, as if it had never stopped. Where the checkpoint
    holds this rank's states before a look-ahead collation (``lookahead.saved_ahead``), those are set first and the
    ``saved`` ones right after the first collation (``lookahead.after_first``, which the stream calls).
    """
    if saved is not None:
        ahead = None if lookahead is None else (lookahead.saved_ahead or {}).get(str(rank))
        if str(rank) in saved and ahead is not None and lookahead is not None:
            restore_global_rng(ahead)
            lookahead.resuming = saved[str(rank)]
        elif str(rank) in saved:
            restore_global_rng(saved[str(rank)])
        else:
            warnings.warn(
                f"the checkpoint holds the global random generators' states of rank(s) {sorted(saved)} only, not "
                f"rank {rank}'s: a collator drawing from them on rank {rank} does not continue its draws",
                CheckpointWarning,
                stacklevel=2,
            )
    yield from batches


def lend_sharded(model: torch.nn.Module, state: TrainState, *, like: TrainState) -> TrainState:
    """Return the loaded ``state`` laid out as ``like`` (a ``fully_shard`` module's lent state) on the module's
    own DTensor params: each loaded value is copied into them; a full tensor (a checkpoint of one process, or of
    a replicated run) is first cut to this rank's shard of ``like``'s placement."""
    templates = flatten(like)  # a full tensor where the template has a shard: every rank holds the whole tensor
    flat = {k: placed_like(v, templates[k]) if k in templates else v for k, v in flatten(state).items()}
    state = unflatten(flat, like=state)
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.params.items():
            if own[name] is not value:
                own[name].copy_(value)
    return attrs.evolve(state, params={name: own[name] for name in state.params})
