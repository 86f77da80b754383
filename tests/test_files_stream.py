"""Streaming sources over sharded files (issue 46): the order a pure function of the position, resumes exact.

The central property: for any schedule of (read n steps, checkpoint the cursor, change the world size
among 1, 2, 4, resume in a fresh process's worth of objects) repeated k >= 2 times, the concatenated
stream of sample ids equals the uninterrupted one, with a filter, a map and a mixture on.
"""

from __future__ import annotations

import io
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from trainfold.core.state import Cursor, sample_certificate, scalar  # noqa: E402
from trainfold.data import (  # noqa: E402
    ShardChangedError,
    files,
    filestream,
    mix,
    source_stream,
)
from trainfold.data.global_batch import split_global_batch  # noqa: E402

GLOBAL = 4  # rows per optimizer step, divisible by every world size tried


def write_shards(d: Path) -> Path:
    """Three Parquet shards of 7, 5 and 9 rows (row groups of 3), an Arrow file, a JSON Lines file."""
    d.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, n in enumerate((7, 5, 9)):
        ids = list(range(start, start + n))
        pq.write_table(pa.table({"id": ids, "text": [f"t{i}" for i in ids]}), d / f"part-{k}.parquet", row_group_size=3)
        start += n
    table = pa.table({"id": list(range(1000, 1006)), "text": [f"a{i}" for i in range(6)]})
    with pa.ipc.new_file(str(d / "extra.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=2):
            w.write_batch(batch)
    (d / "more.jsonl").write_text("".join(json.dumps({"id": 2000 + i, "text": f"j{i}"}) + "\n" for i in range(5)))
    return d


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"))


def make_source(d: Path, kind: str):
    """A fresh source (as a new process would open it): plain, filtered + mapped, or a mixture."""
    parquet = files(str(d / "*.parquet"), seed=3, shuffle_window=4)
    if kind == "plain":
        return parquet
    kept = parquet.filter(lambda r: r["id"] % 3 != 0).map(lambda r: {**r, "len": len(r["text"])})
    if kind == "filtered":
        return kept
    other = files([str(d / "extra.arrow"), str(d / "more.jsonl")], seed=5, shuffle_window=3)
    return mix({"p": kept, "o": other.filter(lambda r: r["id"] != 1004)}, weights={"p": 3, "o": 1}, seed=1)


def checkpoint(cursor: Cursor) -> Cursor:
    """Round-trip a cursor through bytes, as a checkpoint does."""
    buf = io.BytesIO()
    torch.save({"epoch": cursor.epoch, "position": cursor.position, "streams": cursor.streams}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    return Cursor(saved["epoch"], saved["position"], saved["streams"])


def run_segment(d: Path, kind: str, start: Cursor | None, steps: int, world: int) -> tuple[list[int], Cursor | None]:
    """Read ``steps`` steps on ``world`` ranks from ``start``: the ids of each global batch in order, and the cursor."""
    per_device, accumulation = split_global_batch(GLOBAL, world_size=world, per_device=2)
    done = 0 if start is None else start.as_tuple()[1]
    ranks = [
        list(
            source_stream(
                make_source(d, kind),
                per_device_train_batch_size=per_device,
                gradient_accumulation_steps=accumulation,
                world_size=world,
                rank=r,
                start=start,
                max_steps=done + steps,
            )
        )
        for r in range(world)
    ]
    ids: list[int] = []
    cursor = start
    for step_on_ranks in zip(*ranks):
        cursors = {(b.cursor.as_tuple(), tuple(map(tuple, b.cursor.streams.tolist()))) for b in step_on_ranks}
        assert len(cursors) == 1, "every rank must agree on the cursor after a step"
        placed = sorted(
            (ordinal, row["id"])
            for b in step_on_ranks
            for micro, ordinals in zip(b, b.indices)
            for row, ordinal in zip(micro, ordinals)
        )
        assert [o for o, _ in placed] == list(range(done * GLOBAL, (done + 1) * GLOBAL))
        ids.extend(i for _, i in placed)
        cursor = checkpoint(step_on_ranks[0].cursor)
        done += 1
    return ids, cursor


schedules = st.lists(st.tuples(st.integers(0, 4), st.sampled_from([1, 2, 4])), min_size=2, max_size=4)


@pytest.mark.parametrize("kind", ["plain", "filtered", "mixture"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
@example(schedule=[(3, 2), (2, 4), (4, 1), (5, 2)])
def test_resumed_stream_equals_the_uninterrupted_one_at_any_world_size(shards, kind, schedule):
    total = sum(n for n, _ in schedule)
    whole, end = run_segment(shards, kind, None, total, 1)
    got: list[int] = []
    cursor = None
    for steps, world in schedule:
        ids, cursor = run_segment(shards, kind, cursor, steps, world)
        got.extend(ids)
    assert got == whole
    if cursor is not None:  # the sample certificate (a rolling hash of the steps' sample ids) survives every resume
        assert sample_certificate(cursor) == sample_certificate(end) is not None


def test_an_epoch_is_a_permutation_of_every_row_and_the_seed_chooses_it(shards):
    def epoch(seed: int, e: int) -> list[int]:
        src = files(str(shards / "*.parquet"), seed=seed, shuffle_window=4)
        return [r["id"] for _, r in itertools.islice(src.rows(e * src.num_rows), src.num_rows)]

    assert sorted(epoch(0, 0)) == list(range(21))
    assert sorted(epoch(0, 1)) == list(range(21))
    assert epoch(0, 0) != epoch(0, 1) and epoch(0, 0) != epoch(1, 0)
    assert epoch(0, 0) == epoch(0, 0)
    unshuffled = files(str(shards / "*.parquet"), shuffle=False)
    assert [r["id"] for _, r in itertools.islice(unshuffled.rows(0), 21)] == list(range(21))


def test_every_format_streams_the_same_rows(shards):
    src = files([str(shards / "extra.arrow"), str(shards / "more.jsonl")], seed=0, shuffle_window=2)
    assert sorted(r["id"] for _, r in itertools.islice(src.rows(0), 11)) == [*range(1000, 1006), *range(2000, 2005)]


def test_resume_reads_only_the_blocks_under_its_window(tmp_path, monkeypatch):
    rows, group = 100_000, 1000
    pq.write_table(pa.table({"id": list(range(rows))}), tmp_path / "big.parquet", row_group_size=group)
    src = files(str(tmp_path / "big.parquet"), seed=0, shuffle_window=group)
    reads = []
    real = filestream._read_block
    monkeypatch.setattr(filestream, "_read_block", lambda shard, b, cols: reads.append(b) or real(shard, b, cols))
    position = 7 * rows + 54_321  # epoch 7
    first = next(src.rows(position))
    assert len(reads) <= 2, f"a resume read {len(reads)} row groups; it must read those under one window only"
    again = files(str(tmp_path / "big.parquet"), seed=0, shuffle_window=group)
    window_start = position - position % group
    window = [r for _, r in itertools.islice(again.rows(window_start), group)]
    assert first[1] == window[position % group]


# -- errors -----------------------------------------------------------------------------------------


def test_a_shard_changed_between_runs_is_refused(tmp_path):
    d = write_shards(tmp_path / "d")
    first = next(source_stream(make_source(d, "filtered"), per_device_train_batch_size=GLOBAL))
    pq.write_table(pa.table({"id": [99, 98], "text": ["x", "y"]}), d / "part-1.parquet")
    with pytest.raises(ShardChangedError, match="not those the checkpoint was trained on.*part-1.parquet' changed"):
        next(source_stream(make_source(d, "filtered"), per_device_train_batch_size=GLOBAL, start=first.cursor))
    pq.write_table(pa.table({"id": [97], "text": ["z"]}), d / "part-3.parquet")
    with pytest.raises(ShardChangedError, match="part-1.parquet' changed .*; shard '.*part-3.parquet' was added"):
        next(source_stream(make_source(d, "filtered"), per_device_train_batch_size=GLOBAL, start=first.cursor))


def test_a_shard_that_vanished_is_refused(tmp_path):
    d = write_shards(tmp_path / "d")
    first = next(source_stream(make_source(d, "plain"), per_device_train_batch_size=GLOBAL))
    (d / "part-2.parquet").unlink()
    with pytest.raises(ShardChangedError, match="trained on .*: 1 recorded shard is gone; restore them"):
        next(source_stream(make_source(d, "plain"), per_device_train_batch_size=GLOBAL, start=first.cursor))
    with pytest.raises(FileNotFoundError, match="part-2.parquet' does not exist"):
        files([str(d / "part-0.parquet"), str(d / "part-2.parquet")])


def test_a_shard_changed_during_the_run_is_refused(tmp_path):
    d = write_shards(tmp_path / "d")
    src = files(str(d / "*.parquet"), seed=0, shuffle_window=2)
    shutil.copy(d / "more.jsonl", d / "part-0.parquet")  # another size
    shutil.copy(d / "more.jsonl", d / "part-1.parquet")
    shutil.copy(d / "more.jsonl", d / "part-2.parquet")
    with pytest.raises(ShardChangedError, match="changed while the stream reads it"):
        next(src.rows(0))


def test_a_schema_mismatch_across_shards_is_refused(tmp_path):
    pq.write_table(pa.table({"id": [1, 2]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": ["1", "2"]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"another schema .*id: int64 vs string"):
        files(str(tmp_path / "*.parquet"))


def test_an_empty_filter_result_is_refused(shards):
    src = files(str(shards / "*.parquet"), seed=0, shuffle_window=4).filter(lambda r: r["id"] < 0)
    with pytest.raises(ValueError, match="kept none of the 21 rows of epoch"):
        next(source_stream(src, per_device_train_batch_size=2))


def test_a_glob_matching_nothing_and_a_mixture_starving_a_source_are_refused(shards):
    with pytest.raises(FileNotFoundError, match="no file matches"):
        files(str(shards / "*.csv"))
    src = files(str(shards / "*.parquet"))
    with pytest.raises(ValueError, match=r"gives sources \['b'\] no row"):
        next(source_stream(mix({"a": src, "b": src}, weights={"a": 9, "b": 1}), per_device_train_batch_size=2))
    with pytest.raises(ValueError, match="one weight per source"):
        mix({"a": src}, weights={"b": 1})


def test_a_cursor_of_a_map_style_dataset_is_refused(shards):
    with pytest.raises(ValueError, match="no stream positions"):
        next(
            source_stream(
                make_source(shards, "plain"), per_device_train_batch_size=2, start=Cursor(scalar(0), scalar(3))
            )
        )


# -- trainfold.train over a streaming source ----------------------------------------------------------


def token_shards(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(5)
    for k in range(3):
        ids = [
            torch.randint(0, 40, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(9)
        ]
        table = pa.table({"input_ids": ids, "labels": ids, "n": [len(i) for i in ids]})
        pq.write_table(table, d / f"tok-{k}.parquet", row_group_size=4)
    return d


def token_source(d: Path):
    src = files(str(d / "*.parquet"), seed=1, shuffle_window=5, columns=["input_ids", "labels", "n"])
    return src.filter(lambda r: r["n"] > 4).map(lambda r: {"input_ids": r["input_ids"], "labels": r["labels"]})


def test_train_on_a_source_resumed_twice_ends_bitwise_as_the_uninterrupted_run(tmp_path):
    from resume_fixture import model

    from trainfold import TrainingArguments, train

    d = token_shards(tmp_path / "shards")

    def args(out: Path) -> TrainingArguments:
        return TrainingArguments(
            output_dir=str(out),
            max_steps=6,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            report_to="none",
            disable_tqdm=True,
            save_strategy="steps",
            save_steps=2,
        )

    whole = train(model(), args(tmp_path / "whole"), token_source(d))
    for stop_at in (2, 4, None):  # two stops, two resumes
        stop = None if stop_at is None else (lambda s, n=stop_at: int(s.step) >= n)
        resumed = train(
            model(), args(tmp_path / "parts"), token_source(d), resume_from_checkpoint=stop_at != 2 or None, stop=stop
        )
    assert int(resumed.state.step) == int(whole.state.step) == 6
    assert resumed.state.cursor.streams.tolist() == whole.state.cursor.streams.tolist()
    for k, v in whole.state.params.items():
        assert torch.equal(v, resumed.state.params[k]), k


def test_streaming_doc_examples_run(tmp_path, monkeypatch):
    import re

    monkeypatch.chdir(tmp_path)
    page = Path(__file__).resolve().parents[1] / "docs" / "streaming.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {"__name__": "streaming_doc"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/streaming.md python block {i + 1}", "exec"), namespace)


def test_changed_mixture_weights_are_refused_on_resume(shards):
    def mixture(weights):
        a, b = files(str(shards / "part-0.parquet")), files(str(shards / "part-1.parquet"))
        return mix({"a": a, "b": b}, weights=weights)

    first = next(source_stream(mixture({"a": 1, "b": 1}), per_device_train_batch_size=4))
    with pytest.raises(ShardChangedError, match="or mixture weights changed"):
        next(source_stream(mixture({"a": 3, "b": 1}), per_device_train_batch_size=4, start=first.cursor))


def test_an_arrow_stream_file_as_datasets_caches_them_streams_and_seeks(tmp_path):
    table = pa.table({"id": list(range(30))})
    with pa.ipc.new_stream(str(tmp_path / "cache.arrow"), table.schema) as w:  # the IPC stream format
        for batch in table.to_batches(max_chunksize=7):
            w.write_batch(batch)
    src = files(str(tmp_path / "cache.arrow"), seed=2, shuffle_window=5)
    epoch = [r["id"] for _, r in itertools.islice(src.rows(30), 30)]
    assert sorted(epoch) == list(range(30))
    assert [r["id"] for _, r in itertools.islice(src.rows(30 + 17), 5)] == epoch[17:22]


def test_train_on_a_source_is_the_same_with_dataloader_workers(tmp_path):
    """``dataloader_num_workers=2`` reads the source in workers: the run ends bitwise as with none."""
    from resume_fixture import model

    from trainfold import TrainingArguments, train

    d = token_shards(tmp_path / "shards")
    ends = []
    for workers in (0, 2):
        args = TrainingArguments(
            output_dir=str(tmp_path / f"w{workers}"), max_steps=3, per_device_train_batch_size=2,
            dataloader_num_workers=workers, report_to="none", disable_tqdm=True, save_strategy="no",
        )  # fmt: skip
        ends.append(train(model(), args, token_source(d)).state)
    assert ends[0].cursor.streams.tolist() == ends[1].cursor.streams.tolist()
    for k, v in ends[0].params.items():
        assert torch.equal(v, ends[1].params[k]), k


def test_a_json_lines_shard_is_cut_into_blocks_and_a_resume_reads_one(tmp_path, monkeypatch):
    monkeypatch.setattr(filestream, "_JSON_BLOCK_BYTES", 200)
    lines = [json.dumps({"id": i, "text": "x" * (i % 7), "extra": None if i % 3 else i}) for i in range(200)]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n\n")  # a blank line at the end
    src = files(str(tmp_path / "rows.jsonl"), seed=0, shuffle_window=6)
    assert len(src.shards[0].blocks) > 20 and src.num_rows == 200
    epoch = [r for _, r in itertools.islice(src.rows(0), 200)]
    assert sorted(r["id"] for r in epoch) == list(range(200))
    assert all(r["extra"] == (None if r["id"] % 3 else r["id"]) for r in epoch)
    want = [r for _, r in itertools.islice(src.rows(200 + 123), 3)]
    reads = []
    real = filestream._read_block
    monkeypatch.setattr(filestream, "_read_block", lambda shard, b, cols: reads.append(b) or real(shard, b, cols))
    again = files(str(tmp_path / "rows.jsonl"), seed=0, shuffle_window=6)
    assert [r for _, r in itertools.islice(again.rows(200 + 123), 3)] == want
    assert 0 < len(reads) <= 3, f"a resume read {len(reads)} of {len(src.shards[0].blocks)} blocks"


def test_fsspec_urls_stream_the_same_rows_as_local_paths(shards):
    """``memory://`` (any fsspec URL) and ``file://`` shards: the same order, seek and fingerprint as local paths."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for path in sorted(shards.iterdir()):
        fs.pipe(f"/stream-test/{path.name}", path.read_bytes())
    for pattern in ("*.parquet", "extra.arrow", "more.jsonl"):
        here = files(str(shards / pattern), seed=2, shuffle_window=4)
        for url in (f"memory://stream-test/{pattern}", f"file://{shards}/{pattern}"):
            there = files(url, seed=2, shuffle_window=4)
            assert there.fingerprint() == here.fingerprint()
            assert list(itertools.islice(there.rows(3), 12)) == list(itertools.islice(here.rows(3), 12))
    fs.rm("/stream-test/part-1.parquet")
    with pytest.raises(FileNotFoundError, match="shard 'memory://stream-test/part-1.parquet' does not exist"):
        files(["memory://stream-test/part-0.parquet", "memory://stream-test/part-1.parquet"])
