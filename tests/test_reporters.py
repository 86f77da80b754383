"""Reporters: jsonl, tensorboard, trackio and wandb (offline) write records that read back; progress."""

from __future__ import annotations

import io
import json
import os
import select
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainfold.observe.reporters as reporters_module
from trainfold.core.state import TrainState, scalar
from trainfold.observe.reporters import (
    JsonlReporter,
    Reporters,
    installed_reporters,
    make_reporters,
    progress,
    tracker_key,
)
from trainfold.trainer.args import TrainingArguments

ENTRIES = [
    ({"loss": 2.5, "grad_norm": 1.25, "learning_rate": 0.001, "epoch": 0.5, "step": 2}, 2),
    ({"loss": 2.0, "grad_norm": 0.75, "learning_rate": 0.0005, "epoch": 1.0, "step": 4}, 4),
    ({"eval_loss": 1.75, "eval_accuracy": 0.5, "epoch": 1.0, "step": 4}, 4),
]


def log_all(reporters) -> None:
    for entry, step in ENTRIES:
        reporters.log(entry, step)


# -- jsonl ---------------------------------------------------------------------------------------


def test_jsonl_parses_line_by_line_and_appends_on_resume(tmp_path):
    with make_reporters("jsonl", tmp_path) as reporters:
        log_all(reporters)
    with make_reporters(["jsonl"], tmp_path) as reporters:  # a resumed run appends
        reporters.log({"loss": float("nan"), "step": 6}, 6)
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [e for e, _ in ENTRIES] + [{"loss": None, "step": 6}]


@settings(max_examples=30, deadline=None)
@given(
    entry=st.dictionaries(
        st.text(min_size=1, max_size=8), st.floats(allow_nan=False, allow_infinity=False), max_size=5
    ),
    step=st.integers(0, 10**6),
)
def test_jsonl_round_trips_any_entry(tmp_path_factory, entry, step):
    path = tmp_path_factory.mktemp("j") / "log.jsonl"
    reporter = JsonlReporter(path)
    reporter.log(entry, step)
    reporter.close()
    reporter.close()
    assert json.loads(path.read_text()) == {**entry, "step": step}


def test_jsonl_refuses_to_log_after_close(tmp_path):
    reporter = JsonlReporter(tmp_path / "log.jsonl")
    reporter.close()
    with pytest.raises(ValueError, match="is closed"):
        reporter.log({"loss": 1.0}, 1)


# -- tensorboard ---------------------------------------------------------------------------------


def test_tensorboard_event_file_holds_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with make_reporters(["tensorboard"], tmp_path, run_name="r1", config={"lr": 0.001}) as reporters:
        log_all(reporters)
    acc = EventAccumulator(str(tmp_path / "runs" / "r1"))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    expected: dict[str, list] = {}
    for entry, step in ENTRIES:
        for key, value in entry.items():
            if key != "step":
                expected.setdefault(tracker_key(key), []).append((step, pytest.approx(value, rel=1e-6)))
    assert scalars == expected


def _tensorboard_run(log_dir: Path) -> tuple[dict[str, list], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = [
        t.tensor_proto.string_val[0].decode()
        for tag in acc.Tags()["tensors"]
        if tag.startswith("args")
        for t in acc.Tensors(tag)
    ]
    return scalars, texts


def tiny_run(output_dir: Path, **settings):
    from trainfold.core.models import TinyLM, TinyLMConfig
    from trainfold.trainer.train import train

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=4,
        per_device_train_batch_size=2,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        log_level="error",
        **settings,
    )
    return train(model, args, rows)


def test_tensorboard_run_directory_is_the_run_name_or_logging_dir_with_the_args_logged_once(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    tiny_run(tmp_path / "a", report_to="tensorboard", run_name="exp1", learning_rate=0.01)
    scalars, texts = _tensorboard_run(tmp_path / "a" / "runs" / "exp1")
    assert [step for step, _ in scalars["train/loss"]] == [2, 4]
    assert len(texts) == 1 and json.loads(texts[0])["learning_rate"] == 0.01
    assert json.loads(texts[0])["run_name"] == "exp1"
    tiny_run(tmp_path / "b", report_to="tensorboard", logging_dir=str(tmp_path / "tb"))
    assert _tensorboard_run(tmp_path / "tb")[0]["train/loss"] and not (tmp_path / "b" / "runs").exists()
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "env"))  # HF 5's way
    tiny_run(tmp_path / "c", report_to="tensorboard")
    assert _tensorboard_run(tmp_path / "env")[0]["train/loss"]


# -- trackio (local) -----------------------------------------------------------------------------


def test_trackio_writes_a_local_project(tmp_path):
    pytest.importorskip("trackio")
    script = textwrap.dedent(
        f"""
        import json
        from trainfold.observe.reporters import make_reporters
        with make_reporters(["trackio"], {str(tmp_path)!r}, run_name="r1", config={{"lr": 0.001}}) as r:
            for entry, step in {ENTRIES!r}:
                r.log(entry, step)
        from trackio.sqlite_storage import SQLiteStorage
        print("LOGS=" + json.dumps(SQLiteStorage.get_logs("proj", "r1")))
        print("CONFIG=" + json.dumps(SQLiteStorage.get_run_config("proj", "r1")))
        """
    )
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TRACKIO_PROJECT": "proj"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in done.stdout.splitlines() if "=" in line}
    logs = json.loads(printed["LOGS"])  # whole lines: a logged value may hold the script's own text
    assert (tmp_path / "trackio" / "proj.db").exists()
    assert [(row["step"], row.get("train/loss")) for row in logs if "train/loss" in row] == [(2, 2.5), (4, 2.0)]
    assert any(row.get("eval/accuracy") == 0.5 and row["step"] == 4 for row in logs)
    config = json.loads(printed["CONFIG"])
    assert config["lr"] == 0.001  # the hyperparameters, logged once at the start


# -- wandb (offline) -----------------------------------------------------------------------------


def read_wandb_records(path: Path) -> list[bytes]:
    """Read a .wandb file: a 7-byte header, then a LevelDB-style log of 32 KiB blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start, MIDDLE/LAST extend
        if kind in (1, 4):
            records.append(pending)
    return records


def test_wandb_offline_writes_its_run_records(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_PROJECT": "proj",
        "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
    }.items():
        monkeypatch.setenv(name, value)
    with make_reporters(["wandb"], tmp_path, run_name="r1", config={"lr": 0.001}) as reporters:
        run_dir = reporters.members[0].run_dir
        log_all(reporters)
    # run.finish() can return before wandb's service process has written the transaction log to
    # disk (measured: 1 run in 3 still had only the 7-byte header); teardown waits for it.
    wandb.teardown()
    assert run_dir is not None and run_dir.is_relative_to(tmp_path / "wandb")
    (log_file,) = run_dir.glob("run-*.wandb")
    history, configs = [], []
    for raw in read_wandb_records(log_file):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            configs += [(item.key, json.loads(item.value_json)) for item in items if item.key == "lr"]
        if kind == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    train = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert train == [(2, 2.5), (4, 2.0)]
    assert any(h.get("eval/accuracy") == 0.5 for h in history)
    assert configs and all(value in (0.001, {"value": 0.001}) for _, value in configs)  # the hyperparameters


# -- the factory and the group -------------------------------------------------------------------


def test_none_and_all(tmp_path, monkeypatch):
    assert len(make_reporters("none", tmp_path)) == 0
    assert len(make_reporters(None, tmp_path)) == 0
    monkeypatch.setattr(reporters_module.importlib.util, "find_spec", lambda name: None)
    assert installed_reporters() == ["jsonl"]
    with make_reporters("all", tmp_path) as reporters:
        assert [type(r).__name__ for r in reporters] == ["JsonlReporter"]


def test_unknown_and_missing_reporters_are_reported_at_once(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown reporter 'mlflow'(.|\n)*unknown reporter 'comet'"):
        make_reporters(["jsonl", "mlflow", "comet"], tmp_path)
    monkeypatch.setattr(reporters_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"'wandb' needs the wandb package.*pip install 'trainfold\[tracking\]'"):
        make_reporters(["wandb"], tmp_path)
    with pytest.raises(ValueError, match="mixes 'none'"):
        make_reporters(["none", "jsonl"], tmp_path)
    assert not (tmp_path / "log.jsonl").exists()  # nothing started before the names were checked


class Closable:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.closed = fail, False

    def log(self, entry, step) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        if self.fail:
            raise OSError("disk gone")


def test_reporters_are_closed_when_training_raises(tmp_path):
    jsonl = JsonlReporter(tmp_path / "log.jsonl")
    members = (Closable(fail=True), jsonl, Closable())
    with pytest.raises(RuntimeError, match="step failed") as info:
        with Reporters(members):
            raise RuntimeError("step failed")
    assert members[0].closed and members[2].closed and jsonl._file is None
    assert "closing the reporters also failed: OSError('disk gone')" in info.value.__notes__[0]
    with pytest.raises(OSError, match="disk gone"):  # without a training error, the close error shows
        Reporters((Closable(fail=True), Closable())).close()


def test_a_reporter_failing_to_start_closes_those_started(tmp_path, monkeypatch):
    started: list[Closable] = []

    def make(name, *args):
        if name == "tensorboard":
            raise ImportError("boom")
        started.append(Closable())
        return started[-1]

    monkeypatch.setattr(reporters_module, "_make", make)
    monkeypatch.setattr(reporters_module.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ImportError, match="boom"):
        make_reporters(["jsonl", "tensorboard"], tmp_path)
    assert [c.closed for c in started] == [True]


# -- progress ------------------------------------------------------------------------------------


def progress_state(step: int, loss: float) -> TrainState:
    metrics = {"loss": torch.tensor(loss), "learning_rate": torch.tensor(1e-3), "grad_norm": torch.tensor(0.0)}
    return TrainState(params={}, buffers={}, opt_state=None, step=scalar(step), metrics=metrics)


def test_plain_progress_line_shows_step_loss_and_rate():
    out, now = io.StringIO(), iter([0.0, 1.0, 2.0, 3.0])
    with progress(10, bar=True, stream=out, use_tqdm=False, clock=lambda: next(now), min_interval=0) as bar:
        bar.update(progress_state(1, 2.5))
        bar.update(progress_state(4, 1.25))
    text = out.getvalue()
    assert "step 1/10  loss 2.5  lr 0.001  1 step/s" in text
    assert "step 4/10  loss 1.25  lr 0.001  2 step/s" in text
    assert text.endswith("\n") and not bar.enabled


def test_progress_draws_no_bar_without_a_terminal_and_nothing_when_off():
    out = io.StringIO()
    quiet = progress(10, stream=out)
    quiet.update(progress_state(1, 1.0))
    quiet.close()
    off = progress(10, enabled=False, stream=out, use_tqdm=False)
    off.update(progress_state(1, 1.0))
    assert out.getvalue() == ""


def test_tqdm_progress():
    pytest.importorskip("tqdm")
    out = io.StringIO()
    bar = progress(5, bar=True, stream=out, use_tqdm=True)
    for k in range(1, 6):
        bar.update(progress_state(k, 1.0 / k))
    bar.close()
    bar.close()
    assert "5/5" in out.getvalue() and "loss=0.2" in out.getvalue()


def test_without_a_terminal_each_log_and_evaluation_is_one_line():
    out, now = io.StringIO(), iter([0.0, 1.0, 2.0, 4.0, 5.0])
    console = progress(10, stream=out, clock=lambda: next(now))
    for step in (1, 2, 4):
        console.update(progress_state(step, 1.0))
        if step == 2:
            console.log({"loss": 2.5, "grad_norm": 0.75, "learning_rate": 1e-3, "epoch": 0.2, "step": 2}, step=2)
    console.log({"loss": 1.5, "grad_norm": 0.5, "learning_rate": 5e-4, "rewards/margins": 0.25, "step": 4}, step=4)
    console.log({"eval_loss": 1.75, "eval_accuracy": 0.5, "epoch": 0.4, "step": 4}, step=4)
    console.log({"train_runtime": 5.0, "train_loss": 2.0, "step": 4}, step=4)
    console.close()
    assert out.getvalue().splitlines() == [
        "step 2/10  loss 2.5  lr 0.001  grad_norm 0.75  epoch 0.2  elapsed 0:02  eta 0:08",
        "step 4/10  loss 1.5  lr 0.0005  grad_norm 0.5  rewards/margins 0.25  elapsed 0:04  eta 0:06",
        "eval step 4/10  eval_loss 1.75  eval_accuracy 0.5  epoch 0.4",
        "done step 4/10  train_runtime 5  train_loss 2",
    ]


def test_tokens_per_second_counts_the_labelled_tokens_of_each_step():
    out, now = io.StringIO(), iter([0.0, 1.0, 2.0, 2.0])
    console = progress(None, stream=out, clock=lambda: next(now))
    for step in (1, 2):
        state = progress_state(step, 1.0)
        state = attrs.evolve(state, metrics={**state.metrics, "num_items": torch.tensor(300.0)})
        console.update(state)
    console.update(state)  # a step that did not advance the state (all labels ignored) counts once
    console.log({"loss": 1.0, "step": 2}, step=2)
    assert out.getvalue() == "step 2  loss 1  tokens/s 300  elapsed 0:02\n"


def test_with_a_bar_the_log_lines_are_written_above_it():
    pytest.importorskip("tqdm")
    out = io.StringIO()
    out.isatty = lambda: True  # a terminal: the bar, with the lines above it
    with progress(4, stream=out) as bar:
        bar.update(progress_state(2, 1.0))
        bar.log({"eval_loss": 0.625, "step": 2}, step=2)
        bar.update(progress_state(4, 1.0))
    text = out.getvalue()
    assert "eval step 2/4  eval_loss 0.625\n" in text and "4/4" in text.split("eval_loss 0.625")[1]


@pytest.mark.parametrize(
    ("log_level", "disable_tqdm", "shown"),
    [
        ("passive", None, "lines"),
        ("info", True, "lines"),
        ("warning", True, "nothing"),
        ("warning", False, "bar"),
        ("error", False, "nothing"),
        ("critical", None, "nothing"),
    ],
)
def test_log_level_and_disable_tqdm_as_in_hf(log_level, disable_tqdm, shown):
    pytest.importorskip("tqdm")
    out = io.StringIO()
    with progress(4, stream=out, log_level=log_level, bar=None if disable_tqdm is None else not disable_tqdm) as bar:
        bar.update(progress_state(1, 1.0))
        bar.log({"loss": 1.0, "step": 1}, step=1)
    text = out.getvalue()
    got = "nothing" if not text else "bar" if "1/4 [" in text and "loss 1.0" not in text else "lines"
    assert got == shown, text


def test_a_bad_log_level_is_refused():
    with pytest.raises(ValueError, match="log_level='loud' is not one of"):
        progress(4, log_level="loud")
    with pytest.raises(ValueError, match="log_level='loud'"):
        TrainingArguments(log_level="loud")


_PIPED_RUN = """
import sys, tempfile, torch
from trainfold import TrainingArguments, train
from trainfold.core.models import TinyLM, TinyLMConfig
torch.manual_seed(0)
model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(12)]
def wait_at_5(state):  # the parent reads the lines of steps 1-4 while this process still runs
    if int(state.step) == 5:
        sys.stdin.readline()
    return False
args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=8, per_device_train_batch_size=2,
                         learning_rate=1e-2, logging_steps=2, eval_strategy="steps", eval_steps=4, save_strategy="no")
train(model, args, rows, rows[:4], stop=wait_at_5)
"""


def test_a_run_writing_to_a_pipe_prints_each_log_as_it_happens(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _PIPED_RUN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        early, pending, fd = [], "", proc.stderr.fileno()
        while not early or not early[-1].startswith("eval step 4/8"):
            if "\n" in pending:  # read the fd ourselves: a buffered readline could hold a line select cannot see
                line, pending = pending.split("\n", 1)
                early.append(line)
                continue
            ready, _, _ = select.select([fd], [], [], 60)
            assert ready, f"no console line within 60 s while the run is waiting at step 5; got {early}"
            chunk = os.read(fd, 1 << 16).decode()
            assert chunk, f"stderr closed early: {early}"
            pending += chunk
        assert proc.poll() is None  # still running: the lines came as the run went
        proc.stdin.write("go\n")
        proc.stdin.close()
        rest = (pending + proc.stderr.read()).splitlines()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [ln for ln in early + rest if ln.startswith(("step ", "eval ", "done "))]
    assert [ln.split("  ")[0] for ln in lines] == [
        "step 2/8",
        "step 4/8",
        "eval step 4/8",
        "step 6/8",
        "step 8/8",
        "eval step 8/8",
        "done step 8/8",
    ]
    train_line = lines[0].split("  ")
    assert [part.split(" ")[0] for part in train_line[1:]] == [
        "loss",
        "lr",
        "grad_norm",
        "epoch",
        "tokens/s",
        "elapsed",
        "eta",
    ]
    assert "eval_loss" in lines[2] and "train_loss" in lines[-1]
