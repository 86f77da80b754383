"""Collators: items to padded tensor dicts, and keyed collators that draw per-sample randomness.

A collator turns one micro-batch of dataset items into what the model takes. :func:`pad_collate`
right-pads 1-d sequences per key; :func:`keyed` marks a collator ``fn(items, keys)`` that gets one
:func:`sample_key` per item, so its randomness depends only on ``(seed, epoch, index)``.

>>> c = pad_collate()
>>> c([{"input_ids": [1, 2]}, {"input_ids": [3]}])["attention_mask"].tolist()
[[1, 1], [1, 0]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence

from trainfold.core.rng import derive_seed

__all__ = [
    "DEFAULT_PAD_VALUES",
    "KeyedCollate",
    "PadCollate",
    "check_completion_padding",
    "collate_for",
    "keyed",
    "model_pad_collate",
    "pad_collate",
    "pad_token_id_of",
    "sample_key",
]

DEFAULT_PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1}


def _as_tensor(value: Any, key: str) -> Tensor:
    if isinstance(value, Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(
            f"cannot make a tensor of item key {key!r} (value {value!r:.60}); leave it out with keys=[...]"
        ) from exc


@attrs.frozen
class PadCollate:
    """Collate items (mappings) into a dict of tensors, right-padding 1-d sequences per key.

    Each 1-d key is padded to the longest in the micro-batch (rounded up to a multiple of
    ``pad_to_multiple_of``): ``labels`` with ``label_pad_token_id``, ``attention_mask`` and
    ``token_type_ids`` with 0, anything else with ``pad_token_id`` (``pad_values`` overrides per
    key). A missing ``attention_mask`` is made from the ``input_ids`` lengths. Scalars are stacked.
    Without ``keys``, a key whose first item holds a string or ``None`` is left out, as HF's
    ``default_data_collator`` leaves it (``remove_unused_columns=False`` keeps a text column).
    Use :func:`pad_collate` to make one.

    >>> c = PadCollate(pad_token_id=9)
    >>> out = c([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    >>> out["input_ids"].tolist(), out["labels"].tolist(), out["attention_mask"].tolist()
    ([[1, 2, 3], [4, 9, 9]], [[1, 2, 3], [4, -100, -100]], [[1, 1, 1], [1, 0, 0]])
    >>> sorted(c([{"input_ids": [1], "text": "a"}, {"input_ids": [2], "text": "b"}]))
    ['attention_mask', 'input_ids']
    """

    pad_token_id: int | None = 0  # None: no pad id is known; padding a key padded with it is refused
    label_pad_token_id: int = -100
    pad_to_multiple_of: int | None = None
    keys: tuple[str, ...] | None = None
    pad_values: tuple[tuple[str, int], ...] = ()

    def pad_value(self, key: str) -> int | None:
        """Return the value ``key`` is padded with (``None``: the unknown ``pad_token_id``)."""
        overrides = dict(self.pad_values)
        if key in overrides:
            return overrides[key]
        if key == "labels":
            return self.label_pad_token_id
        return DEFAULT_PAD_VALUES.get(key, self.pad_token_id)

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        if not items:
            raise ValueError("cannot collate an empty micro-batch")
        if self.keys is not None:
            keys = list(self.keys)
        else:
            keys = [k for k, v in items[0].items() if v is not None and not isinstance(v, str)]
        for i, item in enumerate(items):
            missing = [k for k in keys if k not in item]
            if missing:
                raise KeyError(f"item {i} of the micro-batch lacks keys {missing} (has {sorted(item.keys())})")
        out = {k: self._column(k, [_as_tensor(item[k], k) for item in items]) for k in keys}
        if "attention_mask" not in out and "input_ids" in out and out["input_ids"].dim() == 2:
            lens = [len(item["input_ids"]) for item in items]  # items may hold lists
            width = out["input_ids"].shape[1]
            if all(n == width for n in lens):
                out["attention_mask"] = torch.ones(len(lens), width, dtype=torch.long)
            else:
                out["attention_mask"] = (torch.arange(width) < torch.tensor(lens)[:, None]).long()
        return out

    def _column(self, key: str, values: list[Tensor]) -> Tensor:
        if any(v.dim() != 1 for v in values):
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(
                    f"key {key!r} has items of different shapes {sorted(shapes)}; only 1-d sequences are padded"
                )
            return torch.stack(values)
        lengths = [v.shape[0] for v in values]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        dtype = values[0].dtype
        values = [v if v.dtype == dtype else v.to(dtype) for v in values]
        if all(n == width for n in lengths):  # nothing to pad
            return torch.stack(values)
        fill = self.pad_value(key)
        if fill is None:
            raise ValueError(
                f"the rows' {key!r} need padding (lengths {sorted(set(lengths))}, padded to {width}) but no pad id "
                f"is known to pad them with (PadCollate(pad_token_id=None)): give one (train(..., "
                "processing_class=tokenizer) pads with its pad_token_id, else the model's config.pad_token_id is "
                "used: set it), pass a data_collator that pads, or make the rows equal in length"
            )
        out = pad_sequence(values, batch_first=True, padding_value=fill)
        return F.pad(out, (0, width - out.shape[1]), value=fill) if out.shape[1] < width else out


def pad_collate(
    pad_token_id: int | None = 0,
    label_pad_token_id: int = -100,
    pad_to_multiple_of: int | None = None,
    keys: Sequence[str] | None = None,
    pad_values: Mapping[str, int] | None = None,
) -> PadCollate:
    """Return a collator that right-pads ``input_ids``/``attention_mask``/``labels`` (see PadCollate).

    >>> c = pad_collate(pad_to_multiple_of=4)
    >>> out = c([{"input_ids": [5, 6], "labels": [5, 6]}, {"input_ids": [7], "labels": [7]}])
    >>> out["input_ids"].tolist(), out["labels"].tolist(), out["attention_mask"].tolist()
    ([[5, 6, 0, 0], [7, 0, 0, 0]], [[5, 6, -100, -100], [7, -100, -100, -100]], [[1, 1, 0, 0], [1, 0, 0, 0]])
    """
    if pad_to_multiple_of is not None and pad_to_multiple_of <= 0:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be a positive int or None")
    return PadCollate(
        pad_token_id=pad_token_id,
        label_pad_token_id=label_pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        keys=None if keys is None else tuple(keys),
        pad_values=tuple(sorted((pad_values or {}).items())),
    )


def check_completion_padding(max_length: int | None, pad_to_multiple_of: int | None) -> None:
    """Refuse, all at once, the settings of a prompt-and-completion collator that cannot make a batch to score.

    >>> try:
    ...     check_completion_padding(1, 0)
    ... except ValueError as e:
    ...     print(str(e).split("; ")[::2])
    ['max_length=1 leaves no completion token to score', 'pad_to_multiple_of=0 must be a positive int or None']
    """
    problems = []
    if max_length is not None and max_length < 2:
        problems.append(f"max_length={max_length} leaves no completion token to score; use None or >= 2")
    multiple = pad_to_multiple_of
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
        problems.append(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive int or None")
    if problems:
        raise ValueError("; ".join(problems))


def pad_token_id_of(processing_class: Any) -> int | None:
    """Return the pad id of a tokenizer, or of a processor's tokenizer (``processing_class`` as HF names it); or None.

    >>> class Tok:
    ...     pad_token_id = 1
    >>> class Processor:
    ...     tokenizer = Tok()
    >>> pad_token_id_of(Tok()), pad_token_id_of(Processor()), pad_token_id_of(None)
    (1, 1, None)
    """
    for candidate in (processing_class, getattr(processing_class, "tokenizer", None)):
        pad = getattr(candidate, "pad_token_id", None)
        if isinstance(pad, int) and not isinstance(pad, bool):
            return pad
    return None


def collate_for(processing_class: Any) -> PadCollate | None:
    """Return the default collator of a run given ``processing_class``: ``pad_collate`` padding with its pad id.

    ``None`` when it has no pad id (the run's default, ``pad_collate()``, pads with 0), as HF's
    ``DataCollatorWithPadding(tokenizer)`` pads ``input_ids`` with the tokenizer's pad id.

    >>> class Tok:
    ...     pad_token_id = 3
    >>> collate_for(Tok())([{"input_ids": [5, 6]}, {"input_ids": [7]}])["input_ids"].tolist()
    [[5, 6], [7, 3]]
    """
    pad = pad_token_id_of(processing_class)
    return None if pad is None else pad_collate(pad_token_id=pad)


def model_pad_collate(model: Any) -> PadCollate:
    """Return the default collator of a run without a collator or a ``processing_class``: ``pad_collate`` padding
    with the model's ``config.pad_token_id``; without one it refuses to pad ``input_ids`` (rows of one length
    collate), as ``transformers.Trainer``'s ``default_data_collator`` refuses ragged rows.

    >>> from types import SimpleNamespace
    >>> model_pad_collate(SimpleNamespace(config=SimpleNamespace(pad_token_id=1))).pad_token_id
    1
    >>> c = model_pad_collate(SimpleNamespace(config=SimpleNamespace(pad_token_id=None)))
    >>> c([{"input_ids": [5, 6], "labels": [5, 6]}, {"input_ids": [7, 8], "labels": [7, 8]}])["input_ids"].tolist()
    [[5, 6], [7, 8]]
    >>> try:
    ...     c([{"input_ids": [5, 6]}, {"input_ids": [7]}])
    ... except ValueError as e:
    ...     print(str(e)[:61])
    the rows' 'input_ids' need padding (lengths [1, 2], padded to
    """
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return pad_collate(pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None)


def sample_key(seed: int, epoch: int, index: int) -> int:
    """Return the random key of dataset sample ``index`` in ``epoch`` of a run seeded ``seed``.

    >>> sample_key(0, 1, 5) == sample_key(0, 1, 5), sample_key(0, 1, 5) == sample_key(0, 2, 5)
    (True, False)
    """
    return derive_seed(seed, epoch, index)


@attrs.frozen
class KeyedCollate:
    """A collator called as ``fn(items, keys)``, one :func:`sample_key` per item. Make with :func:`keyed`.

    >>> from trainfold.data import Sampler, stream
    >>> s = Sampler("sequential", 4, per_device_train_batch_size=2, seed=5)
    >>> check = KeyedCollate(lambda items, keys: [k == sample_key(5, 0, i) for i, k in zip(items, keys)])
    >>> [step[0] for step in stream(list(range(4)), s, check, num_epochs=1)]
    [[True, True], [True, True]]
    """

    fn: Callable[[Sequence[Any], Sequence[int]], Any]

    def __call__(self, items: Sequence[Any], keys: Sequence[int]) -> Any:
        return self.fn(items, keys)


def keyed(fn: Callable[[Sequence[Any], Sequence[int]], Any]) -> KeyedCollate:
    """Mark ``fn(items, keys)`` as a collator that draws per-sample randomness from ``keys``.

    >>> import torch
    >>> def noisy(items, keys):
    ...     return torch.stack([torch.rand(1, generator=torch.Generator().manual_seed(k)) for k in keys])
    >>> c = keyed(noisy)
    >>> c([None], [7]).tolist() == c([None], [7]).tolist()
    True
    """
    return KeyedCollate(fn)
