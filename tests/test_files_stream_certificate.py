"""The per-step sample certificate (issue 46.3): a rolling hash of each step's sample ids in the cursor (so in
every checkpoint) and in the hash log, naming the first step whose rows differ between two runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from trainfold import TrainingArguments, first_divergence, train  # noqa: E402
from trainfold.core.models import TinyLM, TinyLMConfig  # noqa: E402
from trainfold.core.state import sample_certificate  # noqa: E402
from trainfold.data import files, pad_collate, source_stream  # noqa: E402
from trainfold.observe.divergence import hash_log  # noqa: E402


def write_shards(d: Path, changed: bool = False) -> Path:
    """Three shards of 12 token rows; ``changed``: one row of shard 2 differs (its size stays the same)."""
    d.mkdir(parents=True, exist_ok=True)
    for k in range(3):
        ids = [[(5 * k + 3 * i + j) % 40 for j in range(4 + i % 3)] for i in range(12)]
        if changed and k == 2:
            ids[7] = [(t + 1) % 40 for t in ids[7]]
        table = pa.table({"input_ids": ids, "labels": ids, "shard": [k] * 12})
        pq.write_table(table, d / f"part-{k}.parquet", row_group_size=4)
    return d


def source(d: Path):
    return files(str(d / "*.parquet"), seed=0, shuffle_window=36, shuffle=False)  # file order: shard 2 last


def test_the_certificate_is_the_same_after_a_resume_and_differs_from_the_step_that_reads_another_row(tmp_path):
    d = write_shards(tmp_path / "a")
    whole = list(source_stream(source(d), per_device_train_batch_size=4, max_steps=8))
    half = list(source_stream(source(d), per_device_train_batch_size=4, max_steps=4))
    rest = list(source_stream(source(d), per_device_train_batch_size=4, max_steps=8, start=half[-1].cursor))
    assert [sample_certificate(b.cursor) for b in half + rest] == [sample_certificate(b.cursor) for b in whole]
    assert len({sample_certificate(b.cursor) for b in whole}) == 8
    other = write_shards(tmp_path / "b", changed=True)
    theirs = list(source_stream(source(other), per_device_train_batch_size=4, max_steps=8))
    same = [sample_certificate(a.cursor) == sample_certificate(b.cursor) for a, b in zip(whole, theirs)]
    assert same == [True] * 6 + [False] * 2  # shard 2's row 7 (the epoch's row 31) is read at step 7


def test_first_divergence_names_the_first_step_that_reads_a_changed_shard(tmp_path):
    def run(shards: Path, out: Path):
        torch.manual_seed(0)
        model = TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_len=16))
        args = TrainingArguments(output_dir=str(out), max_steps=8, per_device_train_batch_size=4, logging_steps=1,
                                 report_to="none", disable_tqdm=True, save_strategy="no")  # fmt: skip
        train(model, args, source(shards), data_collator=pad_collate(), observers=[hash_log(out)])

    run(write_shards(tmp_path / "a"), tmp_path / "run-a")
    run(write_shards(tmp_path / "b", changed=True), tmp_path / "run-b")
    found = first_divergence(tmp_path / "run-a", tmp_path / "run-b")
    assert (found.step, found.last_agreed, found.by) == (7, 6, "samples")
    logged = [json.loads(x) for x in (tmp_path / "run-a" / "state_hashes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged] == list(range(1, 9)) and all("samples" in e for e in logged)


def test_replay_recomputes_a_step_of_a_run_on_a_source_from_its_checkpoint(tmp_path):
    from trainfold import replay

    def model():
        torch.manual_seed(0)
        return TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_len=16))

    d = write_shards(tmp_path / "a")
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=4,
                             logging_steps=1, save_steps=2, report_to="none", disable_tqdm=True)  # fmt: skip
    done = train(model(), args, files(str(d / "*.parquet"), seed=1, shuffle_window=8), data_collator=pad_collate())
    again = replay(args.output_dir, 4, model=model(), train_dataset=files(str(d / "*.parquet"), seed=1,
                   shuffle_window=8), data_collator=pad_collate())  # fmt: skip
    assert again.start.name == "checkpoint-2" and again.loss == again.logged_loss
    assert sample_certificate(again.state.cursor) == sample_certificate(done.state.cursor)
    for k, v in done.state.params.items():
        assert torch.equal(v, again.state.params[k]), k
