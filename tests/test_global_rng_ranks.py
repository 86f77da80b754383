"""Every rank's global generators are saved and restored on their rank (issue 44.2): on 2 gloo ranks a collator
whose draws from torch's global generator depend on the rank (each rank draws a different number of values a
batch) continues them across a stop at step 3 and a resume to 6 as if the run had never stopped, on both ranks.

Run as a script, this file is the worker (three ``train`` calls in one torchrun job: uninterrupted, stopped, resumed)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_global_rng_ranks.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from test_global_rng_resume import _bert, _rows
from torchrun import torchrun_ok

from trainfold.data.collate import PadCollate


class _RankDrawing:
    """Masks positions where torch's global generator says so, and draws ``rank`` more values a batch: the ranks'
    generators part ways after the first batch. Records what it drew."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pad, self.draws = rank, PadCollate(), list[list[float]]()

    def __call__(self, items: list[dict]) -> dict:
        out = []
        for item in items:
            ids = list(item["input_ids"])
            masked = torch.rand(len(ids)) < 0.3
            out.append({"input_ids": [1 if m else t for t, m in zip(ids, masked.tolist())], "labels": ids})
        self.draws.append(torch.rand(1 + self.rank).tolist())
        return self.pad(out)


def _worker(out: Path) -> None:
    import torch.distributed as dist

    from trainfold.trainer.args import TrainingArguments
    from trainfold.trainer.train import train

    def run(where: str, **how):
        args = TrainingArguments(
            output_dir=str(out / where), max_steps=6, per_device_train_batch_size=2, learning_rate=1e-2,
            logging_steps=1, report_to="none", disable_tqdm=True, save_steps=3, seed=0,
        )  # fmt: skip
        model, collator = _bert(), _RankDrawing(int(os.environ["RANK"]))  # before train joins the group
        result = train(model, args, _rows(), data_collator=collator, **how)
        return result, model, collator.draws

    whole, whole_model, whole_draws = run("whole")
    run("parts", stop=lambda s: int(s.step) >= 3)
    resumed, resumed_model, resumed_draws = run("parts", resume_from_checkpoint=True)
    rank = dist.get_rank()
    report = {
        "global_step": resumed.global_step,
        "draws": [whole_draws[3:], resumed_draws],  # steps 4 to 6
        "equal_params": all(torch.equal(a, b) for a, b in zip(whole_model.parameters(), resumed_model.parameters())),
        "losses": [[(e["step"], e["loss"]) for e in r.log_history if "loss" in e] for r in (whole, resumed)],
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(report))


def test_every_rank_continues_its_own_global_draws_across_a_resume(tmp_path):
    """Only rank 0's states were saved: rank 1 warned and drew from the reseeded generator after the resume."""
    torchrun_ok(__file__, tmp_path, nproc=2)
    reports = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["global_step"] == 6, rank
        whole, resumed = report["draws"]
        assert len(whole) == 3 and resumed == whole, rank  # bitwise: the same floats
        assert report["equal_params"], rank
    assert reports[0]["draws"][0] != reports[1]["draws"][0]  # the ranks draw differently
    assert reports[0]["losses"][1] == reports[0]["losses"][0]
    meta = json.loads(next((tmp_path / "parts" / "checkpoint-3").glob("*.json")).read_text())
    assert sorted(meta["metadata"]["global_rng"]) == sorted(meta["metadata"]["global_rng_ahead"]) == ["0", "1"]


def test_a_resume_on_more_ranks_restores_the_saved_ranks_and_names_the_new_ones():
    import pytest

    from trainfold.ckpt.sidecar import CheckpointWarning
    from trainfold.core.rng import global_rng_states
    from trainfold.trainer.resume import continuing_global_rng

    torch.manual_seed(1)
    saved = {"0": global_rng_states()}
    torch.manual_seed(2)
    saved["1"] = global_rng_states()
    want = torch.rand(3)
    list(continuing_global_rng([0], saved, 1))  # rank 1's states, not rank 0's
    assert torch.equal(torch.rand(3), want)
    with pytest.warns(CheckpointWarning, match=r"rank\(s\) \['0', '1'\] only, not rank 2's"):
        list(continuing_global_rng([0], saved, 2))


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(Path(sys.argv[1]))
