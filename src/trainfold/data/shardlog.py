"""The shards a streaming run read, recorded in its cursor: a changed, vanished or added shard is named on resume.

A source's fingerprint (in the cursor) says only *that* its shards changed. The cursor also holds one
row per shard, ``[digest, hash of the file's name]``, after a header ``[count, SHARDS]``; a resume whose
fingerprint differs compares them with the shards it opened and names the files: changed (same name,
other digest), added (a name not recorded) and vanished (a recorded name not found; its name is
unknown, so it is counted). Names, not paths, are compared: a dataset moved to another folder still
matches.

>>> recorded = [[5, _name("a.parquet")], [6, _name("b.parquet")]]
>>> describe(recorded, [("/x/a.parquet", 5), ("/x/b.parquet", 7), ("/x/c.parquet", 8)])
"shard '/x/b.parquet' changed (its digest differs); shard '/x/c.parquet' was added"
>>> describe(recorded, [("/x/a.parquet", 5)])
'1 recorded shard is gone'
"""

from __future__ import annotations

import os
from typing import Any

import xxhash

from trainfold.core.rng import derive_seed

__all__ = ["SHARDS", "describe", "records", "shards_of", "split"]

SHARDS = derive_seed(int.from_bytes(b"shards", "big"))  # marks the header row of the cursor's shard records


def _name(path: str) -> int:
    return xxhash.xxh3_64_intdigest(os.path.basename(path).encode()) & ((1 << 63) - 1)


def shards_of(source: Any) -> list[tuple[str, int]]:
    """The ``(path, digest)`` of each shard a source reads (through its filters and maps); none for another kind."""
    while not hasattr(source, "shards") and hasattr(source, "base"):
        source = source.base
    return [(s.path, int(s.digest)) for s in getattr(source, "shards", ())]


def records(components: list[Any]) -> list[list[int]]:
    """The cursor rows recording the shards of ``components``: the header, then ``[digest, name]`` per shard."""
    rows = [[digest, _name(path)] for c in components for path, digest in shards_of(c)]
    return [[len(rows), SHARDS], *rows]


def split(rows: list[list[int]]) -> tuple[list[list[int]], list[list[int]] | None]:
    """Split cursor rows into those before the shard records and the records (``None``: the cursor has none)."""
    for i, (count, mark) in enumerate(rows):
        if mark == SHARDS:
            return rows[:i], rows[i + 1 : i + 1 + count]
    return rows, None


def describe(recorded: list[list[int]], now: list[tuple[str, int]]) -> str:
    """Name what differs between the recorded shards and ``now``'s ``(path, digest)``; ``""`` when nothing does."""
    before = {name: digest for digest, name in recorded}
    named = {_name(path): (path, digest) for path, digest in now}
    out = [f"shard {p!r} changed (its digest differs)" for n, (p, d) in named.items() if n in before and before[n] != d]
    out += [f"shard {p!r} was added" for n, (p, _) in named.items() if n not in before]
    gone = len(before.keys() - named.keys())
    if gone:
        out.append(f"{gone} recorded shard{' is' if gone == 1 else 's are'} gone")
    return "; ".join(out)
