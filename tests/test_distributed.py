"""Data parallelism on gloo: 2 processes match 1, resume bitwise, stop together on SIGTERM, evaluate sharded.

Run as a script, this file is the worker of the 2-process tests::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_distributed.py OUT_DIR

It trains and evaluates under ``collective_from_env()`` and writes what each rank ends with to
``OUT_DIR`` (safetensors and JSON); the tests compare that with the same runs in one process.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resume_fixture import endless_cli_config, sigterm_rank_one_of_cli_ranks
from safetensors.torch import load_file, save_file
from tolerance import assert_within, causal_lm_run_bounds
from torchrun import torchrun_ok

from trainfold import TrainingArguments, train
from trainfold import ckpt as checkpoint
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import init_state
from trainfold.core.tree import flatten
from trainfold.data import keyed, pad_collate, sample_key
from trainfold.distributed.distributed import (
    ProcessGroupCollective,
    agreed_stop,
    collective_from_env,
    shard,
    shard_bounds,
)
from trainfold.evaluation import evaluate_batches, gather_rows, predict_batches
from trainfold.evaluation.evaluation import evaluate_batches as evaluate
from trainfold.evaluation.evaluation import predict_batches as predict
from trainfold.evaluation.reducers import pad_concat
from trainfold.optim import adamw
from trainfold.step import make_step
from trainfold.testing import on_simulated_ranks

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
B = 2  # per-device batch of the 2-process runs; the 1-process runs take 2B
STRATEGIES = ("random", "batch_rebalance")  # resumed under 2 processes
# 2 processes compared with 1 on the same samples per step: (strategy, 2-process settings, 1-process settings).
# They add each step's token terms in other orders, so they train with SGD + momentum, which passes that
# difference on unchanged in size, and compare within the bound tests/tolerance.py derives (AdamW turns the
# rounding of a gradient that cancels to about its eps into a step of up to lr: issue 30).
LINEAR = {"optim": "sgd", "optim_args": "momentum=0.9"}
EQUIVALENCE = {
    "random": ("random", LINEAR, {**LINEAR, "per_device_train_batch_size": WORLD * B}),
    "group_by_length": ("group_by_length", LINEAR, {**LINEAR, "per_device_train_batch_size": WORLD * B}),
    "batch_rebalance": ("batch_rebalance", LINEAR, {**LINEAR, "per_device_train_batch_size": WORLD * B}),
    # 2 ranks x 2 accumulated micro-batches of B against 1 process accumulating 4 of B
    "accumulation": (
        "random",
        {**LINEAR, "gradient_accumulation_steps": 2},
        {**LINEAR, "gradient_accumulation_steps": 2 * WORLD},
    ),
}
RESUME_AT = 3  # 22 rows, global batch 4: 6 steps per epoch, so step 3 is mid-epoch


# -- shared by the tests and the worker ------------------------------------------------------------


def model(dropout: float = 0.0) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_len=24, dropout=dropout))


def rows(n: int = 22) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 40, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


_pad = pad_collate()


def _mask_some(items, keys):
    batch = _pad(items)  # uneven lengths: -100 right padding
    for row, key in enumerate(keys):  # and some labels masked, drawn from (seed, epoch, index)
        drop = torch.rand(batch["labels"].shape[1], generator=torch.Generator().manual_seed(key)) < 0.2
        batch["labels"][row, drop] = -100
    return batch


collate = keyed(_mask_some)


def settings_for(out: Path, strategy: str, **over) -> TrainingArguments:
    base = {
        "output_dir": str(out),
        "max_steps": 10,
        "per_device_train_batch_size": B,
        "learning_rate": 1e-2,
        "warmup_steps": 2,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "seed": 11,
        "train_sampling_strategy": strategy,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }
    return TrainingArguments(**{**base, **over})


def losses_of(history) -> list[list[float]]:
    return [[h["step"], h["loss"]] for h in history if "loss" in h and "train_loss" not in h]


def evals_of(history) -> list[list[float]]:
    return [[h["step"], h["eval_token_loss"], h["eval_accuracy"]] for h in history if "eval_loss" in h]  # batching-free


EVAL_DURING_TRAINING = {"eval_strategy": "steps", "eval_steps": 5, "per_device_eval_batch_size": 2}


def token_accuracy(p) -> dict[str, float]:
    predicted, labels = p.predictions.argmax(-1)[:, :-1], p.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": float((predicted == labels)[mask].mean())}


def per_sample(p) -> dict[str, float]:
    """Metrics of the inputs and per-sample losses weighted by row index, so they see the dataset order."""
    index = np.arange(len(p.losses))
    inputs = np.where(p.inputs < 0, 0, p.inputs)
    return {
        "inputs_weighted": int((inputs.sum(1) * index).sum()),
        "losses_weighted": float(np.nansum(p.losses * index)),
    }


# include_for_metrics and eval_accumulation_steps under sharded evaluation
INCLUDED = {
    "compute_metrics": per_sample,
    "include_for_metrics": ["inputs", "loss"],
    "eval_accumulation_steps": 1,
    "speed_metrics": False,
}


def eval_batches(data, size: int = 2):
    return [_pad(data[i : i + size]) for i in range(0, len(data), size)]


def _state_tensors(state) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in flatten(state).items()}


def _worker(out: Path) -> None:
    """Run every 2-process case on this rank; write its results under ``out``."""
    import torch.distributed as dist

    # without collective=, train joins the torchrun process group itself and leaves it open for later calls
    auto = train(model(), settings_for(out / "auto", "random", **LINEAR), rows(), data_collator=collate)
    assert dist.is_initialized()
    save_file(_state_tensors(auto.state), out / f"auto-{os.environ['RANK']}.safetensors")
    with collective_from_env() as c:
        assert c is not None and c.world_size == WORLD
        r = c.rank
        for case, (strategy, over, _) in EQUIVALENCE.items():  # equivalence with one process
            res = train(
                model(), settings_for(out / f"eq-{case}", strategy, **over), rows(), data_collator=collate, collective=c
            )
            save_file(_state_tensors(res.state), out / f"eq-{case}-{r}.safetensors")
            (out / f"eq-{case}-{r}.json").write_text(json.dumps(losses_of(res.log_history)))
        for strategy in STRATEGIES:  # bitwise resume from a mid-epoch checkpoint
            kw = {"data_collator": collate, "collective": c}
            straight = train(
                model(0.1), settings_for(out / f"straight-{strategy}", strategy, max_steps=8), rows(), **kw
            )
            part = out / f"resumed-{strategy}"
            first = train(
                model(0.1),
                settings_for(part, strategy, max_steps=8, save_strategy="steps", save_steps=RESUME_AT),
                rows(),
                stop=lambda s: int(s.step) >= RESUME_AT,
                **kw,
            )
            assert first.status == "stopped" and first.global_step == RESUME_AT
            dist.barrier()  # rank 0 has written the checkpoint
            resumed = train(
                model(0.1), settings_for(part, strategy, max_steps=8), rows(), resume_from_checkpoint=True, **kw
            )
            save_file(_state_tensors(straight.state), out / f"straight-{strategy}-{r}.safetensors")
            save_file(_state_tensors(resumed.state), out / f"resumed-{strategy}-{r}.safetensors")
            losses = {"straight": losses_of(straight.log_history), "resumed": losses_of(resumed.log_history)}
            (out / f"resume-{strategy}-{r}.json").write_text(json.dumps(losses))
        res = train(
            model(),
            settings_for(out / "eval-train", "random", **EVAL_DURING_TRAINING),
            rows(),
            rows(7),
            data_collator=collate,
            compute_metrics=token_accuracy,
            collective=c,
        )
        (out / f"eval-train-{r}.json").write_text(json.dumps(evals_of(res.log_history)))
        lent_net, opt = model(), adamw(1e-3)  # a lent, donated state steps through DistributedDataParallel
        lent_step = make_step(lent_net, optimizer=opt, collective=c)
        lent_step(init_state(lent_net, opt, copy=False), [collate(rows(4)[:2], [1, 2])], donate=True)
        (out / f"engine-{r}.json").write_text(json.dumps(type(lent_step.engine.ddp).__name__))
        net = model()  # sharded evaluation of 7 rows: shards of 3 and 4
        mine = eval_batches(list(shard(rows(7), r, WORLD)))
        metrics = evaluate_batches(net, None, mine, collective=c, compute_metrics=token_accuracy, speed_metrics=False)
        pred = predict_batches(net, None, mine, collective=c, as_numpy=False, speed_metrics=False)
        (out / f"eval-{r}.json").write_text(json.dumps({"evaluate": metrics, "predict": pred.metrics}))
        save_file({"predictions": pred.predictions, "label_ids": pred.label_ids}, out / f"predict-{r}.safetensors")
        included = evaluate_batches(net, None, mine, collective=c, **INCLUDED)
        (out / f"eval-included-{r}.json").write_text(json.dumps(included))


# -- the 2-process run (one launch for every case) ------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    torchrun_ok(__file__, out, nproc=WORLD)
    return out


def _assert_same_on_every_rank(out: Path, name: str) -> dict[str, torch.Tensor]:
    per_rank = [load_file(out / f"{name}-{r}.safetensors") for r in range(WORLD)]
    for other in per_rank[1:]:
        assert other.keys() == per_rank[0].keys()
        for k in per_rank[0]:
            assert torch.equal(per_rank[0][k], other[k]), f"{name}: {k} differs between ranks"
    return per_rank[0]


def _fewest_counts(epochs: int) -> list[int]:
    """Each row's fewest labels ``collate`` leaves counted in ``epochs`` (masks are drawn from seed, epoch, index)."""
    seed, data = settings_for(Path("."), "random").seed, rows()
    return [
        min(int((_mask_some([r], [sample_key(seed, e, i)])["labels"][0, 1:] != -100).sum()) for e in range(epochs))
        for i, r in enumerate(data)
    ]


def _assert_within_run_bound(two: dict, one, settings: TrainingArguments, rows_per_step: int) -> Callable:
    """``two``'s params within the bound of clipped SGD + momentum runs of other summation orders (tolerance.py)."""
    epochs = settings.max_steps * rows_per_step // len(rows()) + 1  # the epochs the run reaches
    bound, rtol, loss_atol = causal_lm_run_bounds(
        model(), rows(), rows_per_step, one.log_history, settings.learning_rate, 0.9,
        max_norm=settings.max_grad_norm, counts=_fewest_counts(epochs), per_token=True,
    )  # fmt: skip
    for k in one.state.params:
        assert_within(two[f"params.{k}"], one.state.params[k], bound[k], rtol, k)
    return loss_atol


@pytest.mark.parametrize("case", EQUIVALENCE)
def test_two_processes_of_batch_b_match_one_process_of_batch_2b(ranks, case, tmp_path):
    strategy, _, alone = EQUIVALENCE[case]
    two = _assert_same_on_every_rank(ranks, f"eq-{case}")
    alone_settings = settings_for(tmp_path, strategy, **alone)
    one = train(model(), alone_settings, rows(), data_collator=collate)
    ref = _state_tensors(one.state)
    assert {k for k in ref if k.startswith("opt_state.")} <= set(two)
    per_step = alone_settings.per_device_train_batch_size * alone_settings.gradient_accumulation_steps
    loss_atol = _assert_within_run_bound(two, one, alone_settings, per_step)
    assert int(two["step"]) == int(ref["step"]) == 10
    assert two["metrics.num_items"].item() == ref["metrics.num_items"].item()  # counted over both ranks
    losses = [json.loads((ranks / f"eq-{case}-{r}.json").read_text()) for r in range(WORLD)]
    assert losses[0] == losses[1]
    expected = losses_of(one.log_history)
    assert [s for s, _ in losses[0]] == [s for s, _ in expected] == list(range(1, 11))
    for (_, mine), (_, theirs) in zip(losses[0], expected):
        assert mine == pytest.approx(theirs, abs=loss_atol(theirs), rel=0)


def test_a_lent_step_across_ranks_runs_the_module_under_distributed_data_parallel(ranks):
    assert [json.loads((ranks / f"engine-{r}.json").read_text()) for r in range(WORLD)] == [
        "DistributedDataParallel"
    ] * WORLD


def test_train_under_torchrun_joins_the_process_group_itself(ranks, tmp_path):
    auto = _assert_same_on_every_rank(ranks, "auto")
    explicit = _assert_same_on_every_rank(ranks, "eq-random")  # the same run given collective=
    for key in auto:
        assert torch.equal(auto[key], explicit[key]), key
    alone = settings_for(tmp_path, "random", **EQUIVALENCE["random"][2])
    one = train(model(), alone, rows(), data_collator=collate)
    _assert_within_run_bound(auto, one, alone, WORLD * B)


def test_an_explicit_collective_wins_over_torchruns_environment(monkeypatch, tmp_path):
    from trainfold.distributed.distributed import SingleProcess

    monkeypatch.setenv("WORLD_SIZE", "2")  # no MASTER_ADDR: joining a group here would fail
    monkeypatch.setenv("RANK", "0")
    r = train(
        model(),
        settings_for(tmp_path, "random", max_steps=2),
        rows(),
        data_collator=collate,
        collective=SingleProcess(),
    )
    assert r.global_step == 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_under_two_processes_is_bitwise(ranks, strategy):
    straight = _assert_same_on_every_rank(ranks, f"straight-{strategy}")
    resumed = _assert_same_on_every_rank(ranks, f"resumed-{strategy}")
    for key in straight:
        if key.startswith("extras.") or key == "metrics.num_items":
            continue
        assert torch.equal(straight[key], resumed[key]), key
    assert int(resumed["step"]) == 8
    losses = json.loads((ranks / f"resume-{strategy}-0.json").read_text())
    assert [s for s, _ in losses["resumed"]][-1] == 8
    assert losses["resumed"] == losses["straight"]  # the resumed run's history carries the first part's losses


def test_sharded_evaluation_matches_one_process(ranks):
    data, net = rows(7), model()
    whole = evaluate(net, None, eval_batches(data), compute_metrics=token_accuracy, speed_metrics=False)
    ref = predict(net, None, eval_batches(data), as_numpy=False, speed_metrics=False)
    results = [json.loads((ranks / f"eval-{r}.json").read_text()) for r in range(WORLD)]
    assert results[0] == results[1]
    # other batches: HF's eval_loss (row-weighted batch means) depends on them, the token mean does not
    assert results[0]["evaluate"]["eval_token_loss"] == pytest.approx(whole["eval_token_loss"], rel=1e-6)
    assert results[0]["evaluate"]["eval_accuracy"] == whole["eval_accuracy"]
    assert results[0]["predict"]["test_token_loss"] == pytest.approx(ref.metrics["test_token_loss"], rel=1e-6)
    gathered = _assert_same_on_every_rank(ranks, "predict")
    assert torch.equal(gathered["label_ids"], ref.label_ids)  # dataset order, -100 padding
    valid = ref.label_ids != -100  # logits at padding depend on the batch's width; compare real positions
    assert gathered["predictions"].shape == ref.predictions.shape
    torch.testing.assert_close(gathered["predictions"][valid], ref.predictions[valid], rtol=1e-5, atol=1e-5)


def test_sharded_inputs_losses_and_accumulation_match_one_process(ranks):
    whole = evaluate(model(), None, eval_batches(rows(7)), **INCLUDED)
    results = [json.loads((ranks / f"eval-included-{r}.json").read_text()) for r in range(WORLD)]
    assert results[0] == results[1]
    assert sorted(results[0]) == ["eval_inputs_weighted", "eval_loss", "eval_losses_weighted", "eval_token_loss"]
    assert results[0]["eval_inputs_weighted"] == whole["eval_inputs_weighted"]  # every input, in dataset order
    assert results[0]["eval_losses_weighted"] == pytest.approx(whole["eval_losses_weighted"], rel=1e-5)
    assert results[0]["eval_token_loss"] == pytest.approx(whole["eval_token_loss"], rel=1e-6)


def test_evaluation_during_two_process_training_matches_one_process(ranks, tmp_path):
    two = [json.loads((ranks / f"eval-train-{r}.json").read_text()) for r in range(WORLD)]
    assert two[0] == two[1]  # every rank sees the same metrics (early stopping and best model agree)
    one = evals_of(
        train(
            model(),
            settings_for(tmp_path, "random", per_device_train_batch_size=WORLD * B, **EVAL_DURING_TRAINING),
            rows(),
            rows(7),
            data_collator=collate,
            compute_metrics=token_accuracy,
        ).log_history
    )
    assert [e[0] for e in two[0]] == [e[0] for e in one] == [5, 10]
    assert [e[1] for e in two[0]] == pytest.approx([e[1] for e in one], rel=1e-5)
    assert [e[2] for e in two[0]] == [e[2] for e in one]


# -- preemption: SIGTERM to one rank of the CLI ---------------------------------------------------


def test_sigterm_to_one_rank_stops_both_at_one_step_with_one_checkpoint(tmp_path):
    out = tmp_path / "out"
    config = endless_cli_config(tmp_path, out)
    results = sigterm_rank_one_of_cli_ranks(config, out, WORLD)
    for _, err, code in results:
        assert code == 143, err[-3000:]
    assert [stdout.strip() == "" for stdout, _, _ in results] == [False] + [True] * (WORLD - 1)  # rank 0's line only
    reports = [json.loads(results[0][0].strip().splitlines()[-1])]
    assert [r["status"] for r in reports] == ["preempted"] and reports[0]["global_step"] >= 3
    found = sorted(out.glob("checkpoint-*"))
    assert [p.name for p in found] == [f"checkpoint-{reports[0]['global_step']}"]
    assert checkpoint.is_complete(found[0]) and checkpoint.read_metadata(found[0])["step"] == reports[0]["global_step"]
    assert not [p for p in out.iterdir() if p.name.startswith(".") or "tmp" in p.name]


# -- in one process: sums, and collectives simulated by threads ------------------------------


class _Recorder:
    """A stand-in for ``dist.all_reduce`` in a world of identical ranks: records each call."""

    def __init__(self, world: int) -> None:
        self.world, self.calls = world, []

    def __call__(self, tensor, op=None, group=None):
        self.calls.append((tensor.dtype, tensor.numel()))
        tensor.mul_(self.world)


def test_sum_replaces_each_tensor_by_its_sum_over_ranks(monkeypatch):
    rec = _Recorder(2)
    monkeypatch.setattr("trainfold.distributed.distributed.dist.all_reduce", rec)
    floats = [torch.full((4,), float(i)) for i in range(3)]
    count = torch.tensor(3)
    ProcessGroupCollective(0, 2).sum_([*floats, count])
    assert [t.tolist() for t in floats] == [[2.0 * i] * 4 for i in range(3)] and count.item() == 6


def test_a_pure_step_sums_the_count_gradients_and_loss_over_ranks(monkeypatch):
    rec = _Recorder(1)
    monkeypatch.setattr("trainfold.distributed.distributed.dist.all_reduce", rec)
    net, opt = model(), adamw(1e-3)
    batch = [collate(rows(4)[:2], [1, 2]), collate(rows(4)[2:], [3, 4])]
    state = init_state(net, opt, seed=0)
    alone = make_step(net, optimizer=opt)(state, batch)
    shared = make_step(net, optimizer=opt, collective=ProcessGroupCollective(0, 1))(state, batch)
    assert len(rec.calls) == 1 + len(state.params) + 1  # the count first, then every gradient and the loss
    assert rec.calls[0] == (torch.int64, 1)
    for k in alone.params:
        assert torch.equal(alone.params[k], shared.params[k])


def test_sharded_evaluation_on_simulated_ranks_matches_evaluate():
    data = rows(9)
    nets = [model() for _ in range(3)]  # one module per thread: functional_call swaps its tensors
    whole = evaluate(nets[0], None, eval_batches(data, 2), compute_metrics=token_accuracy, speed_metrics=False)

    def rank_eval(c):
        mine = eval_batches(list(shard(data, c.rank, c.world_size)), 2)
        return evaluate_batches(
            nets[c.rank], None, mine, collective=c, compute_metrics=token_accuracy, speed_metrics=False
        )

    for got in on_simulated_ranks(3, rank_eval):  # other batches than one process's: float32 noise per batch
        assert got["eval_token_loss"] == pytest.approx(whole["eval_token_loss"], rel=1e-6)
        assert got["eval_accuracy"] == whole["eval_accuracy"]


def test_a_loss_only_sharded_evaluation_merges_sums_and_counts():
    # Shards of 3 short rows and 6 long ones: a mean of the shard means is far from the token mean.
    # The shards hold whole batches of the one-process run, so only the float64 sums' order differs.
    data = [{"input_ids": [1, 2], "labels": [1, 2]}] * 3 + rows(6)
    net = model()
    whole = evaluate(net, None, eval_batches(data, 3), speed_metrics=False)
    nets = [copy.deepcopy(net) for _ in range(2)]
    parts = [data[:3], data[3:]]
    got = on_simulated_ranks(
        2,
        lambda c: evaluate_batches(
            nets[c.rank], None, eval_batches(parts[c.rank], 3), collective=c, speed_metrics=False
        ),
    )
    assert got[0] == got[1]
    assert got[0]["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-12)
    alone = [evaluate(net, None, eval_batches(p, 3), speed_metrics=False)["eval_loss"] for p in parts]
    assert abs(sum(alone) / 2 - whole["eval_loss"]) > 1e-3


@given(
    shapes=st.lists(
        st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=0, max_size=3), min_size=2, max_size=3
    ),
)
@settings(max_examples=15, deadline=None)
def test_gather_rows_is_pad_concat_in_rank_order(shapes):
    # each rank holds a few (rows, width) pieces, already pad-concatenated; some ranks hold nothing
    g = torch.Generator().manual_seed(0)
    per_rank = [[torch.randn(n, w, generator=g) for n, w in pieces] for pieces in shapes]
    local = [pad_concat(p) if p else None for p in per_rank]
    got = on_simulated_ranks(len(shapes), lambda c: gather_rows(local[c.rank], c))
    everything = [t for p in per_rank for t in p]
    expected = pad_concat(everything) if everything else None
    for g in got:
        if expected is None:
            assert g is None
        else:
            assert torch.equal(g, expected)


def test_predictions_come_back_in_dataset_order():
    data = rows(5)
    net = model()
    ref = predict(net, None, eval_batches(data, 2), as_numpy=False, speed_metrics=False)
    nets = [copy.deepcopy(net) for _ in range(2)]
    got = on_simulated_ranks(
        2,
        lambda c: predict_batches(
            nets[c.rank],
            None,
            eval_batches(list(shard(data, c.rank, 2)), 2),
            collective=c,
            as_numpy=False,
            speed_metrics=False,
        ),
    )
    for out in got:
        assert torch.equal(out.label_ids, ref.label_ids)
        valid = ref.label_ids != -100
        torch.testing.assert_close(out.predictions[valid], ref.predictions[valid], rtol=1e-5, atol=1e-5)


def test_shards_cover_the_data_once_in_order():
    for n in range(12):
        for world in range(1, 5):
            bounds = [shard_bounds(n, r, world) for r in range(world)]
            assert [i for a, b in bounds for i in range(a, b)] == list(range(n))
            assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


def test_a_stop_on_one_rank_is_a_stop_on_every_rank():
    # rank 1 alone wants to stop at 3 (e.g. its own clock ran out); both leave after the same step
    def run(c):
        stop = agreed_stop(lambda n: c.rank == 1 and n >= 3, c)
        n = 0
        while not stop(n):
            n += 1
        return n

    assert on_simulated_ranks(3, run) == [3, 3, 3]


def test_alone_there_is_no_collective(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with collective_from_env() as c:
        assert c is None


# -- errors ----------------------------------------------------------------------------------------


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        shard_bounds(5, 2, 2)
    with pytest.raises(ValueError, match="cannot give each of 3 ranks one"):
        shard([1, 2], 0, 3)
    with pytest.raises(TypeError, match="without __len__"):
        shard(iter([1, 2]), 0, 2)
    with pytest.raises(ValueError, match="prediction_loss_only=True"):
        on_simulated_ranks(
            1,
            lambda c: evaluate_batches(
                model(), None, [], collective=c, prediction_loss_only=True, compute_metrics=token_accuracy
            ),
        )
    with pytest.raises(ValueError, match="cannot be concatenated"):
        on_simulated_ranks(2, lambda c: gather_rows(torch.zeros(1, 2, 3 + c.rank), c))


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(Path(sys.argv[1]))
