"""state_hash, the hash log and first_divergence: two runs of one configuration, one fed a changed row, part
ways exactly at the first step that reads it (the oracle: the indices the dataset served)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import TrainingArguments, TrainState, first_divergence
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.observe.divergence import HASH_FILE, hash_log, read_hashes, state_hash
from trainfold.testing.strategies import tensor_dicts
from trainfold.trainer.replay import replay
from trainfold.trainer.train import train

STEPS, CHANGED = 8, 13


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))


class _Rows(torch.utils.data.Dataset):
    """24 rows (row CHANGED altered in run b) that record the indices read, in order."""

    def __init__(self, changed: bool) -> None:
        self.rows = [[(i + j) % 16 for j in range(4)] for i in range(24)]
        if changed:
            self.rows[CHANGED] = [1, 1, 1, 1]
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        self.read.append(int(i))
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _rows(changed: bool) -> _Rows:
    return _Rows(changed)


def _run(out, rows, logging_steps):
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=3e-2,
        logging_steps=logging_steps,
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
    )
    train(_model(), args, rows, observers=[hash_log(out)])
    return rows.read[2:]  # train reads row 0 twice before the first step (the input checks, its columns)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for changed in (False, True):
        out[1, changed] = tmp_path_factory.mktemp(f"run{changed}")
        read = _run(out[1, changed], _rows(changed), logging_steps=1)
        # the same run as if it had logged hashes every 4 steps only
        out[4, changed] = tmp_path_factory.mktemp(f"sparse{changed}")
        shutil.copytree(out[1, changed], out[4, changed], dirs_exist_ok=True)
        lines = (out[1, changed] / HASH_FILE).read_text().splitlines()
        (out[4, changed] / HASH_FILE).write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] % 4 == 0))
    first_read = read.index(CHANGED) // 2 + 1  # two rows a step: the step that first reads the changed row
    return out, first_read


def test_a_replayed_state_hashes_as_the_run_logged_it(runs):
    out, _ = runs
    logged = read_hashes(out[1, False])
    for step in (1, 3, STEPS):
        assert (
            state_hash(replay(out[1, False], step, model=_model(), train_dataset=_rows(False)).state)
            == logged[step]["state_hash"]
        )


def test_per_step_hashes_name_the_first_step_that_reads_the_changed_row(runs):
    out, first_read = runs
    assert first_read > 1  # the runs agree for a while
    found = first_divergence(out[1, False], out[1, True])
    assert (found.step, found.last_agreed, found.by) == (first_read, first_read - 1, "hashes")
    assert first_divergence(out[1, False], out[1, False]) is None


def test_sparse_hashes_then_replay_name_the_step(runs):
    out, first_read = runs
    coarse = first_divergence(out[4, False], out[4, True])
    assert coarse.by == "hashes" and coarse.step >= first_read  # the interval only: no model to replay with
    exact = first_divergence(
        out[4, False], out[4, True], model=_model, train_dataset=_rows(False), train_dataset_b=_rows(True)
    )
    assert (exact.step, exact.by) == (first_read, "replay")


@settings(max_examples=50, deadline=None)
@given(tensor_dicts(keys=["w", "b"]), st.data())
def test_state_hash_sees_a_one_ulp_change_anywhere_in_a_tensor_it_hashes_whole(params, data):
    state = TrainState(params=params, buffers={}, opt_state=None)
    key = data.draw(st.sampled_from(sorted(params)))
    index = data.draw(st.integers(0, params[key].numel() - 1))
    changed = {k: v.clone() for k, v in params.items()}
    flat = changed[key].view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf")))
    assert state_hash(state) != state_hash(TrainState(params=changed, buffers={}, opt_state=None))
    assert state_hash(state) == state_hash(
        TrainState(params={k: v.clone() for k, v in params.items()}, buffers={}, opt_state=None)
    )
