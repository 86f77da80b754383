"""The micro-batch driver every step variant composes: one count, one seeding, one sum, one wrapper to compile."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import EPS, adam_first_step_atol, assert_within, gamma, grad_atol, row_abs_grads
from torch import nn

from trainfold import adamw, chain, clip_by_global_norm, init_state, make_step
from trainfold.core.collective import item_count, items_in_batch
from trainfold.core.forward import make_forward
from trainfold.core.losses import cross_entropy
from trainfold.core.rng import derive_seed
from trainfold.core.tree import flatten
from trainfold.step import StepPlan, compile_step
from trainfold.step.amp import LossScaling
from trainfold.step.driver import accumulate, micro_seed
from trainfold.step.ensemble import init_ensemble_state, make_ensemble_step, stack_batches
from trainfold.step.fallback import CompileFallbackWarning

STEP = Path(__file__).resolve().parents[1] / "src" / "trainfold" / "step"


class Mirror:
    """A collective of ``world`` ranks that all hold this rank's data: each sum is ``world`` times the tensor."""

    def __init__(self, world: int, rank: int = 0) -> None:
        self.world, self.rank, self.calls = world, rank, 0

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        self.calls += 1
        for t in tensors:
            t.mul_(self.world)


def labels(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(0, 2, (n,), generator=g)
    out[torch.rand(n, generator=g) < 0.4] = -100
    return out


def count(micro: dict) -> torch.Tensor:
    return item_count((micro["labels"] != -100).sum())


def bitwise(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


# -- examples -------------------------------------------------------------------------------------------------


def test_items_are_counted_over_micro_batches_then_summed_over_ranks_once():
    batch = [{"labels": torch.tensor([0, -100, 1])}, {"labels": torch.tensor([-100, -100])}, {"labels": torch.ones(4)}]
    assert items_in_batch(count, batch).item() == 6
    mirror = Mirror(3)
    assert items_in_batch(count, batch, mirror).item() == 18
    assert mirror.calls == 1
    assert items_in_batch(count, batch).dtype == torch.int64


def test_each_micro_batch_draws_from_its_own_seed_and_the_global_generators_are_restored():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    drawn = []

    def micro(mb, key):
        drawn.append((torch.rand(()).item(), torch.rand((), generator=key).item()))
        return torch.zeros(()), {}, None

    accumulate(micro, [{}] * 3, (7,), 5, 1, torch.device("cpu"))
    for i, (ambient, keyed) in enumerate(drawn):
        seed = derive_seed(7, 5, i, 1)
        assert ambient == torch.rand((), generator=torch.Generator().manual_seed(seed)).item()
        assert keyed == torch.rand((), generator=torch.Generator().manual_seed(seed ^ 1)).item()
    assert len({d for d in drawn}) == 3
    assert torch.equal(torch.random.get_rng_state(), before)
    assert micro_seed((7,), 5, 0, None) == derive_seed(7, 5, 0)  # an ensemble without ranks: no rank part


def test_accumulate_sums_losses_aux_and_gradients():
    def micro(mb, key):
        return mb["x"].sum(), {"n": mb["x"].new_ones(())}, [mb["x"] * 1, None]

    sums = accumulate(micro, [{"x": torch.full((2,), float(i))} for i in range(1, 4)], (0,), 0, 0, torch.device("cpu"))
    assert sums.loss.item() == 12.0 and sums.aux["n"].item() == 3.0
    assert sums.grads[0].tolist() == [6.0, 6.0] and sums.grads[1] is None


def test_compile_step_wraps_a_step_of_make_step_as_compile_true_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = chain(clip_by_global_norm(1.0), adamw(1e-2, weight_decay=0.1))
    wrapped = compile_step(make_step(model, cross_entropy, opt), backend="aot_eager")
    flagged = make_step(model, cross_entropy, opt, compile="aot_eager")
    state = init_state(model, opt)
    g = torch.Generator().manual_seed(1)
    batches = [
        [{"input": torch.randn(5, 3, generator=g), "labels": labels(5, s)} for s in (i, i + 9)] for i in range(2)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        a = b = state
        for batch in batches:
            a, b = wrapped(a, batch), flagged(b, batch)
    assert bitwise(a, b)
    assert int(a.step) == 2
    assert isinstance(wrapped.plan, StepPlan)  # a compiled step can be inspected like the eager one


def test_a_compiled_step_without_items_counts_once_and_learns_nothing():
    calls = []

    def counting(micro):
        calls.append(1)
        return (micro["labels"] != -100).sum()

    model = nn.Linear(3, 2)
    opt = adamw(0.1)
    step = make_step(model, cross_entropy, opt, count_items=counting, compile="aot_eager")
    state = init_state(model, opt)
    batch = [{"input": torch.ones(2, 3), "labels": torch.full((2,), -100)}] * 2
    with pytest.warns(RuntimeWarning, match="no labels other than -100"):
        new = step(state, batch)
    assert len(calls) == 2  # once per micro-batch, not again by an eager fallback
    assert int(new.step) == 1 and torch.equal(new.params["weight"], state.params["weight"])
    assert int(new.nonfinite_losses) == 1


def test_the_ensemble_sums_counts_losses_and_gradients_over_ranks_like_make_step():
    torch.manual_seed(0)
    models = [nn.Linear(3, 2) for _ in range(2)]
    opt = chain(clip_by_global_norm(0.5), adamw(0.1))
    state = init_ensemble_state(models, opt)
    g = torch.Generator().manual_seed(3)
    member = [[{"input": torch.randn(4, 3, generator=g), "labels": labels(4, m)}] for m in range(2)]
    batch = stack_batches(member)
    alone = make_ensemble_step(models[0], cross_entropy, opt)(state, batch)
    mirror = Mirror(2)
    mirrored = make_ensemble_step(models[0], cross_entropy, opt, collective=mirror)(state, batch)
    assert mirror.calls == 2  # the count, then the gradients with the loss
    assert mirrored.metrics["num_items"].tolist() == [2 * n for n in alone.metrics["num_items"].tolist()]
    assert bitwise(mirrored.params, alone.params)
    assert torch.equal(mirrored.metrics["loss"], alone.metrics["loss"])
    step = make_step(models[0], cross_entropy, opt, collective=Mirror(2))  # member 0 on its own, same ranks
    own = step(init_state(models[0], opt), member[0])
    # the member in the vmapped ensemble and the model alone add the 2 ranks' 4 rows through other kernels:
    # gradients within grad_atol of the rows' measured sizes, plus the clip coefficient's relative difference
    # (|dg| / |g| + gamma(N)) times |g|; AdamW's first step then lands within adam_first_step_atol of its
    # reference gradient (the first moment / (1 - b1)) (tests/tolerance.py)
    forward, (x, y), half = make_forward(models[0], {}), member[0][0].values(), int(own.metrics["num_items"]) // 2
    row = lambda p, r: cross_entropy(forward(p, {"input": x[r : r + 1]}), y[r : r + 1], half)
    sizes = row_abs_grads(row, init_state(models[0], opt).params, range(4))
    atol, norm = grad_atol(sizes, 8), own.metrics["grad_norm"].item()
    rho = (
        (
            sum(atol[k] ** 2 * v.numel() for k, v in sizes.items()) ** 0.5 / norm
            + gamma(sum(v.numel() for v in sizes.values()))
        )
        if norm > 0.5
        else 0.0
    )
    for k, v in own.params.items():
        grad = own.opt_state[1].mu[k] / 0.1  # b1 = 0.9: m = 0.1 g after one step
        bound = adam_first_step_atol(grad, atol[k] + rho * grad.abs().max().item(), lr=0.1)
        assert_within(mirrored.params[k][0], v, bound, EPS, k)


def test_the_step_variants_never_import_make_step_nor_each_other_backwards():
    """``make`` imports the variants; the driver imports no variant; no variant imports ``make``."""
    imported = {}
    for path in STEP.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported[path.stem] = {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
        } | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any("trainfold.step.make" in mods for name, mods in imported.items() if name not in ("__init__",))
    variants = {"trainfold.step.eager", "trainfold.step.compiled", "trainfold.step.fsdp"}
    assert not imported["driver"] & variants
    assert "trainfold.step.compiled" not in imported["eager"] | imported["fsdp"]


# -- properties -----------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 1000), cuts=st.sets(st.integers(1, 11)))
def test_the_count_does_not_depend_on_the_split(n, seed, cuts):
    y = labels(n, seed)
    edges = [0, *sorted(c for c in cuts if c < n), n]
    batch = [{"labels": y[a:b]} for a, b in zip(edges, edges[1:])]
    assert items_in_batch(count, batch).item() == int((y != -100).sum())


# -- errors ---------------------------------------------------------------------------------------------------


def test_compile_step_names_what_it_wraps_and_what_it_cannot_compile():
    with pytest.raises(TypeError, match="compile_step wraps a step of make_step"):
        compile_step(lambda state, batch: state)
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="loss_scaling .* with compile is not supported"):
        compile_step(make_step(model, cross_entropy, adamw(0.1), loss_scaling=LossScaling()))
