"""Loading a checkpoint into a template state (a sharded one resharded to its layout): every file's size and hash
checked, shapes and names from the template. Loading never runs code."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from torch import Tensor

from trainfold.ckpt import sharded, tensor_file
from trainfold.ckpt.sidecar import (
    MODEL_FILE,
    SHARD_DIR,
    SIDECAR_FILE,
    STATE_FILE,
    CheckpointError,
    check_name,
    field_error,
    hash_chunk,
    is_sharded_checkpoint,
    is_weights_only,
    read_metadata,
)
from trainfold.core.fingerprint import fingerprint
from trainfold.core.state import TrainState
from trainfold.core.tree import Tree, flatten, unflatten

__all__ = ["load", "load_weights", "warm_start", "FrozenWeightsError"]

_ALTERED = "the checkpoint was altered; resume from an earlier checkpoint"


class FrozenWeightsError(CheckpointError):
    """The template's frozen base weights are not those a checkpoint was trained on (the checkpoint is intact)."""


def _read_file(directory: Path, name: str, meta: Mapping[str, Any]) -> Tree:
    path = directory / name
    if path.is_symlink() or not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing or not a plain file of its own; the checkpoint is incomplete or was altered; "
            "resume from latest_checkpoint(output_dir) instead"
        )
    return tensor_file.read(path, meta["files"][name], hash_chunk(meta))


def _check_the_rest(directory: Path, meta: Mapping[str, Any], read: set[str]) -> None:
    """Check every file the sidecar lists that loading did not read (``config.json``, a sharded checkpoint's
    consolidated ``model.safetensors``): a damaged one fails the load as a damaged tensor file does."""
    for name in sorted(set(meta["files"]) - read):
        if name.startswith(f"{SHARD_DIR}/"):
            continue  # read_sharded checked them
        path = directory / name
        if path.is_symlink() or not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing or not a plain file of its own, though {SIDECAR_FILE} lists it; the checkpoint "
                "is incomplete or was altered; resume from latest_checkpoint(output_dir) instead"
            )
        tensor_file.check(path, meta["files"][name], hash_chunk(meta))


def _fit(flat: Mapping[str, Tensor], like: Any, path: Path) -> Any:
    try:
        return unflatten(flat, like=like)
    except (KeyError, ValueError) as e:  # naming each key missing or unexpected, each shape or dtype that differs
        raise type(e)(f"{path} does not fit the template (a different model or optimizer?): {e.args[0]}") from None


def _read_weights(directory: Path, meta: Mapping[str, Any], like: TrainState) -> Tree:
    """``{state key: tensor}`` of the weights files, and the frozen weights: the template's, fingerprints checked."""
    out: Tree = {}
    for name, keys in meta["tensors"].items():
        data = _read_file(directory, name, meta)
        if absent := sorted(v for v in keys.values() if v not in data):
            raise CheckpointError(f"{directory / name} lacks {absent[:5]}, listed in {SIDECAR_FILE}: {_ALTERED}")
        out.update({k: data[v] for k, v in keys.items()})
    mine = flatten({"buffers": like.buffers, "params": like.params})
    if differ := sorted(k for k, fp in meta["frozen"].items() if k not in mine or fingerprint(mine[k]) != fp):
        raise FrozenWeightsError(
            f"{directory / SIDECAR_FILE}: field 'frozen': the template's frozen weights are not those this "
            f"checkpoint was trained on: {differ[:5]} ({len(differ)} of {len(meta['frozen'])}) differ or are absent; "
            "build the model, with its frozen base, on the same base weights as the run (the same pretrained "
            "checkpoint, or the same seed), or start a new run"
        )
    return out | {k: mine[k] for k in meta["frozen"]}


def load(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Return the state saved in ``directory``, shaped like the template ``like`` and on its devices.

    Every file's size and hash are checked first; then every tensor must match the template's keys, shapes
    and dtypes (``metrics``, free-form, load as saved). Frozen base weights the checkpoint left out are the
    template's, their fingerprints checked (``FrozenWeightsError``). A directory named ``checkpoint-{n}``
    must hold step ``n``; a weights-only checkpoint raises ``ValueError`` (see ``warm_start``).

    >>> import tempfile, attrs, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state, scalar
    >>> from trainfold.ckpt import save
    >>> fresh = init_state(torch.nn.Linear(2, 1), sgd(0.1))
    >>> path = save(attrs.evolve(fresh, step=scalar(12)), tempfile.mkdtemp() + "/ckpt")
    >>> load(path, like=fresh).step.item(), fresh.step.item()
    (12, 0)
    """
    directory, base = Path(directory), attrs.evolve(like, metrics={})
    meta = read_metadata(directory)
    check_name(directory, meta)
    if is_weights_only(meta):
        raise ValueError(
            f"{directory / STATE_FILE} does not exist: {directory} was saved with save_only_model=True (weights "
            "only: no optimizer state, step or data cursor to resume); to start a new run from its weights call "
            "trainfold.ckpt.warm_start(directory, like=init_state(...)), which restarts the optimizer and schedule"
        )
    if is_sharded_checkpoint(meta):  # written by every rank: resharded to like's layout
        flat, source = sharded.read_sharded(directory, flatten(base)), directory / SHARD_DIR
        _check_the_rest(directory, meta, set())
    else:
        flat, source = _read_file(directory, STATE_FILE, meta), directory / STATE_FILE
        weights = _read_weights(directory, meta, like)
        if clash := sorted(set(weights) & set(flat)):
            raise CheckpointError(f"{source} holds {clash[:3]}, which {SIDECAR_FILE} places elsewhere: {_ALTERED}")
        flat |= weights
        _check_the_rest(directory, meta, {STATE_FILE, *meta["tensors"]})
    metrics = {k.removeprefix("metrics."): v for k, v in flat.items() if k.startswith("metrics.")}
    state = _fit({k: v for k, v in flat.items() if not k.startswith("metrics.")}, base, source)
    for field, value, recorded in [
        ("step", state.step, meta["step"]),
        ("cursor.epoch", state.cursor.epoch, meta["cursor"]["epoch"]),
        ("cursor.position", state.cursor.position, meta["cursor"]["position"]),
    ]:
        if recorded != int(value):
            raise field_error(directory / SIDECAR_FILE, field, f"is {recorded} but {source.name} holds {int(value)}")
    return attrs.evolve(state, metrics=metrics)


def load_weights(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Return ``like`` with params and buffers from the checkpoint's weights file; nothing else changes.

    The weights file is ``model.safetensors`` (``adapter_model.safetensors`` for a ``peft`` model, whose frozen
    base must be the template's); buffers absent from it (non-persistent) keep the template's values.

    >>> import tempfile, attrs, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state, scalar
    >>> from trainfold.ckpt import save
    >>> model = torch.nn.Linear(2, 1)
    >>> trained = init_state(model, sgd(0.1), params={"weight": torch.ones(1, 2), "bias": torch.ones(1)})
    >>> path = save(attrs.evolve(trained, step=scalar(9)), tempfile.mkdtemp() + "/ckpt", model=model)
    >>> s = load_weights(path, like=init_state(model, sgd(0.1)))
    >>> s.params["weight"].tolist(), s.step.item()            # the weights, not the step
    ([[1.0, 1.0]], 0)
    """
    directory, weights = Path(directory), {"params": like.params, "buffers": like.buffers}
    meta = read_metadata(directory)
    if is_sharded_checkpoint(meta):
        flat, source = sharded.read_sharded(directory, flatten(weights)), directory / SHARD_DIR
        read: set[str] = set()
    else:
        flat, source = _read_weights(directory, meta, like), directory / next(iter(meta["tensors"]), MODEL_FILE)
        read = set(meta["tensors"])
        if any(f"params.{k}" not in flat for k in like.params) and STATE_FILE in meta["files"]:
            # trainable tensors peft does not save (a base norm unfrozen by hand) are in the state file
            flat = _read_file(directory, STATE_FILE, meta) | flat
    _check_the_rest(directory, meta, read | {STATE_FILE})  # the optimizer state, not loaded here, is not read
    flat = {k: v for k, v in flat.items() if k.startswith(("params.", "buffers."))}
    return attrs.evolve(
        like, **_fit(flatten({"buffers": like.buffers}) | flat, weights, source)
    )  # absent buffers: like's


def warm_start(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Start a new run from a checkpoint's weights: ``load_weights`` with a warning.

    Pass a fresh ``like = init_state(...)``: the optimizer state, step (and so the learning-rate
    schedule), data cursor and metrics are ``like``'s, not the checkpoint's.

    >>> import tempfile, warnings, torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.state import init_state
    >>> from trainfold.ckpt import save
    >>> model = torch.nn.Linear(2, 1)
    >>> path = save(init_state(model, sgd(0.1)), tempfile.mkdtemp() + "/ckpt", model=model)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     s = warm_start(path, like=init_state(model, sgd(0.1)))
    >>> [w.category.__name__ for w in caught]
    ['UserWarning']
    """
    state = load_weights(directory, like)
    warnings.warn(
        f"warm start from the weights in {directory}: the optimizer state, schedule and data order restart "
        f"from step {int(like.step)} (not an exact resume)",
        UserWarning,
        stacklevel=2,
    )
    return state
