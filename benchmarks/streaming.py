"""Streaming sources against ``datasets`` streaming on the same Parquet shards, in one process.

Run: ``python benchmarks/streaming.py [--rows 2000000] [--shards 8] [--row-group 20000]``. Prints two tables:

1. rows/s reading every row once: ``trainfold.data.files`` (shuffled: seeded shard, row-group and
   window permutations; and in file order) against ``datasets.load_dataset("parquet", streaming=True)``
   (with ``.shuffle(buffer_size=window)``, and in file order), also through ``torchdata``'s
   ``StatefulDataLoader`` (batches of 256, when torchdata is installed); and ``source_stream`` over
   ``files()`` (global batches of 256 with their cursors and sample certificates: what ``train`` reads).
   Ratios are trainfold / the other reader, of the same order kind.
2. resume time: opening the source and reading its first row at the middle of epoch 3
   (``files``: seek to the row group under the position) against ``datasets``' ``load_state_dict`` at
   the same share of one epoch (it re-reads the current shard and skips to the row), and the
   ``StatefulDataLoader``'s ``load_state_dict`` there.

Rows are ``{"id": int, "text": ~60 characters}``. ``--quick`` runs a small version (the test suite's).
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainfold.data import files, pad_collate, source_stream


def write(folder: Path, rows: int, shards: int, row_group: int, narrow: bool = False) -> str:
    per = rows // shards
    for k in range(shards):
        columns = {"id": pa.array(np.arange(k * per, (k + 1) * per, dtype=np.int64))}
        if not narrow:
            texts = [f"row {i:012d} " + "lorem ipsum dolor sit amet consectetur" for i in range(k * per, (k + 1) * per)]
            columns["text"] = pa.array(texts)
        pq.write_table(pa.table(columns), folder / f"part-{k:03d}.parquet", row_group_size=row_group)
    return str(folder / "*.parquet")


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def count(rows) -> int:
    n = 0
    for _ in rows:
        n += 1
    return n


def hf_stream(pattern: str, window: int | None):
    import datasets

    ds = datasets.load_dataset("parquet", data_files=pattern, split="train", streaming=True)
    return ds.shuffle(seed=0, buffer_size=window) if window else ds


def stateful_loader(pattern: str, window: int | None, batch: int):
    """``datasets`` streaming through ``torchdata``'s ``StatefulDataLoader`` (in this process), or ``None``."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader(hf_stream(pattern, window), batch_size=batch, collate_fn=list)


def steps(pattern: str, n: int, window: int, batch: int, shuffle: bool, workers: int = 0, fn=None) -> int:
    """Rows through ``source_stream``: global batches of ``batch`` rows, each with its cursor and certificate
    (read by ``workers`` DataLoader workers; ``fn``: a map on each row, then ``pad_collate``)."""
    source = files(pattern, shuffle_window=window, shuffle=shuffle)
    options = {"collate": None if fn is None else pad_collate(), "dataloader_num_workers": workers}
    batches = source_stream(
        source if fn is None else source.map(fn), per_device_train_batch_size=batch, max_steps=n // batch, **options
    )
    return sum(len(b[0]) if fn is None else len(b[0]["input_ids"]) for b in batches)


def tokenize(row: dict) -> dict:
    """A stand-in for a tokenizer's work on a row (tens of microseconds of Python): 240 ids from its text."""
    return {"input_ids": [(b * 31 + i) % 50_000 for i, b in enumerate(row["text"].encode() * 4)]}


def worker_rates(pattern: str, n: int, window: int, batch: int = 256) -> list[tuple[str, float, float]]:
    """rows/s through ``source_stream`` with 0 and 2 DataLoader workers, and this process's CPU µs per row."""
    out = []
    for name, fn in (("rows as lists", None), ("tokenize-like map + pad_collate", tokenize)):
        for workers in (0, 2):
            cpu = time.process_time()
            seconds, got = timed(lambda w=workers, f=fn: steps(pattern, n, window, batch, True, w, f))
            cpu = time.process_time() - cpu
            assert got == n // batch * batch, (name, workers, got)
            out.append((f"{name}, dataloader_num_workers={workers}", got / seconds, 1e6 * cpu / got))
    return out


def throughput(pattern: str, n: int, window: int, batch: int = 256) -> list[tuple[str, float]]:
    cases = {
        "files(), shuffled": lambda: count(
            r for _, r in itertools.islice(files(pattern, shuffle_window=window).rows(0), n)
        ),
        "files(), file order": lambda: count(r for _, r in itertools.islice(files(pattern, shuffle=False).rows(0), n)),
        "source_stream(files()), shuffled, batches of 256": lambda: steps(pattern, n, window, batch, True),
        "source_stream(files()), file order, batches of 256": lambda: steps(pattern, n, window, batch, False),
        "datasets streaming, shuffle buffer": lambda: count(hf_stream(pattern, window)),
        "datasets streaming, file order": lambda: count(hf_stream(pattern, None)),
    }
    if stateful_loader(pattern, None, batch) is not None:
        for kind, buffer in (("shuffle buffer", window), ("file order", None)):
            cases[f"datasets + StatefulDataLoader, {kind}"] = lambda b=buffer: sum(
                map(len, stateful_loader(pattern, b, batch))
            )
    out = []
    for name, fn in cases.items():
        seconds, got = timed(fn)
        assert got == n // batch * batch if "source_stream" in name else got == n, (name, got, n)
        out.append((name, n / seconds))
    return out


def resume_times(pattern: str, n: int, window: int) -> list[tuple[str, float]]:
    position = 3 * n + n // 2
    seconds_files, _ = timed(lambda: next(files(pattern, shuffle_window=window).rows(position)))
    ds = hf_stream(pattern, None)
    it = iter(ds)
    for _ in range(n // 2):
        next(it)
    state = ds.state_dict()

    def hf_resume():
        again = hf_stream(pattern, None)
        again.load_state_dict(state)
        return next(iter(again))

    seconds_hf, _ = timed(hf_resume)
    out = [(f"files() at row {position:,} (epoch 3)", seconds_files), (f"datasets at row {n // 2:,}", seconds_hf)]
    loader = stateful_loader(pattern, None, 256)
    if loader is not None:
        it = iter(loader)
        for _ in range(n // 2 // 256):
            next(it)
        saved = loader.state_dict()

        def loader_resume():
            again = stateful_loader(pattern, None, 256)
            again.load_state_dict(saved)
            return next(iter(again))

        seconds, _ = timed(loader_resume)
        out.append((f"datasets + StatefulDataLoader at row {n // 2 // 256 * 256:,}", seconds))
    return out


def peak_rss(pattern: str, start: int, n: int, window: int) -> float:
    """Peak RSS (MiB) of a fresh process that opens the source and reads ``n`` rows from ``start``.

    The peak is the process's ``VmHWM`` (``/proc/self/status``), not ``ru_maxrss``: Linux carries a
    process's ``ru_maxrss`` over ``fork`` and ``exec``, so a child started by a parent that has just
    written 20M rows reported the parent's size (the 1.06x growth measured before).
    """
    code = (
        "import itertools, re; from trainfold.data import files; "
        f"src = files({pattern!r}, shuffle_window={window}); "
        f"sum(1 for _ in itertools.islice(src.rows({start}), {n})); "
        "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]) / 1024  # KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--row-group", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="20k rows (the test suite's run)")
    parser.add_argument(
        "--rss", action="store_true", help="peak RSS reading 500k rows of --rows / 20, / 10 and of --rows (ids only)"
    )
    parser.add_argument("--workers", action="store_true", help="only source_stream's rows/s with 0 and 2 workers")
    parser.add_argument(
        "--resume-only", action="store_true", help="only files()' resume time, in the middle of --rows (ids only)"
    )
    ns = parser.parse_args()
    if ns.quick:
        ns.rows, ns.shards, ns.row_group, ns.window = 20_000, 4, 1000, 1000
    warnings.filterwarnings("ignore")
    if ns.rss:
        print("| dataset | peak RSS reading 500,000 rows from its middle (MiB) |\n|---|---|")
        for rows in (ns.rows // 20, ns.rows // 10, ns.rows):
            with tempfile.TemporaryDirectory() as d:
                pattern = write(Path(d), rows, ns.shards, ns.row_group, narrow=True)
                print(f"| {rows:,} rows | {peak_rss(pattern, rows // 2, 500_000, ns.window):.1f} |")
        return
    if ns.workers:
        with tempfile.TemporaryDirectory() as d:
            pattern = write(Path(d), ns.rows, ns.shards, ns.row_group)
            n = ns.rows // ns.shards * ns.shards
            print(f"| source_stream ({n:,} rows, window {ns.window:,}) | rows/s | main process CPU µs/row |")
            print("|---|---|---|")
            for name, rate, cpu in worker_rates(pattern, n, ns.window):
                print(f"| {name} | {rate:,.0f} | {cpu:.1f} |")
        return
    if ns.resume_only:
        with tempfile.TemporaryDirectory() as d:
            pattern = write(Path(d), ns.rows, ns.shards, ns.row_group, narrow=True)
            print("| resume (ids only) | seconds to the first row |\n|---|---|")
            for position in (ns.rows // 100, ns.rows // 2):
                seconds, _ = timed(lambda p=position: next(files(pattern, shuffle_window=ns.window).rows(p)))
                print(f"| files() at row {position:,} of {ns.rows:,} | {seconds:.3f} |")
        return
    with tempfile.TemporaryDirectory() as d:
        pattern = write(Path(d), ns.rows, ns.shards, ns.row_group)
        n = ns.rows // ns.shards * ns.shards
        rates = throughput(pattern, n, ns.window)
        print(f"\n{n:,} rows in {ns.shards} Parquet shards, row groups of {ns.row_group:,}, window {ns.window:,}\n")
        print("| reader | rows/s | vs datasets streaming | vs datasets + StatefulDataLoader |\n|---|---|---|---|")
        rate_of = dict(rates)
        for name, rate in rates:
            kind = "shuffle buffer" if "shuffle" in name else "file order"
            plain = rate_of[f"datasets streaming, {kind}"]
            loader = rate_of.get(f"datasets + StatefulDataLoader, {kind}")
            versus = f"{rate / loader:.2f}x" if loader else "torchdata not installed"
            print(f"| {name} | {rate:,.0f} | {rate / plain:.2f}x | {versus} |")
        print("\n| resume | seconds to the first row |\n|---|---|")
        for name, seconds in resume_times(pattern, n, ns.window):
            print(f"| {name} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
