"""A streaming source wired everywhere (issue 46.4): ``loop.run``'s data, the CLI's ``[data] train = "*.parquet"``,
and a ``datasets.IterableDataset`` read from files as ``train_dataset``; each resumed run ends as the uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from trainfold import init_state, loop, make_step, sgd  # noqa: E402
from trainfold.core.losses import causal_lm  # noqa: E402
from trainfold.core.models import TinyLM, TinyLMConfig  # noqa: E402
from trainfold.data import files, pad_collate, source_data  # noqa: E402


def token_shards(d: Path, text: bool = False) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(3)
    for k in range(3):
        lengths = torch.randint(3, 12, (9,), generator=g).tolist()
        ids = [torch.randint(0, 40, (n,), generator=g).tolist() for n in lengths]
        table = (
            pa.table({"text": ["".join(chr(97 + i % 26) for i in row) for row in ids]})
            if text
            else pa.table({"input_ids": ids, "labels": ids})
        )
        pq.write_table(table, d / f"part-{k}.parquet", row_group_size=4)
    return d


def tiny() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_len=16))


def loop_run(d: Path, out: Path, until: int, resume: bool):
    net = tiny()
    data = source_data(files(str(d / "*.parquet"), seed=1, shuffle_window=5), per_device_train_batch_size=4,
                       collate=pad_collate())  # fmt: skip
    return loop.run(make_step(net, causal_lm, sgd(0.1)), init_state(net, sgd(0.1)), data,
                    hooks=[loop.save(every=2)], stop=lambda s: int(s.step) >= until, output_dir=str(out),
                    resume=resume)  # fmt: skip


def test_loop_run_on_source_data_resumed_twice_ends_as_the_uninterrupted_run(tmp_path):
    d = token_shards(tmp_path / "shards")
    whole, _ = loop_run(d, tmp_path / "whole", 6, False)
    for until in (2, 4, 6):
        parts, log = loop_run(d, tmp_path / "parts", until, until > 2)
    assert log.resumed_from is not None and int(parts.step) == 6
    assert parts.cursor.streams.tolist() == whole.cursor.streams.tolist()
    assert whole.cursor.streams[0, 0].item() == 6 * 4
    for k, v in whole.params.items():
        assert torch.equal(v, parts.params[k]), k


def test_loop_run_refuses_a_bare_source_by_name(tmp_path):
    d = token_shards(tmp_path / "shards")
    net = tiny()
    with pytest.raises(TypeError, match="a streaming source has no batch size; pass data=trainfold.data.source_data"):
        loop.run(make_step(net, causal_lm, sgd(0.1)), init_state(net, sgd(0.1)), files(str(d / "*.parquet")))


CONFIG = {
    "model": {"type": "tinylm", "config": {"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 32}},
    "args": {
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "save_steps": 2,
        "report_to": [],
        "seed": 0,
        "lr_scheduler_type": "constant",
    },  # a stop by max_steps keeps the schedule,
}


@pytest.mark.parametrize("text", [False, True])
def test_the_cli_streams_a_glob_of_shards_and_resumes_exactly(tmp_path, capsys, text):
    from safetensors.torch import load_file

    from trainfold import ckpt
    from trainfold.cli.main import main

    d = token_shards(tmp_path / "shards", text=text)
    ends = {}
    for name, stops in (("whole", [4]), ("parts", [2, 4])):
        for stop in stops:
            config = {**CONFIG, "data": {"train": str(d / "*.parquet"), "seq_len": 16, "shuffle_window": 5}}
            config["args"] = {**CONFIG["args"], "output_dir": str(tmp_path / name), "max_steps": stop}
            (tmp_path / "run.json").write_text(json.dumps(config))
            assert main(["train", "--config", str(tmp_path / "run.json"), "--resume"]) == 0
            assert json.loads(capsys.readouterr().out.splitlines()[-1])["global_step"] == stop
        ends[name] = load_file(ckpt.latest_checkpoint(tmp_path / name) / "state.safetensors")
    assert ends["whole"]["cursor.streams"][0, 0].item() == 16  # 4 steps of 4 rows
    assert sorted(ends["whole"]) == sorted(ends["parts"])
    for k, v in ends["whole"].items():
        assert torch.equal(v, ends["parts"][k]), k


def test_a_datasets_stream_of_parquet_files_trains_on_its_rows_in_order_and_resumes_exactly(tmp_path):
    """``load_dataset("parquet", streaming=True)`` is read by ``files()``: datasets' order, a seekable cursor."""
    datasets = pytest.importorskip("datasets")
    from trainfold import TrainingArguments, train

    d = token_shards(tmp_path / "shards")
    seen: list[list[int]] = []

    def collate(rows):
        seen.append([len(r["input_ids"]) * 100 + r["input_ids"][0] for r in rows])
        return pad_collate()(rows)

    def dataset():
        return datasets.load_dataset("parquet", data_files=str(d / "*.parquet"), split="train", streaming=True)

    def args(out: Path) -> TrainingArguments:
        return TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2,
                                 report_to="none", disable_tqdm=True, save_strategy="steps", save_steps=2)  # fmt: skip

    whole = train(tiny(), args(tmp_path / "whole"), dataset(), data_collator=collate)
    expected = [len(r["input_ids"]) * 100 + r["input_ids"][0] for r in dataset()]
    assert [i for batch in seen for i in batch] == (expected * 2)[:24]  # datasets' order, into a second epoch
    assert whole.state.cursor.streams is not None and whole.state.cursor.streams[0, 0].item() == 24
    for stop_at in (2, 4, None):
        stop = None if stop_at is None else (lambda s, n=stop_at: int(s.step) >= n)
        parts = train(tiny(), args(tmp_path / "parts"), dataset(), data_collator=collate,
                      resume_from_checkpoint=stop_at != 2 or None, stop=stop)  # fmt: skip
    assert parts.state.cursor.streams.tolist() == whole.state.cursor.streams.tolist()
    for k, v in whole.state.params.items():
        assert torch.equal(v, parts.state.params[k]), k


def test_a_shuffled_or_mapped_datasets_stream_is_left_to_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    from trainfold.data import as_source

    d = token_shards(tmp_path / "shards")
    ds = datasets.load_dataset("parquet", data_files=str(d / "*.parquet"), split="train", streaming=True)
    assert type(as_source(ds)).__name__ == "FileSource"
    for other in (ds.shuffle(seed=1, buffer_size=4), ds.map(lambda r: r), ds.filter(lambda r: True)):
        assert as_source(other) is other
