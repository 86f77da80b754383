"""FSDP2 on gloo: 2 ranks of a ``fully_shard`` module (lent state: its DTensor shards) train as 1 process.

Run as a script, this file is the worker of the 2-process tests::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_sharded.py OUT_DIR [CASE]

It writes what each rank ends with to ``OUT_DIR`` (safetensors and JSON); the tests compare.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tolerance import (
    assert_within,
    causal_lm_eval_atol,
    causal_lm_run_bounds,
    clipped_sgd_atol,
    gamma,
    grad_atol,
    reordered,
    row_abs_grads,
    sgd_rtol,
)
from torchrun import torchrun

from trainfold import TrainingArguments, train
from trainfold.core.forward import make_forward
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import TrainState, init_state
from trainfold.core.tree import flatten
from trainfold.data import pad_collate
from trainfold.observe.divergence import nonfinite_params
from trainfold.optim import GradientTransformation, adamw, chain, clip_by_global_norm, sgd
from trainfold.step import make_step

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
STEPS = 10
ROWS = 4  # rows per micro-batch, over all ranks; 2 micro-batches per step (GA 2)


def model(dropout: float = 0.0) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_len=24, dropout=dropout))


def optimizer() -> GradientTransformation:
    return chain(clip_by_global_norm(0.5), adamw(1e-2, weight_decay=0.1))


LR, MOMENTUM, MAX_NORM = 0.1, 0.9, 0.5


def linear() -> GradientTransformation:
    """Clipped SGD with momentum: 2 ranks sum the gradients in another order than 1 process, and an
    optimizer linear in the gradients keeps that difference as small as it is (tests/tolerance.py)."""
    return chain(clip_by_global_norm(MAX_NORM), sgd(LR, momentum=MOMENTUM))


def batch(step: int, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Step ``step``'s 2 micro-batches, ``rank``'s rows of each (all rows when ``world`` is 1)."""
    out = []
    for micro in range(2):
        g = torch.Generator().manual_seed(100 * step + micro)
        ids = torch.randint(0, 40, (ROWS, 10), generator=g)
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=g) < 0.2] = -100
        n = ROWS // world
        out.append({"input_ids": ids[rank * n : (rank + 1) * n], "labels": labels[rank * n : (rank + 1) * n]})
    return out


def run(step, state: TrainState, rank: int, world: int) -> TrainState:
    for s in range(STEPS):
        state = step(state, batch(s, rank, world), donate=True)
    return state


def sharded_net(net, mesh):
    """``net`` wrapped with fully_shard per block, then the root (what fsdp='full_shard' does)."""
    from trainfold.step.fsdp import fully_shard_model

    return fully_shard_model(net, mesh)


def gathered(state):
    """The state with every DTensor as its full tensor (a collective: every rank calls it)."""
    from trainfold.core.tree import map_tensors

    return map_tensors(lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t, state)


def tensors(state: TrainState) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone().contiguous()
        for k, v in flatten(state).items()
        if k.startswith(("params.", "opt_state.", "metrics."))
    }


def _local_bytes(tree) -> int:
    from torch.distributed.tensor import DTensor

    return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in flatten(tree).values())


def _grad_bytes(opt: GradientTransformation, seen: list[int]) -> GradientTransformation:
    """``opt`` itself (its state, its apply), recording the bytes of the gradients it is given."""
    tapped = GradientTransformation(opt.init, opt.update, name=opt.name)

    def apply(grads, state, params, donate=False):
        seen.append(_local_bytes(grads))
        return opt.apply(grads, state, params, donate=donate)

    tapped.apply, tapped.learning_rate = apply, opt.learning_rate  # type: ignore[method-assign]
    return tapped


def rows(n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 40, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


# train() with SGD + momentum, for the same reason as linear()
LINEAR = {"optim": "sgd", "optim_args": f"momentum={MOMENTUM}"}


def train_args(out: Path, **over) -> TrainingArguments:
    base = {
        "output_dir": str(out),
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-2,
        "max_grad_norm": 0.5,
        "seed": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "logging_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "per_device_eval_batch_size": 2,
    }
    return TrainingArguments(**{**base, **over})


def _worker(out: Path, case: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainfold.ckpt.sharded import is_sharded
    from trainfold.distributed.distributed import group_timeout, process_group_collective
    from trainfold.step.fsdp import make_mesh

    dist.init_process_group("gloo", timeout=group_timeout())  # TRAINFOLD_DIST_TIMEOUT=5 for the error cases
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh, collective = make_mesh(), process_group_collective()
    if case.startswith("raise"):  # rank 1 fails inside a step; rank 0 must not wait for it forever
        net = sharded_net(model(), mesh)
        state = init_state(net, optimizer(), copy=False)
        step = make_step(net, causal_lm, optimizer(), collective=collective)
        bad = batch(0, rank, world)
        if rank == 1:
            bad = [{"input_ids": b["input_ids"]} for b in bad]  # no labels: a KeyError on this rank only
        try:
            step(state, bad, donate=True)
        except KeyError:
            if case == "raise-alive":  # rank 1 lives on outside the step (a notebook that caught it)
                time.sleep(240)
            raise
        return
    results: dict = {}
    cases = (("plain", 0.0, False, linear), ("dropout", 0.1, False, linear), ("recompute", 0.1, True, linear))
    for name, dropout, recompute, opt in cases:
        net, grads = sharded_net(model(dropout), mesh), []
        state = init_state(net, opt(), seed=3, copy=False)
        step = make_step(
            net, causal_lm, _grad_bytes(opt(), grads), collective=collective, gradient_checkpointing=recompute
        )
        state = run(step, state, rank, world)
        assert is_sharded(state) and str(state.params["tok.weight"].placements) == "(Shard(dim=0),)"
        save_file(tensors(gathered(state)), out / f"{name}-{rank}.safetensors")
        results[name] = {
            "state_bytes": _local_bytes(state.params) + _local_bytes(state.opt_state),
            "grad_bytes": max(grads),
        }
    trained = model()
    res = train(
        trained, train_args(out / "train", fsdp="full_shard", **LINEAR), rows(), rows(6), data_collator=pad_collate()
    )
    assert isinstance(trained, FSDPModule) and is_sharded(res.state)  # the module is torch's FSDP2 module
    assert all(res.state.params[k] is p for k, p in trained.named_parameters())  # lent: its own DTensors
    save_file(tensors(gathered(res.state)), out / f"train-{rank}.safetensors")
    (out / f"train-{rank}.json").write_text(json.dumps([h for h in res.log_history if "eval_loss" in h]))
    net = model(0.1)  # data parallelism: the replicated reference with the same dropout masks
    ddp = make_step(net, causal_lm, linear(), collective=collective)
    save_file(tensors(run(ddp, init_state(net, linear(), seed=3), rank, world)), out / f"ddp-{rank}.safetensors")
    poisoned = torch.zeros(4, 2)
    poisoned[3, 0] = float("nan")  # on rank 1's shard only
    results["nonfinite"] = nonfinite_params({"w": distribute_tensor(poisoned, mesh, [Shard(0)])})
    (out / f"bytes-{rank}.json").write_text(json.dumps(results))
    # a group left to static destruction can abort the process at exit under gloo ("terminate called without
    # an active exception", after every result was written): the worker that opened it closes it
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("sharded"), "train", timeout=240)[0]


def _launch(out: Path, case: str, timeout: float) -> tuple[Path, subprocess.CompletedProcess]:
    extra = {"TRAINFOLD_DIST_TIMEOUT": "5"} if case.startswith("raise") else {}
    done = torchrun(__file__, out, case, nproc=WORLD, timeout=timeout, env=extra)
    if case == "train":
        assert done.returncode == 0, done.stderr[-4000:]
    return out, done


def _same_on_every_rank(out: Path, name: str) -> dict[str, torch.Tensor]:
    per_rank = [load_file(out / f"{name}-{r}.safetensors") for r in range(WORLD)]
    for k in per_rank[0]:
        assert torch.equal(per_rank[0][k], per_rank[1][k]), f"{name}: {k} differs between ranks"
    return per_rank[0]


def _assert_equal(got: dict, expected: dict) -> None:
    keys = [k for k in expected if k.startswith(("params.", "opt_state."))]
    assert keys and set(keys) <= set(got)
    for key in keys:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def _one_process_with_bounds() -> tuple[dict, dict, dict, float, float, list]:
    """The 1-process run of ``linear()``, and how far the 2 ranks may be from it (tests/tolerance.py).

    Each step, the 2 ranks add the same token terms in another order: each gradient tensor within
    ``grad_atol`` of sum|x_i| (measured per row at the step's params, every position a term); clipping and
    momentum carry that as ``clipped_sgd_atol`` derives. Returns the final tensors, the params' and momenta's
    element-wise bounds, the last loss's and the last norm's relative bounds, and the per-step inputs of
    ``clipped_sgd_atol``.
    """
    net = model()
    step, state, forward = make_step(net, causal_lm, linear()), init_state(net, linear(), seed=3), make_forward(net, {})
    per_step = []
    for s in range(STEPS):
        micro = batch(s, 0, 1)
        rows_ = [(m["input_ids"][i : i + 1], m["labels"][i : i + 1]) for m in micro for i in range(ROWS)]
        count = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
        loss = lambda p, r: causal_lm(forward(p, {"input_ids": rows_[r][0]}), rows_[r][1], count)  # noqa: B023
        abs_grads = row_abs_grads(loss, state.params, range(len(rows_)))
        state = step(state, micro)
        terms = sum(m["input_ids"].numel() for m in micro)
        per_step.append((grad_atol(abs_grads, terms), abs_grads, float(state.metrics["grad_norm"]), MAX_NORM))
    params, moments = clipped_sgd_atol(per_step, LR, MOMENTUM)
    atol, grads, norm, _ = per_step[-1]
    diff = sum(atol[k] ** 2 * v.numel() for k, v in grads.items()) ** 0.5
    norm_rtol = diff / norm + gamma(sum(v.numel() for v in grads.values()))
    # the last loss: its token terms in another order (2 gamma relative: positive terms), at params that
    # differ by at most the bound before the last step, each moving the loss by at most sum|g| per unit
    before = {k: v - LR * moments[k] for k, v in params.items()}  # the bound one step earlier (no momentum left)
    loss_rtol = reordered(terms, 1.0) + sum((grads[k] * before[k]).sum().item() for k in grads) / float(
        state.metrics["loss"]
    )
    return tensors(state), params, moments, loss_rtol, norm_rtol, per_step


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these
def test_two_sharded_ranks_match_one_process_over_ten_steps_with_accumulation_and_clipping(ranks):
    two = _same_on_every_rank(ranks, "plain")
    one, params, moments, loss_rtol, norm_rtol, _ = _one_process_with_bounds()
    rtol = sgd_rtol(STEPS)  # each step rounds each param and momentum once
    for k in params:
        assert_within(two[f"params.{k}"], one[f"params.{k}"], params[k], rtol, k)
        assert_within(two[f"opt_state.1.momentum.{k}"], one[f"opt_state.1.momentum.{k}"], moments[k], rtol, k)
    assert torch.equal(two["opt_state.1.count"], one["opt_state.1.count"])
    torch.testing.assert_close(two["metrics.loss"], one["metrics.loss"], rtol=loss_rtol, atol=0)
    torch.testing.assert_close(two["metrics.grad_norm"], one["metrics.grad_norm"], rtol=norm_rtol, atol=0)


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these
def test_train_with_fsdp_full_shard_under_torchrun_matches_one_process(ranks, tmp_path):
    two = _same_on_every_rank(ranks, "train")
    one = train(
        model(),
        train_args(tmp_path, **LINEAR, gradient_accumulation_steps=2 * WORLD),
        rows(),
        rows(6),
        data_collator=pad_collate(),
    )
    ref = tensors(one.state)
    assert {k for k in ref if k.startswith("opt_state.")} <= set(two)
    args = train_args(tmp_path)
    bound, rtol, _ = causal_lm_run_bounds(
        model(), rows(), 8, one.log_history, args.learning_rate, MOMENTUM, max_norm=args.max_grad_norm
    )
    for k in one.state.params:  # 2 ranks, another summation order: within the derived bound (tests/tolerance.py)
        assert_within(two[f"params.{k}"], ref[f"params.{k}"], bound[k], rtol, k)
    evals = [json.loads((ranks / f"train-{r}.json").read_text()) for r in range(WORLD)]
    expected = [h for h in one.log_history if "eval_loss" in h]
    assert evals[0] == evals[1] and [e["step"] for e in evals[0]] == [e["step"] for e in expected] == [2, 4]
    for mine, theirs in zip(evals[0], expected):  # at params within the bound, on other batches: the token mean
        atol = causal_lm_eval_atol(model(), rows(6), bound, theirs["eval_token_loss"])
        assert mine["eval_token_loss"] == pytest.approx(theirs["eval_token_loss"], abs=atol, rel=0)


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these
def test_with_dropout_and_activation_checkpointing_sharded_matches_data_parallel(ranks):
    ddp = _same_on_every_rank(ranks, "ddp")  # the same per-rank dropout masks (seeded by rank)
    # The same rows on the same ranks, but the sharded kernels and norm may round other ways: the bound of
    # the dropout-free run (tests/tolerance.py), its sum|x_i| scaled by what dropout can add: kept activations
    # grow by 1 / (1 - p) at each dropout a path meets (the embedding's, then attention, projection and MLP
    # in each of the 2 blocks: 7), an estimate, as the masks also zero others.
    *_, per_step = _one_process_with_bounds()
    grow = (1 / 0.9) ** 7
    scaled = [
        ({k: a * grow for k, a in atol.items()}, {k: g * grow for k, g in grads.items()}, n, m)
        for atol, grads, n, m in per_step
    ]
    params, moments = clipped_sgd_atol(scaled, LR, MOMENTUM)
    for name in ("dropout", "recompute"):
        got = _same_on_every_rank(ranks, name)
        for k in params:
            assert_within(got[f"params.{k}"], ddp[f"params.{k}"], params[k], sgd_rtol(STEPS), f"{name}: {k}")
            m = f"opt_state.1.momentum.{k}"
            assert_within(got[m], ddp[m], moments[k], sgd_rtol(STEPS), f"{name}: {m}")


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these
def test_each_rank_holds_about_half_the_state(ranks):
    net = model()
    state = init_state(net, linear())
    full = _local_bytes(state.params) * 2 + _local_bytes(state.opt_state)  # params + grads + momenta
    for r in range(WORLD):
        got = json.loads((ranks / f"bytes-{r}.json").read_text())["plain"]
        assert got["grad_bytes"] < 0.55 * _local_bytes(state.params)
        assert (got["state_bytes"] + got["grad_bytes"]) / full <= 0.55


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these
def test_every_rank_sees_a_nan_in_another_ranks_shard(ranks):
    got = [json.loads((ranks / f"bytes-{r}.json").read_text())["nonfinite"] for r in range(WORLD)]
    assert got == [["w"], ["w"]]  # a diverged run stops on every rank, not on the one holding the NaN


@pytest.mark.slow  # a torchrun launch each
@pytest.mark.parametrize("case", ["raise", "raise-alive"])
def test_an_error_on_one_rank_ends_both_without_a_hang_and_the_others_name_it(tmp_path, case):
    started = time.monotonic()
    _, done = _launch(tmp_path, case, timeout=200)
    assert done.returncode != 0
    assert (
        time.monotonic() - started < 150
    )  # the group's timeout is 5 s; rank 1 would sleep 240 s (slack: a loaded CI box)
    named = "[rank0]: RuntimeError: rank 0 stopped: rank 1 raised KeyError: \"micro-batch has no 'labels' key"
    failures, cause = done.stderr.split("Root Cause")[-2:]
    if case == "raise-alive":  # rank 1 lives on: rank 0's collective times out and rank 0 names rank 1
        assert named in done.stderr
        return
    # rank 1 exits: torchrun names it as the first failure (exit 1 from the KeyError, or SIGABRT (-6) when
    # gloo's threads abort the exit of a rank that raised) and stops rank 0 at once (SIGTERM), often before
    # rank 0's collective has noticed the lost peer; if rank 0 got there first it names rank 1, never the
    # transport alone (the lost-peer path itself: test_a_lost_peer_is_named_by_the_error_its_rank_recorded)
    assert "[rank1]: KeyError: \"micro-batch has no 'labels' key" in done.stderr
    assert "rank      : 1 (local_rank: 1)" in cause and ("exitcode  : 1" in cause or "exitcode  : -6" in cause)
    raised = [line for line in done.stderr.splitlines() if line.startswith("[rank0]: RuntimeError: ")]
    if raised:  # the error rank 0 raised (the last one; the transport's comes first, as its cause)
        assert raised[-1].startswith(named), raised
    else:
        assert "rank      : 0 (local_rank: 0)" in failures and "(SIGTERM)" in failures


def test_a_lost_peer_is_named_by_the_error_its_rank_recorded(tmp_path):
    import torch.distributed as dist

    from trainfold.distributed.distributed import failure_of

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        lost = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
        unnamed = failure_of(lost, 0, 2)  # a peer is gone and recorded nothing: killed, or hanging elsewhere
        assert isinstance(unnamed, RuntimeError) and "no other rank recorded an error" in str(unnamed)
        own = KeyError("micro-batch has no 'labels' key")
        assert failure_of(own, 1, 2) is own  # rank 1's own error is recorded in the store and raised as it is
        named = failure_of(lost, 0, 2)
        assert str(named).startswith("rank 0 stopped: rank 1 raised KeyError: \"micro-batch has no 'labels' key")
        assert "Connection closed by peer" in str(named)
    finally:
        dist.destroy_process_group()


# -- one process -----------------------------------------------------------------------------------


@pytest.fixture
def one_rank_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_a_one_rank_fully_shard_step_is_the_step_bitwise_and_donates(one_rank_mesh):
    from trainfold.core.state import DonatedStateError

    net = sharded_net(model(), one_rank_mesh)
    state = init_state(net, optimizer(), seed=3, copy=False)
    assert type(state.opt_state[1].count) is torch.Tensor  # counters stay plain
    step, plain_step = make_step(net, causal_lm, optimizer()), make_step(model(), causal_lm, optimizer())
    plain = init_state(model(), optimizer(), seed=3)
    for s in range(3):
        before, state = state, step(state, batch(s, 0, 1), donate=True)
        plain = plain_step(plain, batch(s, 0, 1))
    with pytest.raises(DonatedStateError):
        before.params["tok.weight"]
    _assert_equal(tensors(gathered(state)), tensors(plain))
    assert torch.equal(state.metrics["loss"], plain.metrics["loss"])


def test_an_objective_with_a_frozen_reference_on_a_fully_shard_module_is_refused_by_name(one_rank_mesh):
    reference = {k: v * 0.5 for k, v in init_state(model(), optimizer()).params.items()}

    def objective(forward, params, micro, n, key):
        logits = forward(params, {"input_ids": micro["input_ids"]})
        with torch.no_grad():
            ref = forward(reference, {"input_ids": micro["input_ids"]})
        return causal_lm(logits - ref, micro["labels"], n), {}

    net = sharded_net(model(), one_rank_mesh)
    step = make_step(net, optimizer=optimizer(), objective=objective)
    with pytest.raises(TypeError, match=r"runs on its own params only, so an objective cannot call forward on other"):
        step(init_state(net, optimizer(), seed=3, copy=False), batch(0, 0, 1), donate=True)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_transformers_llama_is_wrapped_per_decoder_layer_and_steps_as_unwrapped(one_rank_mesh, recompute):
    transformers = pytest.importorskip("transformers")
    from torch.distributed.fsdp import FSDPModule

    from trainfold.step.fsdp import layer_blocks

    def llama():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=40,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            tie_word_embeddings=True,
        )
        return transformers.LlamaForCausalLM(config)

    wrapped = llama()
    assert [type(b).__name__ for b in layer_blocks(wrapped)] == ["LlamaDecoderLayer"] * 2  # _no_split_modules
    sharded_net(wrapped, one_rank_mesh)
    assert all(isinstance(b, FSDPModule) for b in wrapped.model.layers) and isinstance(wrapped, FSDPModule)
    plain = make_step(llama(), causal_lm, optimizer(), gradient_checkpointing=recompute)(
        init_state(llama(), optimizer(), seed=3), batch(0, 0, 1)
    )
    step = make_step(wrapped, causal_lm, optimizer(), gradient_checkpointing=recompute)
    got = step(init_state(wrapped, optimizer(), seed=3, copy=False), batch(0, 0, 1), donate=True)
    _assert_equal(tensors(gathered(got)), tensors(plain))


def test_what_fsdp_cannot_do_is_refused_by_name(one_rank_mesh):
    from trainfold.step.ensemble import stack_ensemble

    net = model()
    with pytest.raises(TypeError, match=r"make_step\(sharding=.*fully_shard.*init_state\(model, optimizer, copy=False"):
        make_step(net, causal_lm, optimizer(), sharding=one_rank_mesh)
    wrapped = sharded_net(model(), one_rank_mesh)
    with pytest.raises(TypeError, match=r"compile=True with a fully_shard \(FSDP2\) module is not supported"):
        make_step(wrapped, causal_lm, optimizer(), compile=True)
    with pytest.raises(TypeError, match=r"wrapped with fully_shard \(FSDP2\).*lent, donated state"):
        make_step(wrapped, causal_lm, optimizer())(init_state(wrapped, optimizer()), batch(0, 0, 1))
    shards = init_state(wrapped, optimizer(), copy=False)
    with pytest.raises(TypeError, match=r"vmapped ensembles over DTensor shards are not supported \(params is sharded"):
        stack_ensemble([shards, shards])
    with pytest.raises(ValueError, match=r"transformer_layer_cls_to_wrap'\]=\['Nope'\] names no module of TinyLM"):
        from trainfold.step.fsdp import FullShard, fully_shard_model

        fully_shard_model(model(), one_rank_mesh, FullShard(layer_classes=("Nope",)))


def test_fsdp_settings_take_what_fully_shard_does_and_refuse_the_rest_by_name(tmp_path):
    from trainfold.step.fsdp import FullShard

    assert TrainingArguments(fsdp="full_shard", save_strategy="no").full_shard
    assert TrainingArguments(fsdp=["full_shard", "auto_wrap"], save_strategy="no").full_shard
    assert not TrainingArguments(fsdp="").full_shard and TrainingArguments(fsdp="").fsdp is None
    args = TrainingArguments(
        fsdp="full_shard offload",
        bf16=True,
        fsdp_config={"transformer_layer_cls_to_wrap": "Block", "reshard_after_forward": False, "xla": False},
    )
    expected = FullShard(("Block",), reshard_after_forward=False, offload=True, param_dtype=torch.bfloat16)
    assert args.fsdp_plan == expected
    assert TrainingArguments(fsdp="full_shard").fsdp_plan == FullShard()
    for value, named in (("shard_grad_op", "'shard_grad_op'"), ("hybrid_shard", "'hybrid_shard'")):
        with pytest.raises(ValueError, match=rf"fsdp='{value}' is not supported: {named}.*write fsdp='full_shard'"):
            TrainingArguments(fsdp=value, save_strategy="no")
    with pytest.raises(ValueError, match=r"fsdp_config\['limit_all_gathers'\]=True is not supported"):
        TrainingArguments(fsdp="full_shard", fsdp_config={"limit_all_gathers": True})
    with pytest.raises(ValueError, match=r"fsdp_config is set but fsdp is not"):
        TrainingArguments(fsdp_config={"reshard_after_forward": False})
    with pytest.raises(ValueError, match=r"fsdp='full_shard' with fp16 .* use bf16=True"):
        TrainingArguments(fsdp="full_shard", save_strategy="no", fp16=True)
    with pytest.raises(ValueError, match=r"fsdp='full_shard' with torch_compile is not supported"):
        TrainingArguments(fsdp="full_shard", save_strategy="no", torch_compile=True)
    args = TrainingArguments(
        output_dir=str(tmp_path), fsdp="full_shard", save_strategy="no", max_steps=1, report_to="none"
    )
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 4
    with pytest.raises(ValueError, match=r"fsdp='full_shard' shards over the ranks of a torchrun job: run it under"):
        train(model(), args, rows)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "train")


def test_a_collective_outside_the_step_names_a_lost_peer_instead_of_the_transport_error(tmp_path, monkeypatch):
    # a rank killed while the others sum (counting items, agreeing to stop), gather (evaluation) or meet at the
    # end of train got gloo's bare "Connection closed by peer"; the step's own collectives were named already
    import torch.distributed as dist

    from trainfold.distributed.distributed import ProcessGroupCollective, failure_of

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        lost = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")

        def closed(*args, **kwargs):
            raise lost

        monkeypatch.setattr(dist, "all_reduce", closed)
        monkeypatch.setattr(dist, "all_gather", closed)
        collective = ProcessGroupCollective(rank=0, world_size=2)
        for call in (lambda: collective.sum_([torch.ones(1)]), lambda: collective.all_gather(torch.ones(1))):
            with pytest.raises(
                RuntimeError,
                match=r"rank 0 stopped: a collective timed out or lost its peer .*torchrun's error summary names the "
                r"rank that exited .* start every rank again with resume_from_checkpoint=True.*Connection closed",
            ) as raised:
                call()
            assert raised.value.__cause__ is lost
            assert failure_of(raised.value, 0, 2) is raised.value  # named once, when the step raises it again
    finally:
        dist.destroy_process_group()
