"""Randomness that is a pure function of integers: seed derivation and private generator states; and the
process's global generators (torch, numpy, ``random``) as JSON, for a checkpoint to carry across a resume."""

from __future__ import annotations

import base64
import contextlib
import json
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from trainfold.core.collective import Collective

__all__ = [
    "derive_seed",
    "private_rng",
    "global_rng_states",
    "every_rank_global_rng_states",
    "restore_global_rng",
    "seed_global_rng",
]

_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (splitmix64), so nearby inputs give unrelated seeds.

    >>> derive_seed(0, 1) == derive_seed(0, 1), derive_seed(0, 1) == derive_seed(1, 0)
    (True, False)
    """
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 29
    return x & ((1 << 63) - 1)


@contextlib.contextmanager
def private_rng(device: torch.device) -> Iterator[list[torch.Generator]]:
    """Yield the default generators that ops on ``device`` draw from; restore their states afterwards.

    Cheaper than ``torch.random.fork_rng`` + ``torch.manual_seed`` (which touches every backend).
    """
    generators = [torch.default_generator]
    if device.type == "cuda":
        generators.append(
            torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
        )
    saved = [g.get_state() for g in generators]
    try:
        yield generators
    finally:
        for g, s in zip(generators, saved):
            g.set_state(s)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def global_rng_states() -> dict[str, Any]:
    """Return the states of the process's global generators as plain JSON values (no pickle).

    ``torch``: the CPU generator's state (and ``cuda``: each initialised CUDA device's), base64 bytes;
    ``numpy``: the legacy ``np.random`` MT19937 state; ``random``: ``random.getstate()``. What a collator
    that draws from them (``DataCollatorForLanguageModeling``) continues from after
    :func:`restore_global_rng`.

    >>> import json
    >>> saved = json.loads(json.dumps(global_rng_states()))   # JSON round trip
    >>> a = (torch.rand(2).tolist(), np.random.rand(), random.random())
    >>> restore_global_rng(saved)
    >>> (torch.rand(2).tolist(), np.random.rand(), random.random()) == a
    True
    """
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    states: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
        "numpy": {
            "bit_generator": name,
            "keys": _b64(np.asarray(keys, dtype="<u4").tobytes()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "random": {  # 624 words and a position, each < 2**32
            "version": version,
            "state": _b64(np.asarray(internal, dtype="<u4").tobytes()),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return states


def every_rank_global_rng_states(
    collective: Collective | None, rank: int = 0, *, states: Callable[[], Any] = global_rng_states
) -> dict[str, Any]:
    """Return every rank's :func:`global_rng_states`, by ``str(rank)``: what a checkpoint's writer saves, so each
    rank of a resume continues its own draws (HF's ``rng_state_{rank}.pth``). Every rank calls it at once.

    The states travel as JSON bytes over the collective's sums (three ``sum_`` calls: the world size, each
    rank's length, the bytes), so any ``Collective`` carries them. Without one, only this ``rank``'s:

    >>> every_rank_global_rng_states(None) == {"0": global_rng_states()}
    True
    """
    mine = states()  # any JSON value: the states kept at another moment (trainfold.train's look-ahead)
    if collective is None:
        return {str(rank): mine}
    rank = collective.rank
    data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8).to(torch.int32)
    world = torch.ones((), dtype=torch.int64)
    collective.sum_([world])
    lengths = torch.zeros(int(world), dtype=torch.int64)
    lengths[rank] = data.numel()
    collective.sum_([lengths])
    table = torch.zeros(int(world), int(lengths.max()), dtype=torch.int32)
    table[rank, : data.numel()] = data
    collective.sum_([table])
    return {
        str(r): json.loads(bytes(table[r, :n].to(torch.uint8).tolist()).decode())
        for r, n in enumerate(lengths.tolist())
    }


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def restore_global_rng(states: Mapping[str, Any]) -> None:
    """Set the process's global generators to ``states`` (from :func:`global_rng_states`)."""
    torch.set_rng_state(_bytes_tensor(states["torch"]))
    for device, text in enumerate(states.get("cuda", ())):
        if torch.cuda.is_available() and device < torch.cuda.device_count():
            torch.cuda.set_rng_state(_bytes_tensor(text), device)
    n = states["numpy"]
    keys = np.frombuffer(base64.b64decode(n["keys"]), dtype="<u4").astype(np.uint32)
    np.random.set_state((n["bit_generator"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    r = states["random"]
    internal = tuple(int(x) for x in np.frombuffer(base64.b64decode(r["state"]), dtype="<u4"))
    random.setstate((r["version"], internal, r["gauss_next"]))


def seed_global_rng(seed: int) -> None:
    """Seed torch's CPU generator, the legacy ``np.random`` and ``random`` from one integer (as DataLoader
    workers seed them, but for any ``seed``).

    >>> seed_global_rng(7); a = (torch.rand(1).item(), np.random.rand(), random.random())
    >>> seed_global_rng(7); (torch.rand(1).item(), np.random.rand(), random.random()) == a
    True
    """
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
