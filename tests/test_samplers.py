"""Samplers: concrete orders, then Hypothesis properties, then bad input."""

from __future__ import annotations

import collections
import math
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.data.samplers import Sampler, dataset_lengths, make_sampler, padded_cost
from trainfold.testing import sampler_configs, skewed_lengths

FAST = settings(max_examples=60, deadline=None)


def flat(steps):
    return [i for step in steps for micro in step for i in micro]


def all_ranks(sampler, epoch=0):
    return sampler.global_steps(epoch)


def lognormal_lengths(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.empty(n).log_normal_(5.0, 1.0, generator=g).clamp(1, 4096).round().tolist()]


# -- concrete examples -----------------------------------------------------------------------


def test_sequential_cuts_micro_batches_and_a_short_last_step():
    s = Sampler("sequential", 7, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert s.epoch_batches(0) == [[[0, 1], [2, 3]], [[4, 5], [6]]]


def test_random_order_is_torch_randperm_seeded_with_seed_plus_epoch():
    s = Sampler("random", 10, per_device_train_batch_size=10, seed=5)
    for epoch in (0, 3):
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        assert s.epoch_batches(epoch) == [[expected]]


def test_ranks_take_micro_batches_round_robin():
    s = Sampler("sequential", 8, per_device_train_batch_size=2, world_size=2)
    assert [attr_rank(s, r).epoch_batches(0) for r in (0, 1)] == [
        [[[0, 1]], [[4, 5]]],
        [[[2, 3]], [[6, 7]]],
    ]
    assert s.steps_per_epoch() == 2


def test_tail_smaller_than_world_is_topped_up_from_the_epoch_start():
    steps = Sampler("sequential", 5, per_device_train_batch_size=2, world_size=2).global_steps(0)
    assert steps[-1] == [[[4]], [[0]]]


def test_drop_last_keeps_only_micro_batches_full_on_every_rank():
    s = Sampler("sequential", 11, per_device_train_batch_size=2, gradient_accumulation_steps=2, drop_last=True)
    assert s.epoch_batches(0) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    assert (
        Sampler(
            "batch_rebalance",
            11,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            drop_last=True,
            lengths=[1] * 11,
        ).steps_per_epoch()
        == 2
    )


def test_group_by_length_puts_the_longest_first():
    lengths = [3, 9, 1, 4, 7, 2, 8, 5]
    s = Sampler("group_by_length", 8, per_device_train_batch_size=2, seed=0, lengths=lengths)
    assert s.epoch_batches(0)[0][0][0] == 1


def test_batch_rebalance_splits_by_padded_tokens():
    lengths = [100, 10, 10, 10, 10, 10, 10, 10]
    s = Sampler(
        "batch_rebalance",
        8,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        world_size=2,
        lengths=lengths,
    )
    step = s.global_steps(0)[0]
    micro = [m for rank in step for m in rank]
    assert [0] in micro  # the long sample alone
    assert sorted(len(m) for m in micro) == [1, 2, 2, 3]
    assert sorted(i for m in micro for i in m) == list(range(8))


def test_batch_rebalance_balances_ranks_over_an_epoch():
    n, world = 2048, 4
    lengths = lognormal_lengths(n)
    samplers = [
        Sampler(
            "batch_rebalance",
            n,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            world_size=world,
            rank=r,
            seed=1,
            lengths=lengths,
        )
        for r in range(world)
    ]
    totals = [sum(padded_cost(m, lengths) for step in s.epoch_batches(0) for m in step) for s in samplers]
    mean = sum(totals) / world
    assert max(totals) / mean < 1.03, totals
    step_ratios = []
    for step in samplers[0].global_steps(0):
        costs = [sum(padded_cost(m, lengths) for m in rank) for rank in step]
        step_ratios.append(max(costs) / (sum(costs) / world))
    assert sum(step_ratios) / len(step_ratios) < 1.15


def test_batch_rebalance_uses_the_seed():
    lengths = lognormal_lengths(64)
    a, b = (Sampler("batch_rebalance", 64, per_device_train_batch_size=2, seed=s, lengths=lengths) for s in (1, 2))
    assert a.epoch_batches(0) != b.epoch_batches(0)


def test_samplers_leave_global_rng_alone():
    before = torch.get_rng_state()
    for strategy in ("random", "group_by_length", "batch_rebalance"):
        Sampler(strategy, 50, per_device_train_batch_size=3, world_size=2, lengths=range(50)).global_steps(1)
    assert torch.equal(before, torch.get_rng_state())


def test_lengths_from_a_column_or_from_items():
    class Columns:
        column_names = ("input_ids", "length")

        def __len__(self):
            return 3

        def __getitem__(self, key):
            if key == "length":
                return [4, 5, 6]
            raise AssertionError("items must not be read when a length column exists")

    assert dataset_lengths(Columns()) == (4, 5, 6)
    items = [{"input_ids": torch.arange(n), "x": 0} for n in (2, 7)]
    assert dataset_lengths(items) == (2, 7)
    assert dataset_lengths([{"ids": [1, 2]}], model_input_name="ids") == (2,)


def test_lengths_from_batch_feature_items():
    transformers = pytest.importorskip("transformers")
    items = [transformers.BatchFeature({"input_ids": [1] * n}) for n in (3, 1)]
    assert dataset_lengths(items) == (3, 1)


def test_lengths_from_a_datasets_column():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1], [1, 2]], "length": [10, 20]})
    assert dataset_lengths(ds) == (10, 20)
    assert make_sampler("group_by_length", ds, per_device_train_batch_size=1).lengths == (10, 20)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_datasets_lengths_are_read_through_arrow_in_one_call(sizes, rnd):
    datasets = pytest.importorskip("datasets")
    import trainfold.data.lengths as samplers

    rows = {"input_ids": [[7] * n for n in sizes], "length": [3 * n + 1 for n in sizes]}
    picked = rnd.sample(range(len(sizes)), rnd.randint(1, len(sizes)))  # a row selection, as shuffle/select give
    ds = datasets.Dataset.from_dict(rows).select(picked)
    no_length = datasets.Dataset.from_dict({"input_ids": rows["input_ids"]}).select(picked)

    def per_item(*args):
        raise AssertionError("measured item by item")

    with mock.patch.object(samplers, "item_length", per_item):
        from_column = dataset_lengths(ds)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from_lists = dataset_lengths(no_length)
    assert from_column == tuple(3 * sizes[i] + 1 for i in picked)
    assert from_lists == tuple(sizes[i] for i in picked)
    assert all(type(n) is int for n in from_column + from_lists)


def test_nested_or_tensor_columns_are_still_measured_per_item():
    datasets = pytest.importorskip("datasets")
    nested = datasets.Dataset.from_dict({"input_ids": [[[1, 2, 3]], [[1], [2]]]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert dataset_lengths(nested) == (1, 2)  # len(item["input_ids"]), as before
        assert dataset_lengths(nested.with_format("torch")) == (3, 1)


def test_one_micro_batch_per_step_is_the_step_sorted_longest_first():
    lengths = [4, 9, 1, 7, 3, 8, 2]
    s = Sampler("batch_rebalance", 7, per_device_train_batch_size=3, seed=5, lengths=lengths)
    order = s.order(0)
    expected = [sorted(order[i : i + 3], key=lambda j: -lengths[j]) for i in range(0, 7, 3)]
    assert [step[0] for step in s.epoch_batches(0)] == expected


# -- properties ------------------------------------------------------------------------------


@FAST
@given(sampler_configs())
def test_every_rank_has_the_same_steps_each_with_one_to_accumulation_micro_batches(s):
    per_rank = [[len(step) for step in attr_rank(s, r).epoch_batches(0)] for r in range(s.world_size)]
    assert all(len(counts) == s.steps_per_epoch() for counts in per_rank)
    assert all(1 <= c <= s.gradient_accumulation_steps for counts in per_rank for c in counts)
    assert all(micro for step in s.epoch_batches(0) for micro in step)


def attr_rank(s, r):
    import attrs

    return attrs.evolve(s, rank=r)


@FAST
@given(sampler_configs())
def test_an_epoch_covers_the_dataset(s):
    steps = all_ranks(s)
    seen = [i for step in steps for rank in step for micro in rank for i in micro]
    n, g = s.num_samples, s.global_batch_size
    tail = n % g
    counts = collections.Counter(seen)
    assert set(counts) <= set(range(n))
    if not s.drop_last:
        assert set(counts) == set(range(n))
        assert len(seen) == n + (max(0, s.world_size - tail) if tail else 0)
    else:
        assert max(counts.values(), default=1) == 1
        assert len(seen) >= n // g * g
    full = n // g
    for step in steps[:full]:  # full steps: exactly accumulation micro-batches per rank
        assert all(len(rank) == s.gradient_accumulation_steps for rank in step)
        assert sum(len(m) for rank in step for m in rank) == g
        if s.strategy != "batch_rebalance":
            assert all(len(m) == s.per_device_train_batch_size for rank in step for m in rank)


@FAST
@given(sampler_configs(strategies=["random", "sequential", "group_by_length"]), st.integers(0, 3))
def test_order_is_a_permutation_and_steps_follow_it(s, epoch):
    order = s.order(epoch)
    assert sorted(order) == list(range(s.num_samples))
    if not s.drop_last and s.num_samples % s.global_batch_size == 0:
        # ranks interleave micro-batches; merging them back gives the order
        merged = []
        for step in all_ranks(s, epoch):
            for k in range(s.gradient_accumulation_steps):
                for rank in step:
                    merged.extend(rank[k])
        assert merged == order


@FAST
@given(sampler_configs(strategies=["group_by_length"]), st.integers(0, 3))
def test_group_by_length_longest_first_and_sorted_megabatches(s, epoch):
    order = s.order(epoch)
    lengths = s.lengths
    if not order:
        return
    assert lengths[order[0]] == max(lengths)
    n, g = s.num_samples, s.global_batch_size
    mega = max(1, min(n // (4 * g), s.megabatch_mult)) * g
    for start in range(0, n, mega):
        block = [lengths[i] for i in order[start : start + mega]]
        assert block == sorted(block, reverse=True)
    if s.rank == 0 and s.steps_per_epoch():
        assert order[0] in s.epoch_batches(epoch)[0][0]


@FAST
@given(sampler_configs(strategies=["batch_rebalance"]), st.integers(0, 2))
def test_batch_rebalance_groups_are_contiguous_in_length_order(s, epoch):
    order = s.order(epoch)
    g = s.global_batch_size
    lengths = s.lengths
    for step_no, step in enumerate(all_ranks(s, epoch)[: s.num_samples // g]):
        chunk = order[step_no * g : (step_no + 1) * g]
        ordered = sorted(chunk, key=lambda i: -lengths[i])
        groups = [m for rank in step for m in rank]
        assert all(groups)
        assert sorted(i for m in groups for i in m) == sorted(chunk)
        starts = sorted(ordered.index(m[0]) for m in groups)
        for m in groups:
            at = ordered.index(m[0])
            assert ordered[at : at + len(m)] == m
        assert starts[0] == 0
        assert sum(len(m) for m in groups) / len(groups) == s.per_device_train_batch_size


@FAST
@given(sampler_configs(), st.integers(0, 3))
def test_same_seed_same_order(s, epoch):
    import attrs

    assert s.epoch_batches(epoch) == attrs.evolve(s).epoch_batches(epoch)


@pytest.mark.parametrize("strategy", ["random", "group_by_length", "batch_rebalance"])
def test_different_seed_different_order(strategy):
    lengths = lognormal_lengths(300, seed=3)
    a, b = (Sampler(strategy, 300, per_device_train_batch_size=2, seed=s, lengths=lengths) for s in (0, 1))
    assert a.epoch_batches(0) != b.epoch_batches(0)
    assert a.epoch_batches(0) != a.epoch_batches(1)


@settings(max_examples=25, deadline=None)
@given(skewed_lengths(min_size=32, max_size=96), st.integers(1, 4), st.integers(1, 3))
def test_batch_rebalance_beats_equal_split_on_padded_tokens(lengths, world, accumulation):
    n = len(lengths)
    s = Sampler(
        "batch_rebalance",
        n,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        world_size=world,
        lengths=lengths,
        drop_last=True,
    )
    naive = Sampler(
        "random",
        n,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        world_size=world,
        lengths=lengths,
        drop_last=True,
    )
    cost = lambda smp: sum(padded_cost(m, lengths) for step in smp.global_steps(0) for rank in step for m in rank)
    assert cost(s) <= cost(naive)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["per_device_train_batch_size", "gradient_accumulation_steps", "world_size"])
@pytest.mark.parametrize("value", [0, -2])
def test_batch_sizes_must_be_positive(field, value):
    with pytest.raises(ValueError, match=f"{field}={value} must be a positive int"):
        Sampler("random", 4, **{field: value})


def test_configuration_errors_are_reported_together():
    with pytest.raises(ValueError, match=r"strategy='shuffle'.*rank=5"):
        Sampler("shuffle", 4, world_size=2, rank=5)


def test_length_strategies_need_matching_lengths():
    with pytest.raises(ValueError, match="needs lengths"):
        Sampler("group_by_length", 4)
    with pytest.raises(ValueError, match="lengths has 2 entries but num_samples=4"):
        Sampler("batch_rebalance", 4, lengths=[1, 2])


def test_items_without_the_model_input_key():
    with pytest.raises(KeyError, match=r"item 1 has no 'input_ids'.*\['text'\].*model_input_name="):
        make_sampler("group_by_length", [{"input_ids": [1]}, {"text": "hi"}])


def test_missing_length_column_warns_and_measures_items():
    class Columns(list):
        column_names = ("input_ids",)

    data = Columns([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    with pytest.warns(UserWarning, match="no column 'len'.*measuring"):
        assert dataset_lengths(data, length_column_name="len") == (2, 1)


def test_dataset_without_len_ignores_the_strategy_with_a_warning():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([{"input_ids": [1]}])

    with pytest.warns(UserWarning, match="'group_by_length' is ignored: Stream has no __len__"):
        s = make_sampler("group_by_length", Stream())
    assert s.num_samples is None
    with pytest.raises(TypeError, match="without __len__"):
        s.epoch_batches(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_sampler("random", Stream())  # the default strategy is ignored silently, as in HF


def test_padded_cost_counts_the_longest_times_the_size():
    assert padded_cost([1, 2, 3], [0, 5, 2, 1]) == 15
    assert padded_cost([], [1]) == 0
    assert math.isclose(padded_cost([0], [7]), 7)
