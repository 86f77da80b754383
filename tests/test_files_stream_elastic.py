"""A run on a streaming source under torchrun (gloo), resumed at other world sizes: 2 ranks -> 1 -> 2 (issue 46.3).

The same command (``per_device_train_batch_size=2``, ``gradient_accumulation_steps=2``: a global batch of 8 on
2 ranks) trains a filtered, mapped mixture of Parquet shards, stopping at steps 2 and 4 and resuming each
time from the last checkpoint, on 2 ranks, then one (accumulation 4, keeping the global batch), then 2
again. Every rank's collator records the ids of each micro-batch it gets; the steps' sets of ids, concatenated
over the sessions, equal those of one uninterrupted process (``TRAINFOLD_SLOW=full``: a torchrun job of its own;
reduced: after the one-rank session, in its job). Run as a script, this file is the worker::

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/test_files_stream_elastic.py OUT NAME STOP ...

(each NAME STOP pair a ``train`` call, in order).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torchrun import torchrun_ok

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SESSIONS = (("s1", 2, 2), ("s2", 1, 4), ("s3", 2, 6))  # name, ranks, the step it stops at
GLOBAL = 8


def write_shards(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(5)
    for k in range(3):
        ids = [
            torch.randint(0, 40, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(13)
        ]
        table = pa.table({"input_ids": ids, "id": list(range(100 * k, 100 * k + 13))})
        pq.write_table(table, d / f"tok-{k}.parquet", row_group_size=4)


def source(d: Path):
    from trainfold.data import files, mix

    def rows(pattern: str, seed: int):
        src = files(str(d / pattern), seed=seed, shuffle_window=5)
        return src.filter(lambda r: len(r["input_ids"]) > 4).map(lambda r: {**r, "labels": list(r["input_ids"])})

    return mix({"a": rows("tok-[01].parquet", 1), "b": rows("tok-2.parquet", 2)}, weights={"a": 3, "b": 1}, seed=4)


class Recording:
    """Pads a micro-batch and appends its rows' ids to this rank's file."""

    def __init__(self, path: Path) -> None:
        from trainfold.data import pad_collate

        self.path, self.pad = path, pad_collate()

    def __call__(self, rows: list[dict]) -> dict:
        with open(self.path, "a") as f:
            f.write(json.dumps([r["id"] for r in rows]) + "\n")
        return self.pad([{k: v for k, v in r.items() if k != "id"} for r in rows])


def _worker(out: Path, name: str, stop_at: int) -> None:
    from trainfold import TrainingArguments, train
    from trainfold.core.models import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_len=24))
    rank = int(os.environ["RANK"])
    args = TrainingArguments(
        output_dir=str(out / ("whole" if name == "whole" else "run")),
        max_steps=6,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4 if name == "whole" else 2,
        save_strategy="no" if name == "whole" else "steps",
        save_steps=2,
        learning_rate=1e-2,
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,  # the collator reads each row's id, then drops it
    )
    result = train(
        model,
        args,
        source(out / "shards"),
        data_collator=Recording(out / f"{name}-{rank}.jsonl"),
        resume_from_checkpoint=True if name in ("s2", "s3") else None,
        stop=lambda s: s.step >= stop_at,
    )
    if rank == 0:
        report = {"world": int(os.environ["WORLD_SIZE"]), "step": result.global_step}
        report["streams"] = result.state.cursor.streams.tolist()
        (out / f"{name}.json").write_text(json.dumps(report))


def steps_of(out: Path, name: str, ranks: int) -> list[list[int]]:
    """Each step's sorted ids, gathered from the ranks' files (a rank has GLOBAL / 2 / ranks micro-batches a step)."""
    per_step = GLOBAL // 2 // ranks
    lines = [[json.loads(x) for x in (out / f"{name}-{r}.jsonl").read_text().splitlines()] for r in range(ranks)]
    n = len(lines[0]) // per_step
    assert all(len(rank_lines) == n * per_step for rank_lines in lines)
    return [sorted(i for rl in lines for mb in rl[s * per_step : (s + 1) * per_step] for i in mb) for s in range(n)]


@pytest.mark.slow  # four torchrun launches (reduced: three)
def test_a_source_resumed_on_2_then_1_then_2_ranks_reads_the_rows_of_one_uninterrupted_process(tmp_path, full_slow):
    write_shards(tmp_path / "shards")
    jobs = [(nproc, [name, stop_at]) for name, nproc, stop_at in SESSIONS] + [(1, ["whole", 6])]
    if not full_slow:  # the uninterrupted process after the one-rank session, in its job
        jobs = [jobs[0], (1, jobs[1][1] + jobs[3][1]), jobs[2]]
    for nproc, calls in jobs:
        torchrun_ok(__file__, tmp_path, *calls, nproc=nproc)
    whole = steps_of(tmp_path, "whole", 1)
    resumed = [step for name, nproc, _ in SESSIONS for step in steps_of(tmp_path, name, nproc)]
    assert len(whole) == 6 and all(len(s) == GLOBAL for s in whole)
    assert resumed == whole
    names = [name for name, _, _ in SESSIONS] + ["whole"]
    reports = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    assert [reports[n]["world"] for n, _, _ in SESSIONS] == [2, 1, 2]
    assert reports["s3"]["step"] == reports["whole"]["step"] == 6
    assert reports["s3"]["streams"] == reports["whole"]["streams"]


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, stop_at in zip(sys.argv[2::2], sys.argv[3::2]):
        _worker(Path(sys.argv[1]), name, int(stop_at))
