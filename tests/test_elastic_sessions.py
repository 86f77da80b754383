"""Elastic resume, session after session, with ``fsdp="full_shard"`` kept: 2 ranks -> 1 -> 1 -> 2 (issue 44.7, 44.14).

The same command (``per_device_train_batch_size=2``, ``gradient_accumulation_steps=2``, written for 2 ranks: a
global batch of 8) runs four times under torchrun, each resuming the last session's checkpoint: on 2 ranks to
step 4, on one rank (``--nproc_per_node=1``: a one-rank FSDP mesh) to 6 and again to 8, on 2 ranks to 10. The
one-rank sessions keep the global batch with 4 accumulation steps; the second of them resumes a checkpoint its
predecessor wrote on one rank (it was refused: "gradient_accumulation_steps: 4 there, 2 here"), and the first
resumes a 2-rank FSDP checkpoint on one rank (DCP reshards it). ``TRAINFOLD_SLOW=full`` launches each session
(and the fresh one-rank run) as a torchrun job of its own; reduced, the three one-rank runs are one job (the
same command three times in one process: 3 launches instead of 5). Run as a script, this file is the worker::

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/test_elastic_sessions.py OUT NAME STOP ...

(each NAME STOP pair a ``train`` call, in order).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_sharded_checkpoint import elastic_run, rows, run_args, tiny, trained
from torchrun import torchrun_ok

from trainfold import ckpt

SESSIONS = (("s1", 2, 4), ("s2", 1, 6), ("s3", 1, 8), ("s4", 2, 10))  # name, ranks, the step it stops at
COMMAND = dict(max_steps=10, save_steps=2, gradient_accumulation_steps=2, fsdp="full_shard")


def _worker(out: Path, name: str, stop_at: int) -> None:
    import torch.distributed as dist

    from trainfold import train

    out = out / "alone" if name == "alone" else out
    resume = None if name in ("s1", "alone") else True
    over = dict(COMMAND, gradient_accumulation_steps=4) if name == "alone" else COMMAND
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = train(
            tiny(),
            run_args(out / "run", **over),
            rows(),
            resume_from_checkpoint=resume,
            stop=lambda s: s.step >= stop_at,
        )
    rank = dist.get_rank()  # train joined torchrun's group, one rank included
    save_file(trained(result), out / f"{name}-{rank}.safetensors")
    if rank == 0:
        report = {
            "world": dist.get_world_size(),
            "status": result.status,
            "global_step": result.global_step,
            "sharded": sorted(p.name for p in (out / "run" / f"checkpoint-{stop_at}" / ckpt.SHARD_DIR).iterdir()),
            "warnings": [str(w.message) for w in seen if "resuming a run" in str(w.message)],
            "steps": [h["step"] for h in result.log_history if "loss" in h and "train_loss" not in h],
        }
        (out / f"{name}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elastic")
    (out / "alone").mkdir()
    jobs = [(nproc, [name, stop_at]) for name, nproc, stop_at in SESSIONS]
    jobs.insert(3, (1, ["alone", 10]))  # a fresh one-rank FSDP run, accumulation 4
    if os.environ.get("TRAINFOLD_SLOW") != "full":  # the one-rank runs in one job
        jobs = [jobs[0], (1, jobs[1][1] + jobs[2][1] + jobs[3][1]), jobs[4]]
    for nproc, calls in jobs:
        torchrun_ok(__file__, out, *calls, nproc=nproc)
    return out


@pytest.mark.slow  # five torchrun launches (reduced: three)
def test_a_one_rank_fsdp_run_under_torchrun_trains_bitwise_as_one_plain_process(sessions, tmp_path):
    """Issue 44.14: ``fsdp="full_shard"`` under ``torchrun --nproc_per_node=1`` was refused ("run it under
    torchrun")."""
    report = json.loads((sessions / "alone" / "alone.json").read_text())
    assert (report["world"], report["status"], report["global_step"]) == (1, "completed", 10)
    assert report["sharded"] == ["shard-00001-model-00001-of-00001.safetensors"]  # a sharded checkpoint, one rank
    plain = trained(elastic_run(tmp_path / "plain", max_steps=10, save_strategy="no", gradient_accumulation_steps=4))
    fsdp = load_file(sessions / "alone" / "alone-0.safetensors")
    assert fsdp.keys() == plain.keys()
    for k, v in plain.items():
        assert torch.equal(fsdp[k], v), k


@pytest.mark.slow  # five torchrun launches (reduced: three)
def test_four_elastic_sessions_two_one_one_two_ranks_resume_each_other(sessions, tmp_path):
    """Issue 44.7: the third session (the same one-process command again) was refused; 44.14: the second resumes a
    2-rank FSDP checkpoint on a one-rank FSDP mesh. The end equals one process on the same global batch within
    the bound derived for clipped SGD + momentum summing the same token terms in other orders."""
    from tolerance import assert_within, causal_lm_run_bounds

    reports = {name: json.loads((sessions / f"{name}.json").read_text()) for name, _, _ in SESSIONS}
    assert [reports[n]["world"] for n, _, _ in SESSIONS] == [2, 1, 1, 2]
    assert [reports[n]["global_step"] for n, _, _ in SESSIONS] == [4, 6, 8, 10]
    one_rank = "resuming a run of {} ranks on 1: per_device_train_batch_size 2 -> 2, gradient_accumulation_steps 2 -> 4"
    assert reports["s2"]["warnings"] == [
        one_rank.format(2) + " keep its global batch of 8 samples per step (trainfold.data.global_batch)"
    ]
    assert reports["s3"]["warnings"] == [
        one_rank.format(1) + " keep its global batch of 8 samples per step (trainfold.data.global_batch)"
    ]
    assert reports["s1"]["warnings"] == reports["s4"]["warnings"] == []  # the command's own split on 2 ranks
    for name, nproc, stop_at in SESSIONS:
        meta = ckpt.read_metadata(sessions / "run" / f"checkpoint-{stop_at}")
        split = (meta["settings"]["world_size"], meta["settings"]["gradient_accumulation_steps"])
        assert split == ((2, 2) if nproc == 2 else (1, 4)), name
        assert len(reports[name]["sharded"]) == nproc, name
    assert reports["s4"]["steps"] == list(range(1, 11))  # each session's log carried on
    reference = elastic_run(tmp_path / "plain", max_steps=10, save_strategy="no", gradient_accumulation_steps=4)
    history = [h for h in reference.log_history if "grad_norm" in h]
    bound, rtol, _ = causal_lm_run_bounds(tiny(), rows(), 8, history, 1e-2, 0.9, max_norm=1.0)
    want = trained(reference)
    for rank in range(2):
        got = load_file(sessions / f"s4-{rank}.safetensors")
        for k, v in want.items():
            name = max((n for n in bound if k.endswith("." + n)), key=len, default=None)
            if k.startswith(("params.", "opt_state.")) and name is not None:
                assert_within(got[k], v, bound[name] if k.startswith("params.") else bound[name] / 1e-2, rtol, k)
            elif k.startswith(("params.", "opt_state.")):
                assert torch.equal(got[k], v), k  # counts


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, stop_at in zip(sys.argv[2::2], sys.argv[3::2]):
        _worker(Path(sys.argv[1]), name, int(stop_at))
