"""Collation, the resumable stream, and generation batching."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trainfold.core.state import Cursor, scalar
from trainfold.data import (
    StepBatch,
    keyed,
    pad_collate,
    sample_key,
    stream,
)
from trainfold.data.samplers import Sampler, make_sampler
from trainfold.testing import sampler_configs, token_items

FAST = settings(max_examples=40, deadline=None)


def items_of(lengths):
    return [{"input_ids": [i % 250 + 1] * n, "labels": [i % 250 + 1] * n} for i, n in enumerate(lengths)]


def noisy(items, keys):
    """A keyed collator: pads, and adds one random draw per sample from its key."""
    out = pad_collate()(items)
    out["noise"] = torch.stack([torch.rand((), generator=torch.Generator().manual_seed(k)) for k in keys])
    return out


def same_steps(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.cursor.as_tuple() == y.cursor.as_tuple()
        assert x.indices == y.indices
        assert len(x) == len(y)
        for mx, my in zip(x, y):
            assert mx.keys() == my.keys()
            assert all(torch.equal(mx[k], my[k]) for k in mx)


# -- collation -------------------------------------------------------------------------------


def test_pad_collate_pads_each_key_with_its_own_value():
    out = pad_collate(pad_token_id=9)(
        [
            {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "labels": [1, 2, 3], "label": 0},
            {"input_ids": [4], "attention_mask": [1], "labels": [-100], "label": 1},
        ]
    )
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[1, 2, 3], [-100, -100, -100]]
    assert out["label"].tolist() == [0, 1]


def test_pad_collate_rounds_up_to_a_multiple_and_keeps_chosen_keys():
    out = pad_collate(pad_to_multiple_of=8, keys=["input_ids"])([{"input_ids": [1] * 9, "text": "x"}])
    assert sorted(out) == ["attention_mask", "input_ids"]
    assert out["input_ids"].shape == (1, 16)
    assert out["attention_mask"].sum().item() == 9


def test_pad_collate_stacks_equal_shaped_tensors_and_does_not_mutate():
    items = [{"pixels": torch.ones(2, 2), "input_ids": torch.tensor([1, 2])} for _ in range(3)]
    before = [it["input_ids"]._version for it in items]
    out = pad_collate(pad_values={"input_ids": 7})(items)
    assert out["pixels"].shape == (3, 2, 2)
    assert [it["input_ids"]._version for it in items] == before


def test_pad_collate_takes_the_first_items_dtype_for_mixed_columns():
    for a, b in (([1, 2], [3]), ([1, 2], [3, 4])):  # padded, and equal lengths (stacked)
        out = pad_collate()([{"input_ids": torch.tensor(a, dtype=torch.int32)}, {"input_ids": torch.tensor(b)}])
        assert out["input_ids"].dtype == torch.int32
        assert out["input_ids"][1, : len(b)].tolist() == b


@settings(max_examples=50, deadline=None)
@given(token_items(), st.one_of(st.none(), st.integers(1, 8)))
def test_pad_collate_keeps_every_token_and_pads_with_minus_100(items, multiple):
    out = pad_collate(pad_to_multiple_of=multiple)(items)
    width = max(len(it["input_ids"]) for it in items)
    assert out["input_ids"].shape[1] >= width
    if multiple:
        assert out["input_ids"].shape[1] % multiple == 0
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        assert out["input_ids"][row, :n].tolist() == it["input_ids"]
        assert out["attention_mask"][row].sum().item() == n
        assert (out["labels"][row, n:] == -100).all()


# -- the stream ------------------------------------------------------------------------------


def test_stream_yields_step_batches_with_the_cursor_after_each_step():
    data = items_of([3, 1, 4, 1, 5])
    s = Sampler("sequential", 5, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    steps = list(stream(data, s, pad_collate(), num_epochs=2))
    assert [b.cursor.as_tuple() for b in steps] == [(0, 1), (1, 0), (1, 1), (2, 0)]
    assert [len(b) for b in steps] == [2, 1, 2, 1]  # the short last step of each epoch
    assert steps[1].indices == ((4,),)
    assert isinstance(steps[0], StepBatch) and isinstance(steps[0], tuple)
    with pytest.raises(AttributeError, match="immutable"):
        steps[0].cursor = Cursor()


def test_max_steps_counts_from_the_start_of_the_run():
    data = items_of([2] * 6)
    s = Sampler("random", 6, per_device_train_batch_size=2, seed=4)
    full = list(stream(data, s, pad_collate(), max_steps=5))
    assert [b.cursor.as_tuple() for b in full] == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    resumed = list(stream(data, s, pad_collate(), start=full[1].cursor, max_steps=5))
    same_steps(resumed, full[2:])


def test_stream_without_limits_runs_on_across_epochs():
    data = items_of([1, 2])
    s = Sampler("random", 2, per_device_train_batch_size=2)
    it = stream(data, s, pad_collate())
    cursors = [next(it).cursor.as_tuple() for _ in range(5)]
    assert cursors == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]


def test_dataloader_drop_last_overrides_the_sampler():
    s = Sampler("sequential", 5, per_device_train_batch_size=2)
    steps = list(stream(items_of([1] * 5), s, pad_collate(), num_epochs=1, dataloader_drop_last=True))
    assert [b.indices for b in steps] == [((0, 1),), ((2, 3),)]


@FAST
@given(
    sampler_configs(num_samples=st.integers(1, 24)),
    st.integers(1, 3),
    st.integers(0, 40),
    st.booleans(),
)
def test_a_stream_resumed_from_any_cursor_is_the_tail_of_the_whole_stream(s, num_epochs, cut, use_keys):
    assume(s.steps_per_epoch() > 0)
    lengths = s.lengths or [1 + i % 5 for i in range(s.num_samples)]
    data = items_of(lengths)
    collate = keyed(noisy) if use_keys else pad_collate()
    whole = list(stream(data, s, collate, num_epochs=num_epochs))
    assert len(whole) == num_epochs * s.steps_per_epoch()
    cut = min(cut, len(whole))
    start = whole[cut - 1].cursor if cut else None
    same_steps(list(stream(data, s, collate, start=start, num_epochs=num_epochs)), whole[cut:])


def test_order_and_values_do_not_depend_on_num_workers_nor_touch_global_rng():
    data = items_of([1 + (7 * i) % 13 for i in range(40)])
    s = make_sampler("group_by_length", data, per_device_train_batch_size=3, gradient_accumulation_steps=2, seed=2)
    before = torch.get_rng_state()
    serial = list(stream(data, s, keyed(noisy), num_epochs=2))
    parallel = list(
        stream(
            data,
            s,
            keyed(noisy),
            num_epochs=2,
            dataloader_num_workers=2,
            dataloader_prefetch_factor=2,
            dataloader_persistent_workers=True,
        )
    )
    same_steps(serial, parallel)
    assert torch.equal(before, torch.get_rng_state())


def test_dataloader_workers_survive_sigterm():
    """Slurm signals every process of a job step: workers must leave the stop to the main process."""
    import os
    import signal
    from pathlib import Path

    data = items_of([1 + i % 5 for i in range(64)])
    s = make_sampler("sequential", data, per_device_train_batch_size=2)
    steps = stream(data, s, pad_collate(), num_epochs=1, dataloader_num_workers=2)
    first, _ = next(steps), next(steps)  # one batch from each worker: both have run their init
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    workers = [int(p) for p in children.read_text().split()] if children.exists() else []
    if not workers:
        pytest.skip("cannot list child processes on this platform")
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    rest = list(steps)  # a worker killed by SIGTERM would make this raise
    assert 2 + len(rest) == s.steps_per_epoch() and first.cursor.as_tuple() == (0, 1)


def test_keyed_randomness_belongs_to_the_sample_not_the_batch():
    data = items_of([2] * 8)
    small = list(stream(data, Sampler("random", 8, per_device_train_batch_size=1, seed=1), keyed(noisy), num_epochs=1))
    big = list(stream(data, Sampler("random", 8, per_device_train_batch_size=4, seed=1), keyed(noisy), num_epochs=1))
    noise_of = lambda steps: {
        i: mb["noise"][j].item() for b in steps for mb, idx in zip(b, b.indices) for j, i in enumerate(idx)
    }
    assert noise_of(small) == noise_of(big)
    assert noise_of(small)[3] == torch.rand((), generator=torch.Generator().manual_seed(sample_key(1, 0, 3))).item()


class Counting(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(items_of(range(1, self.n + 1)))


def test_a_dataset_without_length_is_read_in_order_with_a_short_last_step():
    s = Sampler("sequential", None, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    steps = list(stream(Counting(7), s, pad_collate(), num_epochs=2))
    assert [b.cursor.as_tuple() for b in steps] == [(0, 1), (1, 0), (1, 1), (2, 0)]
    assert [[mb["input_ids"].shape[1] for mb in b] for b in steps] == [[2, 4], [6, 7]] * 2
    resumed = list(stream(Counting(7), s, pad_collate(), start=steps[0].cursor, num_epochs=2))
    assert [b.cursor.as_tuple() for b in resumed] == [(1, 0), (1, 1), (2, 0)]
    assert torch.equal(resumed[0][1]["input_ids"], steps[1][1]["input_ids"])


def test_a_dataset_without_length_is_dealt_round_robin_to_ranks():
    shapes = []
    for rank in (0, 1):
        s = Sampler("sequential", None, per_device_train_batch_size=1, world_size=2, rank=rank)
        shapes.append(
            [mb["input_ids"].shape[1] for b in stream(Counting(5), s, pad_collate(), num_epochs=1) for mb in b]
        )
    assert shapes == [[1, 3], [2, 4]]  # sample 5 would leave rank 1 without a micro-batch


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 20), st.integers(1, 3), st.integers(1, 3), st.integers(1, 2), st.data())
def test_a_dataset_without_length_resumes_from_any_cursor(n, batch, accumulation, world, data):
    rank = data.draw(st.integers(0, world - 1))
    assume(n >= batch * world)
    s = Sampler(
        "sequential",
        None,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        world_size=world,
        rank=rank,
        drop_last=data.draw(st.booleans()),
    )
    whole = list(stream(Counting(n), s, keyed(noisy), num_epochs=2))
    cut = data.draw(st.integers(0, len(whole)))
    start = whole[cut - 1].cursor if cut else None
    same_steps(list(stream(Counting(n), s, keyed(noisy), start=start, num_epochs=2)), whole[cut:])
    assert all(1 <= len(b) <= accumulation for b in whole)


def test_resuming_a_fit_is_bitwise_equal_to_not_stopping():
    from trainfold.core.fold import fit, max_steps
    from trainfold.core.models import TinyLM, TinyLMConfig
    from trainfold.core.state import init_state
    from trainfold.optim import adamw
    from trainfold.step import make_step

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, max_len=32, dropout=0.1))
    opt = adamw(1e-2)
    step = make_step(model, optimizer=opt)
    data = items_of([1 + (5 * i) % 17 for i in range(22)])
    s = make_sampler("group_by_length", data, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=3)
    collate = pad_collate()
    state0 = init_state(model, opt, seed=3)
    whole = fit(step, state0, stream(data, s, collate, num_epochs=2))
    half = fit(step, state0, stream(data, s, collate, num_epochs=2), stop=max_steps(7))
    assert half.cursor.as_tuple() == (1, 1)
    resumed = fit(step, half, stream(data, s, collate, start=half.cursor, num_epochs=2))
    assert int(resumed.step) == int(whole.step) == 12
    assert resumed.cursor.as_tuple() == whole.cursor.as_tuple() == (2, 0)
    assert all(torch.equal(resumed.params[k], whole.params[k]) for k in whole.params)


def test_a_datasets_dataset_streams_through_its_batched_getitems():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1], [2, 2], [3, 3, 3]], "length": [1, 2, 3]})
    s = make_sampler(
        "batch_rebalance", ds, per_device_train_batch_size=1, gradient_accumulation_steps=3, seed=torch.tensor(5)
    )
    (step,) = list(stream(ds, s, pad_collate(), num_epochs=1))
    assert sorted(mb["input_ids"][0, 0].item() for mb in step) == [1, 2, 3]
    assert s.seed == 5


def test_start_accepts_an_epoch_position_pair():
    data = items_of([1] * 4)
    s = Sampler("random", 4, per_device_train_batch_size=1, seed=2)
    same_steps(
        list(stream(data, s, pad_collate(), start=(0, 2), num_epochs=1)),
        list(stream(data, s, pad_collate(), start=Cursor(scalar(0), scalar(2)), num_epochs=1)),
    )


# -- bad input -------------------------------------------------------------------------------


def test_worker_options_need_workers():
    s = Sampler("random", 2, per_device_train_batch_size=1)
    with pytest.raises(
        ValueError, match=r"persistent_workers=True needs dataloader_num_workers > 0.*prefetch_factor=2 needs"
    ):
        stream(items_of([1, 1]), s, pad_collate(), dataloader_persistent_workers=True, dataloader_prefetch_factor=2)
    with pytest.raises(ValueError, match="dataloader_num_workers=-1 must be an int >= 0"):
        stream(items_of([1, 1]), s, pad_collate(), dataloader_num_workers=-1)


def test_stream_rejects_a_sampler_for_another_dataset_and_empty_epochs():
    with pytest.raises(ValueError, match="made for 3 samples but the dataset has 2"):
        stream(items_of([1, 1]), Sampler("random", 3), pad_collate())
    with pytest.raises(ValueError, match="gives no optimizer step"):
        stream(items_of([1]), Sampler("random", 1, per_device_train_batch_size=2, drop_last=True), pad_collate())


def test_a_cursor_past_the_epoch_says_the_settings_changed():
    s = Sampler("random", 4, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=r"start cursor \(0, 5\) is past the 2 steps of an epoch"):
        stream(items_of([1] * 4), s, pad_collate(), start=(0, 5))
    with pytest.raises(ValueError, match="epoch >= 0"):
        stream(items_of([1] * 4), s, pad_collate(), start=(-1, 0))


def test_collate_errors_name_the_problem():
    with pytest.raises(KeyError, match=r"item 1 of the micro-batch lacks keys \['labels'\]"):
        pad_collate()([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])
    with pytest.raises(TypeError, match="cannot make a tensor of item key 'text'"):
        pad_collate()([{"text": {"a": 1}}])
    with pytest.raises(ValueError, match="pad_to_multiple_of=0"):
        pad_collate(pad_to_multiple_of=0)


def test_loader_errors_is_the_one_check_of_the_worker_settings():
    from trainfold.data import eval_loader, loader_errors

    assert loader_errors(0, False, None) == [] and loader_errors(2, True, 3) == []
    assert loader_errors(0, True, 2) == [
        "dataloader_persistent_workers=True needs dataloader_num_workers > 0 (it keeps worker processes alive)",
        "dataloader_prefetch_factor needs dataloader_num_workers > 0: dataloader_prefetch_factor=2 needs worker "
        "processes to prefetch (set dataloader_num_workers, or leave it None)",
    ]
    assert loader_errors(1.5, False, -1) == [
        "dataloader_num_workers=1.5 must be an int >= 0",
        "dataloader_prefetch_factor=-1 must be a positive int or None",
    ]
    with pytest.raises(ValueError, match=r"invalid eval dataloader options: dataloader_num_workers=-1 must be"):
        eval_loader([1], lambda items: items, 1, dataloader_num_workers=-1)


def test_epoch_draws_draw_one_number_at_each_epoch_start_as_hfs_loader_and_resume_without_a_second():
    """``epoch_draws`` (trainfold.train's stream): one draw from the global generator before each epoch's first
    collation, as ``iter(DataLoader)`` in HF's loop; a stream resumed inside an epoch draws none for it."""
    data = items_of([1 + i % 5 for i in range(12)])
    s = make_sampler("random", data, per_device_train_batch_size=2, gradient_accumulation_steps=1, seed=1)

    def seen(start, count):  # the global generator's next number after each step's collation
        torch.manual_seed(0)
        steps = stream(data, s, keyed(noisy), num_epochs=2, start=start, epoch_draws=True)
        return [(step.cursor.as_tuple(), torch.randint(0, 2**30, ()).item()) for step in itertools.islice(steps, count)]

    torch.manual_seed(0)
    expected = []
    for epoch in range(2):
        torch.empty((), dtype=torch.int64).random_()  # the epoch's draw, then its steps
        for p in range(6):
            expected.append(((epoch, p + 1) if p < 5 else (epoch + 1, 0), torch.randint(0, 2**30, ()).item()))
    assert seen(None, 12) == expected
    resumed = seen((0, 3), 1)  # inside epoch 0: no draw before its first step
    torch.manual_seed(0)
    assert resumed == [((0, 4), torch.randint(0, 2**30, ()).item())]
    at_end = seen((0, 6), 1)  # at an epoch's end: the next epoch begins with its draw
    torch.manual_seed(0)
    torch.empty((), dtype=torch.int64).random_()
    assert at_end == [((1, 1), torch.randint(0, 2**30, ()).item())]


def test_collate_ahead_collates_the_epochs_next_micro_batch_before_yielding_a_step():
    """As accelerate's DataLoaderShard: the epoch's next micro-batch is collated before a step is yielded, never
    across the epoch's end; the steps are the bare stream's."""
    data = [{"input_ids": [i + 1]} for i in range(10)]
    s = Sampler("sequential", 10, per_device_train_batch_size=2, gradient_accumulation_steps=2)  # 3 steps/epoch
    collated: list[int] = []

    def collate(items):
        collated.append(items[0]["input_ids"][0])
        return pad_collate()(items)

    seen, notes = [], []
    steps = stream(data, s, collate, num_epochs=2, max_steps=5, collate_ahead=notes.append)
    for step in steps:
        seen.append((step.cursor.as_tuple(), list(collated)))
    assert seen == [
        ((0, 1), [1, 3, 5]),  # step 0's two micro-batches, and step 1's first
        ((0, 2), [1, 3, 5, 7, 9]),  # step 2 (one micro-batch) closes the epoch: nothing ahead
        ((1, 0), [1, 3, 5, 7, 9]),
        ((1, 1), [1, 3, 5, 7, 9, 1, 3, 5]),
        ((1, 2), [1, 3, 5, 7, 9, 1, 3, 5, 7, 9]),  # max_steps stops mid-epoch: the next one is collated too
    ]
    assert notes == [True, True, False, True, True]
    collated.clear()
    bare = list(stream(data, s, collate, num_epochs=2, max_steps=5))
    assert collated == [1, 3, 5, 7, 9, 1, 3, 5, 7]  # each step's own micro-batches, when drawn
    same_steps(bare, [step for step in stream(data, s, pad_collate(), num_epochs=2, max_steps=5, collate_ahead=True)])
