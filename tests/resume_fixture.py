"""A tiny model, ragged rows and a keyed collator, shared by test_train.py and its fresh resume process."""

from __future__ import annotations

import torch
from trainfold.data import keyed, pad_collate
from trainfold.models import TinyLM, TinyLMConfig


def model():
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_len=24, dropout=0.1))


def rows(n=22):
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        ids = torch.randint(0, 40, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids), "note": i})  # "note" is not a model input
    return out


_pad = pad_collate()


def _mask_some(items, keys):
    batch = _pad(items)
    for row, key in enumerate(keys):  # per-sample randomness from (seed, epoch, index)
        g = torch.Generator().manual_seed(key)
        drop = torch.rand(batch["labels"].shape[1], generator=g) < 0.2
        batch["labels"][row, drop] = -100
    return batch


collate = keyed(_mask_some)
