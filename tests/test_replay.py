"""replay(output_dir, step=k): the logged loss bitwise, a checkpoint's params bitwise, the rows the run read
for that step (the oracle: the indices the dataset served during the run), and the CLI form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainfold import TrainingArguments, ckpt
from trainfold.cli.main import main
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.tree import flatten
from trainfold.trainer.replay import replay
from trainfold.trainer.train import train

STEPS, BATCH, ACCUMULATION = 7, 2, 2


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8, dropout=0.1))


class Logged(torch.utils.data.Dataset):
    """Rows of varying length that record which index was read, in order."""

    def __init__(self, n: int) -> None:
        self.rows = [{"input_ids": [(i + j) % 16 for j in range(2 + i % 4)]} for i in range(n)]
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        self.read.append(int(i))
        return {**self.rows[i], "labels": self.rows[i]["input_ids"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    data = Logged(21)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=3e-2,
        logging_steps=1,
        save_steps=3,
        report_to="none",
        disable_tqdm=True,
    )
    train(_model(), args, data)
    assert data.read[:2] == [0, 0]
    served = data.read[2:]  # train looks at row 0 twice before the first step (the input checks, its columns)
    entries = map(json.loads, (out / "log_history.jsonl").read_text().splitlines())
    logged = {e["step"]: e["loss"] for e in entries if "loss" in e}  # the summary entry has train_loss
    return out, served, logged


def test_replayed_losses_are_the_logged_ones_bitwise_and_the_rows_are_the_ones_the_run_read(run):
    out, served, logged = run
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = []
    for step in range(1, STEPS + 1):
        again = replay(out, step, model=model, train_dataset=Logged(21))
        assert again.loss == logged[step] and again.logged_loss == logged[step]
        assert int(again.state.step) == step and 1 <= len(again.rows) <= ACCUMULATION
        rows += [i for micro in again.rows for i in micro]
        start = max((c for c in (3, 6) if c < step), default=None)
        assert (again.start.name if again.start else None) == (f"checkpoint-{start}" if start else None)
    # every step's rows, in the order the run read them; after its last step the run has also read the epoch's next
    # micro-batch, which it collates ahead as HF's loader does (data.stream collate_ahead)
    assert rows == served[: len(rows)] and len(served) - len(rows) in (0, BATCH)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model is left alone


def test_replaying_to_a_checkpoints_step_gives_its_state_bitwise(run):
    out, _, _ = run
    again = replay(out, 6, model=_model(), train_dataset=Logged(21))
    saved = flatten(ckpt.load(out / "checkpoint-6", like=again.state))
    mine = flatten(again.state)
    assert again.start == out / "checkpoint-3"
    compared = [k for k in saved if not k.startswith(("metrics.", "extras."))]  # extras: the logging's marks
    assert any(k.startswith("params.") for k in compared) and any(k.startswith("opt_state.") for k in compared)
    for key in compared:
        assert torch.equal(saved[key], mine[key]), key


def test_bad_steps_are_refused_by_name(run):
    out, _, _ = run
    with pytest.raises(ValueError, match="step must be >= 1"):
        replay(out, 0, model=_model(), train_dataset=Logged(21))
    with pytest.raises(ValueError, match=f"has {STEPS} steps; there is no step 400"):
        replay(out, 400, model=_model(), train_dataset=Logged(21))


def test_the_cli_prints_the_rows_of_a_step(tmp_path: Path, capsys):
    config = {
        "model": {
            "type": "tinylm",
            "config": {"vocab_size": 256, "d_model": 8, "n_layers": 1, "n_heads": 2, "max_len": 16},
        },
        "data": {"train": str(tmp_path / "text.txt"), "seq_len": 8, "eval_fraction": 0.1},
        "args": {
            "output_dir": str(tmp_path / "out"),
            "max_steps": 3,
            "per_device_train_batch_size": 2,
            "logging_steps": 1,
            "save_steps": 2,
            "report_to": "none",
            "disable_tqdm": True,
        },
    }
    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    (tmp_path / "run.json").write_text(json.dumps(config))
    assert main(["train", "--config", str(tmp_path / "run.json")]) == 0
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "out"), "--step", "3"]) == 0  # the config the run recorded
    shown = json.loads(capsys.readouterr().out)
    logged = [json.loads(line) for line in (tmp_path / "out" / "log_history.jsonl").read_text().splitlines()]
    assert shown["step"] == 3 and shown["loss"] == [e["loss"] for e in logged if e.get("step") == 3 and "loss" in e][0]
    assert shown["start"].endswith("checkpoint-2") and len(shown["rows"]) == 1 and len(shown["rows"][0]) == 2
    assert main(["replay", str(tmp_path / "missing"), "--step", "1"]) == 2
    assert "trainfold replay: error" in capsys.readouterr().err
