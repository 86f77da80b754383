"""The compiled sharded step on gloo: each block's forward compiled, the collectives eager, results as the eager step.

Run as a script, this file is the worker of the 2-process tests::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_sharded_compiled.py OUT_DIR BACKEND

It writes what each rank ends with to ``OUT_DIR``; the tests compare. By default the backend is
``aot_eager`` (the graphs AOTAutograd traces, run without generating code: bitwise the eager step);
``TRAINFOLD_SLOW=full`` runs inductor too (generated C++ kernels: within float32 rounding).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_sharded import batch, model, optimizer, rows, tensors, train_args
from tolerance import (
    EPS,
    adam_step_bounds,
    assert_within,
    causal_lm_eval_atol,
    causal_lm_step_abs_grads,
    reordered,
    row_abs_grads,
)
from torchrun import torchrun_ok

from trainfold import train
from trainfold.core.forward import make_forward
from trainfold.core.losses import causal_lm
from trainfold.core.state import init_state
from trainfold.data import pad_collate
from trainfold.step import make_step

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
STEPS = 2
CASES = (("dropout", 0.1, False), ("recompute", 0.1, True))  # both with GA 2 and clipping


def _worker(out: Path, backend: str) -> None:
    import torch.distributed as dist

    from trainfold.distributed.distributed import group_timeout
    from trainfold.step import sharded

    dist.init_process_group("gloo", timeout=group_timeout())
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sharded.make_mesh()
    peaks = {}
    for name, dropout, recompute in CASES:
        eager: list = []  # the eager run's states, step 0 (initial) to STEPS
        for kind in ("eager", "compiled", "prefetch"):  # prefetch: compiled, the next block's all-gather in flight
            net = model(dropout)
            sharding = sharded.Sharding(mesh, prefetch=kind == "prefetch")
            compile = kind != "eager" and backend
            step = make_step(
                net, causal_lm, optimizer(), sharding=sharding, gradient_checkpointing=recompute, compile=compile
            )
            states = [sharded.shard_state(init_state(net, optimizer(), seed=3), mesh)]
            with sharded.gathered_bytes() as peak:  # compiled: each step from the eager run's state before it
                for s in range(STEPS):
                    states.append(step((eager or states)[s], batch(s, rank, world)))
            eager = eager or states
            assert not any("forward" in vars(b) for b in net.blocks)  # the module is left as it was
            for s, state in enumerate(states):
                save_file(tensors(sharded.gather_state(state)), out / f"{name}-{kind}-{s}-{rank}.safetensors")
            peaks[f"{name}-{kind}"] = peak[0]
    (out / f"peaks-{rank}.json").write_text(json.dumps(peaks))
    for kind, over in (("eager", {}), ("compiled", {"torch_compile": True, "torch_compile_backend": backend})):
        trained = model()
        steps = 2 if backend == "aot_eager" else 1  # inductor: one step from the same state (see the test)
        args = train_args(
            out / f"train-{kind}", fsdp="full_shard", gradient_checkpointing=True, max_steps=steps, eval_steps=1, **over
        )
        res = train(trained, args, rows(), rows(6), data_collator=pad_collate())
        full = sharded.gather_state(res.state)  # a collective: every rank
        save_file(tensors(full), out / f"train-{kind}-{rank}.safetensors")
        evals = [h["eval_loss"] for h in res.log_history if "eval_loss" in h]
        (out / f"train-{kind}-{rank}.json").write_text(json.dumps(evals))
    dist.destroy_process_group()


def _launch(out: Path, backend: str, timeout: float) -> Path:
    torchrun_ok(__file__, out, backend, nproc=WORLD, timeout=timeout)
    return out


BACKENDS = ["aot_eager", "inductor"] if os.environ.get("TRAINFOLD_SLOW") == "full" else ["aot_eager"]


@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _launch(tmp_path_factory.mktemp(f"compiled-{request.param}"), request.param, timeout=600)


def _same_on_every_rank(out: Path, name: str) -> dict[str, torch.Tensor]:
    per_rank = [load_file(out / f"{name}-{r}.safetensors") for r in range(WORLD)]
    for k in per_rank[0]:
        assert torch.equal(per_rank[0][k], per_rank[1][k]), f"{name}: {k} differs between ranks"
    return per_rank[0]


def _state(t: dict) -> SimpleNamespace:
    """The saved tensors of a clipped AdamW state as ``adam_step_bounds`` reads them."""
    params = {k.removeprefix("params."): v for k, v in t.items() if k.startswith("params.")}
    adam = {part: {k: t[f"opt_state.1.{part}.{k}"] for k in params} for part in ("mu", "nu")}
    opt = SimpleNamespace(**adam, count=t["opt_state.1.count"])
    return SimpleNamespace(
        params=params, opt_state=opt, metrics={k[8:]: v for k, v in t.items() if k[:8] == "metrics."}
    )


def _compare(got: dict, expected: dict, backend: str, bounds: dict | None = None, terms: int = 0) -> None:
    """``got`` is ``expected`` bitwise (aot_eager: the same aten kernels in the same order, the same dropout
    masks), or, where inductor's fused kernels sum in other orders, one AdamW step from the same state apart:
    params within ``bounds`` (``adam_step_bounds``), the step count equal, the loss's positive token terms
    reordered (``terms`` positions)."""
    keys = [k for k in expected if k.startswith(("params.", "opt_state.", "metrics."))]
    assert keys and set(keys) == set(got)
    if backend == "aot_eager":
        for key in keys:
            assert torch.equal(got[key], expected[key]), key
        return
    for k, bound in bounds.items():
        assert_within(got[f"params.{k}"], expected[f"params.{k}"], bound, EPS, k)
    assert torch.equal(got["opt_state.1.count"], expected["opt_state.1.count"])
    loss = expected["metrics.loss"].item()
    assert got["metrics.loss"].item() == pytest.approx(loss, abs=reordered(terms, loss), rel=0)


def _step_bounds(out: Path, case: str, s: int) -> tuple[dict, int]:
    """``adam_step_bounds`` of step ``s`` (from 1) of ``case``: sum|x_i| measured per row on the whole batch at
    the eager state before it, without dropout, scaled by what dropout can add (1 / (1 - p) at each of the 7
    dropouts a path meets: an estimate, as in test_sharded's dropout test); every position a term."""
    prev, want = _same_on_every_rank(out, f"{case}-eager-{s - 1}"), _same_on_every_rank(out, f"{case}-eager-{s}")
    sizes, terms = causal_lm_step_abs_grads(model(), batch(s - 1, 0, 1), _state(prev).params)
    sizes = {k: v * (1 / 0.9) ** 7 for k, v in sizes.items()}
    return adam_step_bounds(_state(prev), _state(want), sizes, terms, max_norm=0.5), terms


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these (reduced: aot_eager only)
@pytest.mark.parametrize("case", [name for name, _, _ in CASES])
def test_the_compiled_sharded_step_equals_the_eager_one_with_accumulation_clipping_dropout_checkpointing(ranks, case):
    backend, out = ranks
    for s in range(1, STEPS + 1):  # each compiled step from the eager run's state before it
        got, expected = _same_on_every_rank(out, f"{case}-compiled-{s}"), _same_on_every_rank(out, f"{case}-eager-{s}")
        _compare(got, expected, backend, *(_step_bounds(out, case, s) if backend != "aot_eager" else ()))


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these
@pytest.mark.parametrize("case", [name for name, _, _ in CASES])
def test_prefetching_the_next_block_changes_no_bit(ranks, case):
    _, out = ranks
    for s in range(1, STEPS + 1):
        got, expected = (
            _same_on_every_rank(out, f"{case}-prefetch-{s}"),
            _same_on_every_rank(out, f"{case}-compiled-{s}"),
        )
        _compare(got, expected, "aot_eager")


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these
def test_train_with_fsdp_and_torch_compile_under_torchrun_equals_the_eager_sharded_train(ranks):
    backend, out = ranks
    got, expected = _same_on_every_rank(out, "train-compiled"), _same_on_every_rank(out, "train-eager")
    evals = {
        k: [json.loads((out / f"train-{k}-{r}.json").read_text()) for r in range(WORLD)] for k in ("eager", "compiled")
    }
    assert evals["compiled"][0] == evals["compiled"][1]
    if backend == "aot_eager":
        _compare(got, expected, backend)
        assert len(evals["eager"][0]) == 2 and evals["compiled"][0] == evals["eager"][0]
        return
    # inductor: train() chains its steps, so the worker runs one (from the same initial state) and the
    # bound is one AdamW step's: sum|x_i| over every row (a step's 8 rows only drop terms), each row's loss
    # over the fewest labels 8 rows can have; positions: 8 rows of the longest length (tests/tolerance.py)
    net, data = model(), rows()
    forward, fewest = make_forward(net, {}), sum(sorted(len(r["labels"]) - 1 for r in data)[:8])
    ids, labels = ([torch.tensor([r[key]]) for r in data] for key in ("input_ids", "labels"))
    loss = lambda p, r: causal_lm(forward(p, {"input_ids": ids[r]}), labels[r], fewest)
    sizes = row_abs_grads(loss, dict(net.named_parameters()), range(len(data)))
    terms = 8 * max(len(r["input_ids"]) for r in data)
    want = _state(expected)
    zeros = {k: torch.zeros_like(v) for k, v in want.params.items()}
    prev = SimpleNamespace(opt_state=SimpleNamespace(mu=zeros))  # the initial AdamW state
    bounds = adam_step_bounds(prev, want, sizes, terms, max_norm=0.5)
    _compare(got, expected, backend, bounds, terms)
    assert len(evals["eager"][0]) == 1  # at params within the bound (first order), on the eval rows
    atol = causal_lm_eval_atol(model(), rows(6), bounds, evals["eager"][0][0])
    assert evals["compiled"][0][0] == pytest.approx(evals["eager"][0][0], abs=atol, rel=0)


@pytest.mark.slow  # 2 processes under torchrun: one launch for all of these
def test_compiled_blocks_gather_as_the_eager_step_and_prefetch_at_most_two_blocks(ranks):
    _, out = ranks
    net = model()
    blocks = [sum(p.nbytes for p in b.parameters()) for b in net.blocks]
    root = sum(p.nbytes for p in net.parameters()) - sum(blocks)
    for r in range(WORLD):
        peaks = json.loads((out / f"peaks-{r}.json").read_text())
        assert peaks["dropout-eager"] == root + max(blocks)  # one block at a time
        assert peaks["dropout-prefetch"] == root + 2 * max(blocks)  # and the next one in flight
        for name, _, _ in CASES:
            assert peaks[f"{name}-compiled"] == peaks[f"{name}-eager"] <= root + max(blocks), name
            assert peaks[f"{name}-prefetch"] <= root + 2 * max(blocks), name


@pytest.mark.slow  # 2 spawned processes (reduced: the quick model, aot_eager; full: inductor)
def test_the_fsdp_benchmark_times_the_compiled_and_prefetching_variants(full_slow):
    backend = "inductor" if full_slow else "aot_eager"
    done = subprocess.run(
        [sys.executable, "benchmarks/fsdp.py", "--quick", "--compile", backend, "--prefetch"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for row in ("sharded eager", "sharded eager + prefetch", f"sharded compiled ({backend}) + prefetch"):
        assert f"| {row} | 1 |" in done.stdout, row
    if full_slow:  # the benchmark's one smoke test; in full also against a hand fully_shard loop
        vs = subprocess.run(
            [sys.executable, "benchmarks/fsdp.py", "--quick", "--vs-fully-shard"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert vs.returncode == 0 and "| FSDP2 fully_shard loop | 1 |" in vs.stdout, vs.stderr[-3000:]


# -- one process -----------------------------------------------------------------------------------


@pytest.fixture
def one_rank_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _counting_backend() -> tuple[list[int], object]:
    from torch._dynamo.backends.debugging import aot_eager

    compiles = [0]

    def backend(gm, example_inputs):
        compiles[0] += 1
        return aot_eager(gm, example_inputs)

    return compiles, backend


def test_blocks_of_one_class_share_one_graph_that_no_later_step_recompiles(one_rank_mesh):
    from trainfold.step import sharded

    compiles, backend = _counting_backend()
    net = model(0.1)
    state = sharded.shard_state(init_state(net, optimizer(), seed=3), one_rank_mesh)
    eager = make_step(net, causal_lm, optimizer(), sharding=one_rank_mesh)
    step = make_step(net, causal_lm, optimizer(), sharding=one_rank_mesh, compile=backend)
    a = b = state
    for s in range(3):
        a, b = eager(a, batch(s, 0, 1)), step(b, batch(s, 0, 1))
    assert compiles[0] == 1  # 2 blocks, 3 steps of 2 micro-batches: one graph
    assert all(
        torch.equal(x, y)
        for x, y in zip(tensors(sharded.gather_state(a)).values(), tensors(sharded.gather_state(b)).values())
    )
    assert not any("forward" in vars(block) for block in net.blocks)
    logits = net(batch(0, 0, 1)[0]["input_ids"])  # the user's module still runs, eagerly, on its own weights
    assert logits.shape == (4, 10, 40)


def test_an_optimizer_without_an_elementwise_path_updates_the_dtensors(one_rank_mesh):
    from trainfold.optim import sgd
    from trainfold.step import sharded

    net, opt = model(), sgd(0.1, momentum=0.9)
    state = sharded.shard_state(init_state(net, opt, seed=3), one_rank_mesh)
    eager = make_step(net, causal_lm, opt, sharding=one_rank_mesh)(state, batch(0, 0, 1))
    compiled = make_step(net, causal_lm, opt, sharding=one_rank_mesh, compile="aot_eager")(state, batch(0, 0, 1))
    for k in state.params:
        assert torch.equal(compiled.params[k].full_tensor(), eager.params[k].full_tensor()), k


def test_an_elementwise_optimizer_on_the_local_shards_is_bitwise_the_update_on_the_dtensors(one_rank_mesh):
    from trainfold.optim import GradientTransformation, chain
    from trainfold.step import sharded

    net = model(0.1)
    keep = GradientTransformation(init=lambda params: None, update=lambda g, s, p: (g, s), keeps_state=False)
    states = {}
    for name, opt in (("local", optimizer()), ("dtensor", chain(keep, optimizer()))):  # no element-wise path
        state = sharded.shard_state(init_state(net, opt, seed=3), one_rank_mesh)
        step = make_step(net, causal_lm, opt, sharding=one_rank_mesh)
        for s in range(2):
            state = step(state, batch(s, 0, 1))
        states[name] = sharded.gather_state(state)
    for k in states["local"].params:
        assert torch.equal(states["local"].params[k], states["dtensor"].params[k]), k
    assert str(state.params["tok.weight"].placements) == "(Shard(dim=0),)"


@pytest.mark.parametrize("recompute", [False, True])
def test_prefetch_with_two_policy_forwards_and_a_frozen_reference_changes_no_bit(one_rank_mesh, recompute):
    from trainfold.step import sharded

    net = model(0.1)
    reference = {k: v * 0.5 for k, v in init_state(net, optimizer()).params.items()}  # plain, never gathered

    def objective(forward, params, micro, n, key):  # DPO's shape: the policy twice, the reference without grad
        ids = micro["input_ids"]
        first, second = forward(params, {"input_ids": ids}), forward(params, {"input_ids": ids.flip(0)})
        with torch.no_grad():
            ref = forward(reference, {"input_ids": ids})
        return causal_lm(first + second.flip(0) - ref, micro["labels"], n), {}

    state = sharded.shard_state(init_state(net, optimizer(), seed=3), one_rank_mesh)
    got = {}
    for ahead in (False, True):
        sharding = sharded.Sharding(one_rank_mesh, prefetch=ahead)
        step = make_step(
            net, optimizer=optimizer(), objective=objective, sharding=sharding, gradient_checkpointing=recompute
        )
        s = state
        with sharded.gathered_bytes() as peak:
            for i in range(2):
                s = step(s, batch(i, 0, 1))
        got[ahead] = (tensors(sharded.gather_state(s)), peak[0])
    assert all(torch.equal(got[True][0][k], got[False][0][k]) for k in got[False][0])
    blocks = [sum(p.nbytes for p in b.parameters()) for b in net.blocks]
    root = sum(p.nbytes for p in net.parameters()) - sum(blocks)
    assert got[False][1] <= root + max(blocks) < got[True][1] <= root + 2 * max(blocks)


def test_the_inductor_mode_travels_with_torchs_random_kernels():
    from trainfold.step.sharded_compiled import BlockCompiler

    assert BlockCompiler("inductor").options() == {"fallback_random": True}
    assert BlockCompiler("inductor", "max-autotune-no-cudagraphs").options() == {
        "max_autotune": True,
        "coordinate_descent_tuning": True,
        "fallback_random": True,
    }
    assert BlockCompiler("aot_eager", "default").options() is None


def test_a_transformers_llama_with_checkpointing_steps_compiled_as_eager(one_rank_mesh):
    transformers = pytest.importorskip("transformers")
    from trainfold.step import sharded

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
    llama = transformers.LlamaForCausalLM(config)
    state = sharded.shard_state(init_state(llama, optimizer(), seed=3), one_rank_mesh)
    options = dict(sharding=one_rank_mesh, gradient_checkpointing=True)
    eager = make_step(llama, causal_lm, optimizer(), **options)(state, batch(0, 0, 1))
    compiled = make_step(llama, causal_lm, optimizer(), compile="aot_eager", **options)(state, batch(0, 0, 1))
    got, expected = tensors(sharded.gather_state(compiled)), tensors(sharded.gather_state(eager))
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_what_the_compiled_sharded_step_cannot_compile_is_refused_by_name(one_rank_mesh):
    from trainfold.step import sharded

    with pytest.raises(ValueError, match=r"Linear has none .*use compile=False for this model"):
        make_step(torch.nn.Linear(2, 2), causal_lm, optimizer(), sharding=one_rank_mesh, compile=True)
    with pytest.raises(ValueError, match=r"gathers the whole model \(per_block=False\); use Sharding\(mesh\)"):
        make_step(model(), causal_lm, optimizer(), sharding=sharded.Sharding(one_rank_mesh, False), compile=True)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "aot_eager")
