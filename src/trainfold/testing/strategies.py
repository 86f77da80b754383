"""Hypothesis strategies for trainfold's inputs: lengths, label tensors, tensor dicts, token items, samplers.

Needs ``hypothesis`` (the ``test`` extra).

>>> from hypothesis import Phase, find, settings
>>> quick = settings(max_examples=5, database=None, deadline=None, phases=[Phase.generate, Phase.shrink])
>>> find(uniform_lengths(min_size=2), lambda xs: True, settings=quick)
[1, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("trainfold.testing needs hypothesis: pip install 'trainfold[test]'") from exc

from trainfold.data.samplers import LENGTH_STRATEGIES, STRATEGIES, Sampler

__all__ = [
    "label_tensors",
    "lengths",
    "sampler_configs",
    "skewed_lengths",
    "tensor_dicts",
    "token_items",
    "uniform_lengths",
]


_BATCH_SIZES = st.integers(1, 4)
_SEQ_LENS = st.integers(1, 16)
_NUM_SAMPLES = st.integers(0, 48)


def skewed_lengths(
    min_size: int = 0, max_size: int = 64, *, median: float = 32.0, sigma: float = 1.0, max_length: int = 1024
) -> st.SearchStrategy[list[int]]:
    """Lists of sequence lengths with a long right tail, shaped like a lognormal distribution.

    Each length is ``round(median * exp(sigma * z))`` for ``z`` drawn in ``[-3, 3]``, clipped to
    ``[1, max_length]``: mostly short sequences and a few very long ones, the case where
    length-grouped sampling matters. Example: ``@given(skewed_lengths(min_size=1))``.

    >>> from hypothesis import Phase, find, given, settings
    >>> quick = settings(max_examples=5, database=None, deadline=None, phases=[Phase.generate, Phase.shrink])
    >>> find(skewed_lengths(min_size=3), lambda xs: True, settings=quick)  # z shrinks to 0: the median
    [32, 32, 32]
    >>> @given(skewed_lengths(max_length=100))
    ... @quick
    ... def clipped(xs):
    ...     assert all(1 <= x <= 100 for x in xs)
    >>> clipped()
    """

    def to_length(z: float) -> int:
        return int(min(max(round(median * math.exp(sigma * z)), 1), max_length))

    return st.lists(st.floats(-3.0, 3.0, allow_nan=False).map(to_length), min_size=min_size, max_size=max_size)


def uniform_lengths(
    min_size: int = 0, max_size: int = 64, *, min_length: int = 1, max_length: int = 128
) -> st.SearchStrategy[list[int]]:
    """Lists of sequence lengths drawn from ``[min_length, max_length]``.

    Example: ``@given(uniform_lengths(min_size=4, max_length=16))``.

    >>> from hypothesis import Phase, find, given, settings
    >>> quick = settings(max_examples=5, database=None, deadline=None, phases=[Phase.generate, Phase.shrink])
    >>> find(uniform_lengths(min_size=2, min_length=3), lambda xs: True, settings=quick)
    [3, 3]
    >>> @given(uniform_lengths(min_size=4, max_size=6, min_length=2, max_length=16))
    ... @quick
    ... def in_range(xs):
    ...     assert 4 <= len(xs) <= 6 and all(2 <= x <= 16 for x in xs)
    >>> in_range()
    """
    return st.lists(st.integers(min_length, max_length), min_size=min_size, max_size=max_size)


def lengths(min_size: int = 0, max_size: int = 64) -> st.SearchStrategy[list[int]]:
    """Lists of lengths, skewed or uniform: either of the two strategies above.

    Example: ``@given(lengths(min_size=1))``.

    >>> from hypothesis import given, settings
    >>> @given(lengths(min_size=1, max_size=8))
    ... @settings(max_examples=5, database=None, deadline=None)
    ... def positive(xs):
    ...     assert 1 <= len(xs) <= 8 and min(xs) >= 1
    >>> positive()
    """
    return st.one_of(skewed_lengths(min_size, max_size), uniform_lengths(min_size, max_size))


@st.composite
def label_tensors(
    draw: st.DrawFn,
    batch_size: st.SearchStrategy[int] = _BATCH_SIZES,
    seq_len: st.SearchStrategy[int] = _SEQ_LENS,
    vocab_size: int = 32,
    ignore_index: int = -100,
    prompt_masking: bool = True,
) -> Tensor:
    """Integer label tensors ``(batch, seq)`` in ``[0, vocab_size)`` with ``ignore_index`` padding.

    Each row keeps a random number of real tokens (possibly none) and is right-padded with
    ``ignore_index``; with ``prompt_masking`` some rows also mask a prefix (a prompt), as
    supervised fine-tuning does. Example: ``@given(label_tensors(vocab_size=8))``, then check that
    your loss counts ``(labels != -100)`` items.

    >>> from hypothesis import Phase, find, given, settings
    >>> quick = settings(max_examples=5, database=None, deadline=None, phases=[Phase.generate, Phase.shrink])
    >>> find(label_tensors(vocab_size=8), lambda t: True, settings=quick).tolist()  # the simplest: all padding
    [[-100]]
    >>> @given(label_tensors(vocab_size=8))
    ... @quick
    ... def valid(labels):
    ...     real = labels[labels != -100]
    ...     assert labels.dim() == 2 and bool(((real >= 0) & (real < 8)).all())
    >>> valid()
    """
    b, t = draw(batch_size), draw(seq_len)
    rows = []
    for _ in range(b):
        n = draw(st.integers(0, t))
        prefix = draw(st.integers(0, n)) if prompt_masking else 0
        tokens = draw(st.lists(st.integers(0, vocab_size - 1), min_size=n, max_size=n))
        rows.append([ignore_index] * prefix + tokens[prefix:] + [ignore_index] * (t - n))
    return torch.tensor(rows, dtype=torch.long).reshape(b, t)


@st.composite
def tensor_dicts(
    draw: st.DrawFn,
    keys: Sequence[str] = ("w", "b"),
    max_dims: int = 2,
    max_side: int = 4,
    dtype: torch.dtype = torch.float32,
    bound: float = 1e3,
) -> dict[str, Tensor]:
    """Dicts of finite float tensors, one per key, each of its own random shape (0-d allowed).

    Values lie in ``[-bound, bound]``. Use them as parameter trees or gradients:
    ``@given(tensor_dicts(keys=["weight", "bias"]))``.

    >>> import torch
    >>> from hypothesis import Phase, find, given, settings
    >>> quick = settings(max_examples=5, database=None, deadline=None, phases=[Phase.generate, Phase.shrink])
    >>> {k: v.tolist() for k, v in find(tensor_dicts(), lambda d: True, settings=quick).items()}
    {'w': 0.0, 'b': 0.0}
    >>> @given(tensor_dicts(keys=["weight", "bias"], bound=1.0))
    ... @quick
    ... def finite(tree):
    ...     assert sorted(tree) == ["bias", "weight"]
    ...     assert all(bool((t.isfinite() & (t.abs() <= 1)).all()) for t in tree.values())
    >>> finite()
    """
    out = {}
    for key in keys:
        shape = draw(st.lists(st.integers(1, max_side), min_size=0, max_size=max_dims))
        n = math.prod(shape)
        values = draw(st.lists(st.floats(-bound, bound, allow_nan=False, width=32), min_size=n, max_size=n))
        out[key] = torch.tensor(values, dtype=dtype).reshape(shape)
    return out


@st.composite
def token_items(
    draw: st.DrawFn, min_size: int = 1, max_size: int = 8, max_length: int = 12, vocab_size: int = 32
) -> list[dict[str, list[int]]]:
    """Lists of tokenized samples ``{"input_ids": [...], "labels": [...]}`` of varied lengths (>= 1).

    Labels copy the inputs; feed them to a collator: ``@given(token_items())``.

    >>> from hypothesis import Phase, find, given, settings
    >>> quick = settings(max_examples=5, database=None, deadline=None, phases=[Phase.generate, Phase.shrink])
    >>> find(token_items(), lambda items: True, settings=quick)
    [{'input_ids': [0], 'labels': [0]}]
    >>> @given(token_items(max_size=4, max_length=5))
    ... @quick
    ... def labelled(items):
    ...     assert 1 <= len(items) <= 4
    ...     assert all(it["labels"] == it["input_ids"] and 1 <= len(it["input_ids"]) <= 5 for it in items)
    >>> labelled()
    """
    n = draw(st.integers(min_size, max_size))
    items = []
    for _ in range(n):
        ids = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_length))
        items.append({"input_ids": ids, "labels": list(ids)})
    return items


@st.composite
def sampler_configs(
    draw: st.DrawFn,
    strategies: Sequence[str] = STRATEGIES,
    num_samples: st.SearchStrategy[int] = _NUM_SAMPLES,
    max_batch: int = 4,
    max_accumulation: int = 3,
    max_world: int = 3,
) -> Sampler:
    """Valid :class:`~trainfold.data.samplers.Sampler` records over the given strategies.

    Batch size, accumulation, world size, rank, ``drop_last`` and seed vary; length-based
    strategies get skewed or uniform lengths. Example:
    ``@given(sampler_configs(strategies=["group_by_length"]))``.

    >>> from hypothesis import given, settings
    >>> @given(sampler_configs(strategies=["group_by_length"], max_world=2))
    ... @settings(max_examples=5, database=None, deadline=None)
    ... def valid(sampler):
    ...     assert sampler.strategy == "group_by_length" and 0 <= sampler.rank < sampler.world_size <= 2
    ...     assert len(sampler.lengths) == sampler.num_samples
    >>> valid()
    """
    strategy = draw(st.sampled_from(list(strategies)))
    n = draw(num_samples)
    world = draw(st.integers(1, max_world))
    lens = None
    if strategy in LENGTH_STRATEGIES:
        lens = draw(st.one_of(skewed_lengths(n, n), uniform_lengths(n, n)))
    return Sampler(
        strategy=strategy,
        num_samples=n,
        per_device_train_batch_size=draw(st.integers(1, max_batch)),
        gradient_accumulation_steps=draw(st.integers(1, max_accumulation)),
        world_size=world,
        rank=draw(st.integers(0, world - 1)),
        drop_last=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
        lengths=lens,
    )


# -- ranks simulated by threads ------------------------------------------------------------------
