"""Tests for trainfold.evaluation.reducers: examples, then Hypothesis properties, then bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.evaluation.reducers import (
    Reduced,
    Reducer,
    accuracy,
    collecting,
    combine,
    compose,
    concatenating,
    counting,
    filtering,
    fold,
    mapping,
    mean_loss,
    merge_all,
    offloading,
    pad_concat,
    summing,
    taking,
    transduce,
    unreduced,
)

FAST = settings(max_examples=40, deadline=None)


def _pulls(items, log):
    for x in items:
        log.append(x)
        yield x


# Examples ------------------------------------------------------------------------------------


def test_compose_runs_transducers_left_to_right():
    xf = compose(mapping(lambda x: x + 1), filtering(lambda x: x % 2 == 0), mapping(lambda x: x * 10))
    assert transduce(xf, collecting(), [0, 1, 2, 3]) == [20, 40]


def test_taking_draws_exactly_n_items_and_stops():
    log: list[int] = []
    assert transduce(taking(3), collecting(), _pulls(range(100), log)) == [0, 1, 2]
    assert log == [0, 1, 2]
    log.clear()
    assert transduce(taking(0), collecting(), _pulls(range(100), log)) == []
    assert log == []


def test_taking_before_an_expensive_mapping_skips_the_rest():
    calls: list[int] = []
    xf = compose(taking(2), mapping(lambda x: calls.append(x) or x))
    transduce(xf, counting(), range(10))
    assert calls == [0, 1]


def test_an_inner_early_stop_propagates_through_taking_and_combine():
    inner = compose(taking(5), taking(2))
    assert transduce(inner, collecting(), range(10)) == [0, 1]
    log: list[int] = []
    both = combine({"two": taking(2)(collecting()), "three": taking(3)(collecting())})
    assert transduce(compose(), both, _pulls(range(10), log)) == {"two": [0, 1], "three": [0, 1, 2]}
    assert log == [0, 1, 2]


def test_fold_on_from_a_reduced_accumulator_draws_nothing():
    r = taking(1)(collecting())
    acc = fold(r, [7, 8])
    log: list[int] = []
    assert fold(r, _pulls([9], log), acc) is acc
    assert log == []
    assert r.complete(unreduced(acc)) == [7]


def test_steps_never_change_an_earlier_accumulator():
    r = collecting()
    a = fold(r, [1, 2])
    b = r.step(a, 3)
    c = r.step(a, 4)
    assert (r.complete(a), r.complete(b), r.complete(c)) == ([1, 2], [1, 2, 3], [1, 2, 4])


def test_mean_loss_is_the_token_level_mean_not_a_mean_of_batch_means():
    batches = [(torch.tensor(2.0), torch.tensor(1)), (torch.tensor(30.0), torch.tensor(10))]
    assert transduce(compose(), mean_loss(), batches) == pytest.approx(32 / 11)
    assert transduce(compose(), mean_loss(), []) != transduce(compose(), mean_loss(), [])  # NaN


def test_accuracy_ignores_masked_labels():
    items = [(torch.tensor([[1, 2]]), torch.tensor([[1, -100]])), (torch.tensor([[0, 0]]), torch.tensor([[1, 0]]))]
    assert transduce(compose(), accuracy(), items) == pytest.approx(2 / 3)


def test_concatenating_pads_nested_structures_with_minus_100():
    items = [
        {"p": (torch.ones(1, 2, 3), torch.tensor([1])), "l": torch.tensor([[5, 6]])},
        {"p": (torch.zeros(2, 1, 3), torch.tensor([2, 3])), "l": torch.tensor([[7], [8]])},
    ]
    out = transduce(compose(), concatenating(), items)
    assert out["p"][0].shape == (3, 2, 3)
    assert out["p"][0][1:, 1].eq(-100).all()
    assert out["p"][1].tolist() == [1, 2, 3]
    assert out["l"].tolist() == [[5, 6], [7, -100], [8, -100]]
    assert transduce(compose(), concatenating(), []) is None


def test_offloading_moves_every_n_items_and_holds_at_most_n():
    moved: list[tuple[int, ...]] = []
    chunks: list[int] = []
    held: list[int] = []

    def move(t):
        moved.append(tuple(t.shape))
        return t.clone()

    def watch(r):  # a counting transducer: records how many items wait in the buffer
        def step(acc, x):
            out = r.step(acc, x)
            held.append(unreduced(out)[0])
            return out

        return Reducer(init=r.init, step=step, complete=r.complete)

    def chunk_sizes(r):
        return Reducer(
            init=r.init, step=lambda acc, x: chunks.append(x.shape[0]) or r.step(acc, x), complete=r.complete
        )

    batches = [torch.full((2, 1 + i % 3), i) for i in range(7)]
    out = transduce(compose(), watch(offloading(3, move)(chunk_sizes(concatenating()))), batches)
    assert chunks == [6, 6, 2]
    assert len(moved) == 7  # every batch moved once, piece by piece, then concatenated on the host
    assert max(held) < 3
    assert torch.equal(out, pad_concat(batches))


def test_merge_all_and_a_combined_merge():
    r = combine({"n": counting(), "s": summing()})
    acc = merge_all(r, [fold(r, [1, 2]), fold(r, []), fold(r, [3])])
    assert r.complete(acc) == {"n": 3, "s": 6}


# Properties -----------------------------------------------------------------------------------


@st.composite
def ragged_batches(draw, max_batches=6, trailing=()):
    n = draw(st.integers(1, max_batches))
    out = []
    for _ in range(n):
        rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 5))
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed)
        out.append(torch.randint(0, 50, (rows, cols, *trailing), generator=g))
    return out


def _splits(draw, n):
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    bounds = [0, *cuts, n]
    return list(itertools.pairwise(bounds))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b if not isinstance(a, float) else a == pytest.approx(b, rel=1e-12)


REDUCERS = {
    "mean_loss": (mean_loss, lambda b: (b.float().sum(), b.numel())),
    "accuracy": (accuracy, lambda b: (b % 3, b % 2 - (b % 7 == 0).long() * 101)),
    "counting": (counting, lambda b: b),
    "summing": (summing, lambda b: int(b.sum())),
    "concatenating": (concatenating, lambda b: b),
    "combine": (lambda: combine({"c": concatenating(), "n": counting()}), lambda b: b),
    "mapped and filtered": (
        lambda: compose(filtering(lambda x: x % 2 == 0), mapping(lambda x: x * 3))(summing()),
        lambda b: int(b.sum()),
    ),
}


@FAST
@given(data=st.data(), name=st.sampled_from(sorted(REDUCERS)))
def test_merge_agrees_with_one_whole_fold_for_any_split(data, name):
    make, item = REDUCERS[name]
    r = make()
    items = [item(b) for b in data.draw(ragged_batches())]
    whole = r.complete(fold(r, items))
    parts = [fold(r, items[a:b]) for a, b in _splits(data.draw, len(items))]
    assert _same(r.complete(merge_all(r, parts)), whole)


@FAST
@given(data=st.data(), name=st.sampled_from(sorted(REDUCERS)))
def test_fold_over_xs_plus_ys_equals_fold_over_xs_then_ys(data, name):
    make, item = REDUCERS[name]
    r = make()
    items = [item(b) for b in data.draw(ragged_batches())]
    k = data.draw(st.integers(0, len(items)))
    assert _same(r.complete(fold(r, items[k:], fold(r, items[:k]))), r.complete(fold(r, items)))


FUNCS = [lambda x: x + 1, lambda x: x * 3, lambda x: -x, lambda x: x // 2, lambda x: x % 5]


@FAST
@given(xs=st.lists(st.integers(-100, 100), max_size=20), i=st.integers(0, 4), j=st.integers(0, 4))
def test_mapping_f_then_mapping_g_equals_mapping_g_after_f(xs, i, j):
    f, g = FUNCS[i], FUNCS[j]
    two = transduce(compose(mapping(f), mapping(g)), collecting(), xs)
    one = transduce(mapping(lambda x: g(f(x))), collecting(), xs)
    assert two == one == [g(f(x)) for x in xs]


@FAST
@given(batches=st.one_of(ragged_batches(), ragged_batches(trailing=(2,))), every=st.none() | st.integers(1, 4))
def test_padded_concatenation_recovers_every_batch_exactly(batches, every):
    out = transduce(offloading(every), concatenating(), batches)
    width = max(b.shape[1] for b in batches)
    assert out.shape[:2] == (sum(b.shape[0] for b in batches), width)
    row = 0
    for b in batches:
        block = out[row : row + b.shape[0]]
        assert torch.equal(block[:, : b.shape[1]], b)
        assert block[:, b.shape[1] :].eq(-100).all()
        row += b.shape[0]


@FAST
@given(xs=st.lists(st.integers(0, 20), max_size=15), n=st.integers(0, 20))
def test_taking_n_equals_slicing(xs, n):
    assert transduce(taking(n), collecting(), xs) == xs[:n]


# Bad input ------------------------------------------------------------------------------------


def test_mismatched_trailing_dims_cannot_be_padded():
    with pytest.raises(ValueError, match=r"shapes \[\(1, 2, 3\), \(1, 2, 4\)\]: only dim 1"):
        pad_concat([torch.zeros(1, 2, 3), torch.zeros(1, 2, 4)])
    with pytest.raises(ValueError, match="only dim 1"):
        pad_concat([torch.zeros(1, 2), torch.zeros(1, 2, 1)])


def test_unsigned_and_bool_tensors_are_not_padded_with_minus_100():
    with pytest.raises(ValueError, match=r"torch.uint8.*-100.*signed dtype"):
        pad_concat([torch.zeros(1, 2, dtype=torch.uint8), torch.zeros(1, 3, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="bool"):
        pad_concat([torch.zeros(1, 2, dtype=torch.bool), torch.zeros(1, 3, dtype=torch.bool)])
    same = pad_concat([torch.zeros(1, 2, dtype=torch.uint8), torch.ones(1, 2, dtype=torch.uint8)])
    assert same.tolist() == [[0, 0], [1, 1]]  # nothing to pad: fine


def test_structure_mismatch_and_scalars_are_errors():
    with pytest.raises(ValueError, match="different keys"):
        pad_concat([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match="different lengths"):
        pad_concat([(torch.zeros(1),), (torch.zeros(1), torch.zeros(1))])
    with pytest.raises(ValueError, match="0-d"):
        pad_concat([torch.tensor(1.0)])
    with pytest.raises(TypeError, match="str"):
        pad_concat(["a"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="n >= 0"):
        taking(-1)
    with pytest.raises(ValueError, match="every >= 1"):
        offloading(0)
    with pytest.raises(TypeError, match="no merge"):
        merge_all(taking(1)(counting()), [])
    with pytest.raises(ValueError, match=r"accuracy.*\(2,\).*\(3,\)"):
        transduce(compose(), accuracy(), [(torch.zeros(2), torch.zeros(3))])
    assert isinstance(fold(taking(1)(counting()), [1]), Reduced)
