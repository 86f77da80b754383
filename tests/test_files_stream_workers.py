"""A streaming source read in DataLoader workers (``dataloader_num_workers > 0``, issue 46): the same rows as 0 workers.

The property: for any schedule of (read n steps, checkpoint the cursor, change the world size among 1, 2 and
the workers among 0, 2, resume with freshly opened sources), the concatenated sample-id stream equals the
uninterrupted run's with 0 workers, with a filter, a map, a mixture and packing on. The ranks are simulated
in one process by dealing, as the other properties do; the workers are real processes.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("pyarrow")

import test_files_stream as flat
import test_files_stream_packed as packing

from trainfold.core.state import Cursor, sample_certificate
from trainfold.data import Sampler, files, source_steps
from trainfold.data.global_batch import split_global_batch
from trainfold.data.readers import Workers, read_rows


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return flat.write_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return packing.write_docs(tmp_path_factory.mktemp("docs"))


def run_segment(d: Path, kind: str, start: Cursor | None, steps: int, world: int, workers: int) -> tuple[list, Cursor]:
    """``steps`` steps on ``world`` ranks from ``start``, read by ``workers`` workers: the ids in order, the cursor."""
    per_device, accumulation = split_global_batch(flat.GLOBAL, world_size=world, per_device=2)
    done = 0 if start is None else start.as_tuple()[1]
    ranks = [
        source_steps(
            flat.make_source(d, kind),
            Sampler("sequential", None, per_device, accumulation, world, rank),
            lambda rows: rows,
            start=start,
            max_steps=done + steps,
            dataloader_num_workers=workers,
        )
        for rank in range(world)
    ]
    out: list = []
    cursor = start
    for step_on_ranks in zip(*ranks):
        assert len({str(b.cursor.streams.tolist()) for b in step_on_ranks}) == 1, "ranks agree on the cursor"
        placed = sorted((o, row["id"]) for b in step_on_ranks for m, os_ in zip(b, b.indices) for row, o in zip(m, os_))
        assert [o for o, _ in placed] == list(range(done * flat.GLOBAL, (done + 1) * flat.GLOBAL))
        out.extend(i for _, i in placed)
        cursor = flat.checkpoint(step_on_ranks[0].cursor)
        done += 1
    return out, cursor


schedules = st.lists(
    st.tuples(st.integers(0, 5), st.sampled_from([1, 2]), st.sampled_from([0, 2])), min_size=2, max_size=3
)


@pytest.mark.parametrize("kind", ["filtered", "mixture", "packed"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
@example(schedule=[(3, 2, 2), (4, 1, 0), (5, 1, 2)])
def test_a_stream_read_by_workers_and_resumed_equals_the_uninterrupted_one_with_no_workers(
    shards, docs, kind, schedule
):
    total = sum(n for n, _, _ in schedule)
    if kind == "packed":
        segment = packing.run_segment
        d = docs
    else:
        d = shards

        def segment(d, start, steps, world, workers):
            return run_segment(d, kind, start, steps, world, workers)

    whole, end = segment(d, None, total, 1, 0)
    got: list = []
    cursor = None
    for steps, world, workers in schedule:
        rows, cursor = segment(d, cursor, steps, world, workers)
        got.extend(rows)
    assert got == whole and len(whole) == total * flat.GLOBAL
    if total:  # the sample certificate (a rolling hash of the steps' ids) survives every resume
        assert sample_certificate(cursor) == sample_certificate(end) is not None


def test_with_workers_the_rows_are_read_and_mapped_in_worker_processes(shards):
    """``dataloader_num_workers=2`` is real: the windows are read and mapped in other processes, 0 reads here."""

    def pids(workers: int) -> tuple[set[int], set[int]]:
        src = files(str(shards / "*.parquet"), seed=3, shuffle_window=4).map(lambda r: {**r, "pid": os.getpid()})
        sampler = Sampler("sequential", None, 2, 2)
        steps = source_steps(
            src, sampler, lambda rows: (rows, os.getpid()), max_steps=6, dataloader_num_workers=workers
        )
        micro = [m for step in steps for m in step]
        return {row["pid"] for rows, _ in micro for row in rows}, {pid for _, pid in micro}

    assert pids(0) == ({os.getpid()}, {os.getpid()})
    mapped, collated = pids(2)
    assert os.getpid() not in mapped | collated and len(mapped) == len(collated) == 2


@pytest.mark.parametrize("kind", ["filtered", "mixture"])
def test_a_keyed_collator_gets_the_same_keys_and_a_global_rng_one_draws_the_same_with_any_workers(shards, kind):
    """A keyed collator sees the keys of 0 workers; one drawing from torch's generator draws, in a worker, from a
    generator seeded by its micro-batch: the same numbers for 1 or 2 workers and after a resume."""
    import torch

    from trainfold.data import keyed

    def steps(collate, workers: int, start=None, max_steps: int = 5):
        sampler = Sampler("sequential", None, 2, 2, 2, 1)  # rank 1 of 2
        src = flat.make_source(shards, kind)
        run = source_steps(src, sampler, collate, start=start, max_steps=max_steps, dataloader_num_workers=workers)
        return list(run)

    with_keys = keyed(lambda rows, keys: [(r["id"], k) for r, k in zip(rows, keys)])
    assert [list(s) for s in steps(with_keys, 0)] == [list(s) for s in steps(with_keys, 2)]
    draws = lambda rows: ([r["id"] for r in rows], torch.rand(2).tolist())
    two, one = steps(draws, 2), steps(draws, 1)
    resumed = steps(draws, 2, start=two[1].cursor)
    assert [list(s) for s in two] == [list(s) for s in one] and [list(s) for s in resumed] == [list(s) for s in two[2:]]
    assert [[m[0] for m in s] for s in two] == [[m[0] for m in s] for s in steps(draws, 0)]  # the rows: 0 workers'


def test_workers_seed_a_random_map_by_its_window_whatever_the_worker_count_or_the_resume(shards):
    """A map drawing from the global generators draws, in a worker, from generators seeded by its window."""
    import random

    src = files(str(shards / "*.parquet"), seed=3, shuffle_window=4).map(lambda r: (r["id"], random.random()))
    two = list(itertools.islice(read_rows(src, 0, Workers(num_workers=2)), 30))
    one = list(itertools.islice(read_rows(src, 0, Workers(num_workers=1)), 30))
    resumed = list(itertools.islice(read_rows(src, 9, Workers(num_workers=2)), 21))
    assert two == one and resumed == two[9:]


def test_an_empty_filter_is_refused_with_workers_too(shards):
    src = files(str(shards / "*.parquet"), seed=3, shuffle_window=4).filter(lambda r: r["id"] < 0)
    with pytest.raises(ValueError, match="kept none of the 21 rows of epoch 0 of the source"):
        next(read_rows(src, 0, Workers(num_workers=2)))


def test_a_source_without_windows_and_bad_worker_settings_are_refused():
    class Count:
        num_rows = 10

        def rows(self, start):
            return ((p + 1, p) for p in itertools.count(start))

    with pytest.raises(TypeError, match="dataloader_num_workers=2 reads a source's windows in workers, but a Count"):
        next(read_rows(Count(), 0, Workers(num_workers=2)))
    with pytest.raises(ValueError, match="dataloader_prefetch_factor needs dataloader_num_workers > 0"):
        Workers(num_workers=0, prefetch_factor=2)


def test_train_read_by_workers_and_resumed_twice_ends_bitwise_as_the_uninterrupted_run_with_none(tmp_path):
    """``train`` on a filtered, mapped source: sessions with 2, 0, then 2 workers end as one run with no worker."""
    import torch
    from resume_fixture import model

    from trainfold import TrainingArguments, train

    d = flat.token_shards(tmp_path / "shards")

    def args(out: Path, workers: int) -> TrainingArguments:
        return TrainingArguments(
            output_dir=str(out), max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-2, report_to="none", disable_tqdm=True, save_strategy="steps", save_steps=2,
            dataloader_num_workers=workers,
        )  # fmt: skip

    whole = train(model(), args(tmp_path / "whole", 0), flat.token_source(d))
    for stop_at, workers in ((2, 2), (4, 0), (None, 2)):
        stop = None if stop_at is None else (lambda s, n=stop_at: int(s.step) >= n)
        resumed = train(
            model(), args(tmp_path / "parts", workers), flat.token_source(d),
            resume_from_checkpoint=stop_at != 2 or None, stop=stop,
        )  # fmt: skip
    assert int(resumed.state.step) == int(whole.state.step) == 6
    assert resumed.state.cursor.streams.tolist() == whole.state.cursor.streams.tolist()
    for k, v in whole.state.params.items():
        assert torch.equal(v, resumed.state.params[k]), k
