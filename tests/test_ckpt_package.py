"""The checkpoint package after its split: the public names, the sidecar record, crash points, vocabularies."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainfold
from trainfold import ckpt
from trainfold.ckpt import faults, policy, sidecar
from trainfold.ckpt.sidecar import CheckpointError, new_sidecar, sidecar_bytes, validate_sidecar
from trainfold.core.state import init_state, scalar
from trainfold.optim import sgd

# The old trainfold.ckpt module's __all__: every name stays on trainfold.ckpt.
OLD_API = [
    "STATE_FILE",
    "MODEL_FILE",
    "CONFIG_FILE",
    "SIDECAR_FILE",
    "ADAPTER_FILE",
    "ADAPTER_CONFIG_FILE",
    "INCOMPLETE_MARKER",
    "save",
    "load",
    "load_weights",
    "warm_start",
    "read_metadata",
    "model_weights",
    "fingerprint",
    "checkpoint_path",
    "is_complete",
    "list_checkpoints",
    "latest_checkpoint",
    "resume_checkpoint",
    "mark_jit",
    "validate_sidecar",
    "CheckpointError",
    "CheckpointWarning",
]

FIELDS = [
    "format",
    "format_version",
    "library_version",
    "step",
    "epoch",
    "cursor",
    "save_only_model",
    "jit",
    "metadata",
    "settings",
    "run",
    "tensors",
    "frozen",
    "files",
    "checksum",
]


def test_every_name_of_the_old_checkpoint_module_is_on_the_package_and_the_alias():
    assert trainfold.ckpt.__all__ == ckpt.__all__  # a real module re-exporting the layer's names
    assert [n for n in OLD_API if n not in ckpt.__all__] == []
    assert all(getattr(trainfold.ckpt, n) is getattr(ckpt, n) for n in OLD_API)
    assert (ckpt.save, ckpt.load, ckpt.latest_checkpoint) == (
        trainfold.save,
        trainfold.load,
        trainfold.latest_checkpoint,
    )


def test_the_shard_folder_name_has_one_owner():
    from trainfold.ckpt import sharded

    assert ckpt.SHARD_DIR == sidecar.SHARD_DIR == sharded.SHARD_DIR == "sharded"
    assert "SHARD_DIR" not in sharded.__all__


def test_a_saved_sidecar_holds_the_fields_of_the_format_in_order(tmp_path):
    path = ckpt.save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), tmp_path / "c", metadata={"n": 1})
    text = (path / ckpt.SIDECAR_FILE).read_text()
    assert list(json.loads(text)) == FIELDS
    assert text.encode() == sidecar_bytes(json.loads(text))  # written as sidecar_bytes writes it


def test_new_sidecar_makes_a_valid_sidecar_once_its_checksum_is_added(tmp_path):
    files = {"model.safetensors": {"bytes": 10, "xxh3_64": 1}, "state.safetensors": {"bytes": 20, "xxh3_64": 2}}
    meta = json.loads(
        sidecar_bytes(new_sidecar(step=4, cursor=(1, 8), files=files, run={"id": "a", "fingerprint": "b"}))
    )
    assert validate_sidecar(meta, tmp_path / "trainfold.json") is meta
    assert (meta["step"], meta["epoch"], meta["cursor"], meta["run"]) == (
        4,
        1,
        {"epoch": 1, "position": 8},
        {"id": "a", "fingerprint": "b"},
    )
    assert list(meta) == FIELDS


@settings(max_examples=40, deadline=None)
@given(
    step=st.integers(0, 2**53),
    epoch=st.integers(0, 1000),
    position=st.integers(0, 10**6),
    metadata=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
    jit=st.booleans(),
)
def test_any_new_sidecar_round_trips_through_its_bytes_and_validates(step, epoch, position, metadata, jit):
    files = {"model.safetensors": {"bytes": 1, "xxh3_64": 0}, "state.safetensors": {"bytes": 2, "xxh3_64": 0}}
    record = new_sidecar(step=step, cursor=(epoch, position), files=files, metadata=metadata, jit=jit)
    meta = json.loads(sidecar_bytes(record))
    assert validate_sidecar(meta, "c/trainfold.json") == {**record, "checksum": meta["checksum"]}


def test_a_sidecar_altered_after_its_checksum_is_refused_by_field():
    files = {"model.safetensors": {"bytes": 1, "xxh3_64": 0}, "state.safetensors": {"bytes": 2, "xxh3_64": 0}}
    meta = json.loads(sidecar_bytes(new_sidecar(step=3, cursor=(0, 3), files=files)))
    with pytest.raises(CheckpointError, match=r"c/trainfold.json: field 'checksum' does not match"):
        validate_sidecar({**meta, "metadata": {"x": 1}}, "c/trainfold.json")
    with pytest.raises(CheckpointError, match=r"field 'step' must be an int in \[0, 9007199254740992\], got -1"):
        validate_sidecar({**meta, "step": -1}, "c/trainfold.json")


def test_field_error_names_the_path_the_field_and_the_fix():
    e = sidecar.field_error("c/trainfold.json", "step", "is 3 but the shards hold 4")
    assert isinstance(e, CheckpointError) and str(e).startswith("c/trainfold.json: field 'step' is 3 but the shards")
    assert "resume from another checkpoint" in str(e)


def test_a_save_passes_its_crash_points_in_order(tmp_path, monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(faults, "fault_hook", seen.append)
    state = attrs.evolve(init_state(torch.nn.Linear(2, 1), sgd(0.1)), step=scalar(2))
    ckpt.save(state, ckpt.checkpoint_path(tmp_path, 2))
    assert seen == [
        "save:started",
        "save:wrote:state.safetensors",
        "save:wrote:model.safetensors",
        "save:wrote:sidecar",
        "save:complete",
        "replace:renamed",
    ]
    seen.clear()
    ckpt.mark_jit(ckpt.checkpoint_path(tmp_path, 2))
    assert seen == ["mark_jit:wrote", "mark_jit:replaced"]


def test_a_crash_at_a_crash_point_leaves_no_checkpoint_and_no_leftover(tmp_path, monkeypatch):
    def crash(label):
        if label == "save:wrote:sidecar":
            raise KeyboardInterrupt(label)

    monkeypatch.setattr(faults, "fault_hook", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(init_state(torch.nn.Linear(2, 1), sgd(0.1)), ckpt.checkpoint_path(tmp_path, 0))
    assert list(tmp_path.iterdir()) == []


def test_the_save_strategies_are_policys_and_should_save_names_them():
    assert policy.SAVE_STRATEGIES == ckpt.SAVE_STRATEGIES == ("no", "steps", "epoch", "best")
    assert [policy.should_save(4, save_strategy=s, save_steps=2, new_best=True) for s in policy.SAVE_STRATEGIES] == [
        False,
        True,
        False,
        True,
    ]
    with pytest.raises(ValueError, match=r"save_strategy 'step' is not one of \['no', 'steps', 'epoch', 'best'\]"):
        policy.should_save(4, save_strategy="step")


def test_the_best_metric_tracker_lives_under_its_extras_key_and_survives_a_checkpoint(tmp_path):
    from trainfold.ckpt import best as tracker

    best, _ = tracker.update_best(tracker.best_metric(greater_is_better=False), 0.25, 3)
    state = init_state(torch.nn.Linear(2, 1), sgd(0.1), extras={ckpt.BEST_METRIC_KEY: best})
    back = ckpt.load(ckpt.save(state, tmp_path / "c"), like=state)
    assert ckpt.BEST_METRIC_KEY == tracker.BEST_METRIC_KEY == "best_metric"
    assert (back.extras["best_metric"].value.item(), back.extras["best_metric"].step.item()) == (0.25, 3)


def test_the_async_copy_keeps_the_records_structure(tmp_path):
    from trainfold.ckpt.sharded import Saver

    state = init_state(torch.nn.Linear(2, 1), sgd(0.1), extras={"pair": (torch.tensor(1), torch.tensor(2))})
    saver = Saver(async_save=True)
    path = saver.save(state, tmp_path / "checkpoint-0")
    assert saver.wait() == path and ckpt.load(path, like=state).extras["pair"][1].item() == 2
