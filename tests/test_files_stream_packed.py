"""Packing a streaming source inside fixed windows before the global batch is dealt (issue 46.2): elastic and exact.

The property: for any schedule of (read n steps, checkpoint the cursor, change the world size among 1, 2, 4
and the DataLoader workers among 0, 2, resume with freshly opened sources) repeated k >= 2 times, the
concatenated stream of packed rows (and the document ids in them) equals the uninterrupted one, with a
filter, a map, a mixture and packing on.
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from trainfold.core.state import Cursor, sample_certificate  # noqa: E402
from trainfold.data import Sampler, ShardChangedError, files, mix, packed, source_steps  # noqa: E402
from trainfold.data.global_batch import split_global_batch  # noqa: E402
from trainfold.data.mixture import global_batches  # noqa: E402
from trainfold.data.packing import pack  # noqa: E402

GLOBAL = 4  # packed rows per optimizer step


def write_docs(d: Path) -> Path:
    """Three Parquet shards of token documents (3 to 9 tokens); ``doc`` repeats the document's id per token."""
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(11)
    for k, n in enumerate((9, 7, 11)):
        ids = [100 * k + i for i in range(n)]
        lengths = torch.randint(3, 10, (n,), generator=g).tolist()
        tokens = [torch.randint(1, 50, (m,), generator=g).tolist() for m in lengths]
        table = pa.table({"input_ids": tokens, "doc": [[i] * m for i, m in zip(ids, lengths)], "id": ids})
        pq.write_table(table, d / f"docs-{k}.parquet", row_group_size=3)
    return d


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return write_docs(tmp_path_factory.mktemp("docs"))


def make_stream(d: Path):
    """A fresh packed stream (as a new process opens it): a filtered, mapped mixture, packed to 12 tokens."""
    a = files([str(d / "docs-0.parquet"), str(d / "docs-1.parquet")], seed=3, shuffle_window=4)
    b = files(str(d / "docs-2.parquet"), seed=4, shuffle_window=5)
    a = a.filter(lambda r: r["id"] % 4 != 1).map(lambda r: {"input_ids": r["input_ids"], "doc": r["doc"]})
    b = b.map(lambda r: {"input_ids": r["input_ids"], "doc": r["doc"]})
    return packed(mix({"a": a, "b": b}, weights={"a": 2, "b": 1}, seed=2), max_length=12, window=6)


def checkpoint(cursor: Cursor) -> Cursor:
    """Round-trip a cursor through bytes, as a checkpoint does."""
    buf = io.BytesIO()
    torch.save({"epoch": cursor.epoch, "position": cursor.position, "streams": cursor.streams}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    return Cursor(saved["epoch"], saved["position"], saved["streams"])


def documents(row: dict) -> tuple[int, ...]:
    """The ids of the documents packed into a row, in order."""
    return tuple(k for k, _ in itertools.groupby(row["doc"]))


def run_segment(d: Path, start: Cursor | None, steps: int, world: int, workers: int) -> tuple[list, Cursor | None]:
    """``steps`` steps on ``world`` ranks from ``start``: each packed row's documents in step order, and the cursor."""
    per_device, accumulation = split_global_batch(GLOBAL, world_size=world, per_device=2)
    done = 0 if start is None else start.as_tuple()[1]
    ranks = [
        list(
            source_steps(
                make_stream(d),
                Sampler("sequential", None, per_device, accumulation, world, rank),
                lambda rows: rows,
                start=start,
                max_steps=done + steps,
                dataloader_num_workers=workers,
            )
        )
        for rank in range(world)
    ]
    out: list = []
    cursor = start
    for step_on_ranks in zip(*ranks):
        assert len({str(b.cursor.streams.tolist()) for b in step_on_ranks}) == 1, "ranks agree on the cursor"
        placed = sorted(
            (o, documents(row))
            for b in step_on_ranks
            for micro, ordinals in zip(b, b.indices)
            for row, o in zip(micro, ordinals)
        )
        assert [o for o, _ in placed] == list(range(done * GLOBAL, (done + 1) * GLOBAL))
        out.extend(p for _, p in placed)
        cursor = checkpoint(step_on_ranks[0].cursor)
        done += 1
    return out, cursor


schedules = st.lists(
    st.tuples(st.integers(0, 5), st.sampled_from([1, 2, 4]), st.sampled_from([0, 2])), min_size=2, max_size=4
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
@example(schedule=[(3, 2, 2), (1, 4, 0), (5, 1, 2), (4, 2, 0)])
def test_a_packed_stream_resumed_at_any_world_size_and_workers_equals_the_uninterrupted_one(docs, schedule):
    whole, end = run_segment(docs, None, sum(n for n, _, _ in schedule), 1, 0)
    got: list = []
    cursor = None
    for steps, world, workers in schedule:
        rows, cursor = run_segment(docs, cursor, steps, world, workers)
        got.extend(rows)
    assert got == whole
    if cursor is not None:  # the sample certificate (a rolling hash of the steps' rows) survives every resume
        assert sample_certificate(cursor) == sample_certificate(end) is not None


def test_each_window_of_documents_is_packed_as_trl_packs_it(docs):
    """The packed rows are ``pack`` (TRL's bfd) of each window of the unpacked stream, in order."""
    stream = make_stream(docs)
    windows = global_batches(stream.source, 6)
    expected = [documents(r) for rows, _ in itertools.islice(windows, 3) for r in pack(rows, 12, window=6)]
    got = itertools.islice(global_batches(stream, 3), len(expected) // 3)
    flat = [documents(r) for rows, _ in got for r in rows]
    assert flat == expected[: len(flat)] and len(flat) >= 6
    everything = [i for r in flat for i in r]
    assert len(everything) == len(set(everything)), "no document is packed twice (3 windows: within the epoch)"


def test_other_packing_settings_are_refused_on_resume(docs):
    _, after = next(global_batches(make_stream(docs), GLOBAL))
    other = packed(make_stream(docs).source, max_length=16, window=6)
    with pytest.raises(ShardChangedError, match="max_length=16, window=6"):
        next(global_batches(other, GLOBAL, after))


def test_packed_refuses_what_it_cannot_pack(docs):
    with pytest.raises(TypeError, match="packed\\(\\) takes a trainfold.data.files"):
        packed([{"input_ids": [1]}], max_length=4)
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        packed(files(str(docs / "docs-0.parquet")), max_length=4, window=0)


def tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def token_source(d: Path):
    return (
        files(str(d / "*.parquet"), seed=1, shuffle_window=5, columns=["input_ids", "id"])
        .filter(lambda r: r["id"] % 4 != 1)
        .map(lambda r: {"input_ids": r["input_ids"]})
    )


def test_train_with_packing_on_a_source_resumed_twice_ends_bitwise_as_the_uninterrupted_run(docs, tmp_path):
    """``train(..., packing=True)`` on a source packs it as it streams (no refusal), and resumes exactly."""
    from trainfold import TrainingArguments, train

    def args(out: Path, accumulation: int) -> TrainingArguments:
        return TrainingArguments(
            output_dir=str(out), max_steps=6, per_device_train_batch_size=4 // accumulation,
            gradient_accumulation_steps=accumulation, learning_rate=1e-2, report_to="none", disable_tqdm=True,
            save_strategy="steps", save_steps=2, packing=True, max_length=12,
        )  # fmt: skip

    whole = train(tiny_llama(), args(tmp_path / "whole", 1), token_source(docs))
    for stop_at in (2, 4, None):  # two stops, two resumes
        stop = None if stop_at is None else (lambda s, n=stop_at: int(s.step) >= n)
        resumed = train(
            tiny_llama(), args(tmp_path / "parts", 1), token_source(docs),
            resume_from_checkpoint=stop_at != 2 or None, stop=stop,
        )  # fmt: skip
    assert int(resumed.state.step) == int(whole.state.step) == 6
    assert resumed.state.cursor.streams.tolist() == whole.state.cursor.streams.tolist()
    # the windows' cursor (the source's position, its 3 shards' records, their certificate), the window, the packed
    # rows taken of it, the steps' certificate
    assert resumed.state.cursor.streams.shape == (1 + 4 + 1 + 3, 2)
    for k, v in whole.state.params.items():
        assert torch.equal(v, resumed.state.params[k]), k
