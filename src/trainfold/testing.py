"""Tools for testing code built on trainfold: Hypothesis strategies, and ranks simulated by threads.

Needs ``hypothesis`` (the ``test`` extra). Each strategy is a function returning a
``SearchStrategy``; use them with ``@given``::

    from hypothesis import given
    from trainfold.testing import label_tensors, sampler_configs

    @given(label_tensors())
    def test_my_loss_ignores_padding(labels):
        ...

    @given(sampler_configs(strategies=["batch_rebalance"]))
    def test_every_sample_once(sampler):
        ...

``on_simulated_ranks(world_size, fn)`` runs ``fn(collective)`` on threads that stand for ranks, so
a distributed path (``make_step(collective=...)``, ``evaluate_sharded``) is tested in one process;
``saved_for_backward(fn)`` measures the activations autograd keeps while ``fn`` runs.
``check_resume("my_run.py:run", stop_at=k)`` checks that your own run, stopped by SIGTERM at step
``k`` and resumed in a fresh process, ends bitwise equal to the same run never stopped.

The examples are random, so the docstrings show deterministic facts about them: the minimal
example ``hypothesis.find`` shrinks to, or a property checked by a small ``@given`` test:

>>> from hypothesis import Phase, find, given, settings
>>> quick = settings(max_examples=5, database=None, deadline=None, phases=[Phase.generate, Phase.shrink])
>>> find(uniform_lengths(min_size=2), lambda xs: True, settings=quick)
[1, 1]
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch
from torch import Tensor

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("trainfold.testing needs hypothesis: pip install 'trainfold[test]'") from exc

from trainfold.data.samplers import LENGTH_STRATEGIES, STRATEGIES, Sampler

__all__ = [
    "ResumeCheck",
    "SimulatedRank",
    "check_resume",
    "compare_results",
    "dump_result",
    "label_tensors",
    "lengths",
    "on_simulated_ranks",
    "sampler_configs",
    "saved_for_backward",
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

T = TypeVar("T")


@attrs.define
class _Room:
    """Where the threads of one simulated world meet to exchange tensors."""

    world_size: int
    barrier: threading.Barrier
    slots: list[Any]


@attrs.frozen
class SimulatedRank:
    """One rank of a world simulated by threads: the collective ``make_step`` and ``evaluate_sharded`` take.

    Sums, maxima and gathers go through a shared room and a barrier, in rank order, as
    ``ProcessGroupCollective`` does over a process group. Make them with :func:`on_simulated_ranks`.
    """

    room: _Room
    rank: int

    @property
    def world_size(self) -> int:
        """Return the number of simulated ranks."""
        return self.room.world_size

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Return every rank's ``tensor``, in rank order."""
        self.room.slots[self.rank] = tensor.detach().clone()
        self.room.barrier.wait()
        out = list(self.room.slots)
        self.room.barrier.wait()  # nobody writes the next round's slots before all have read
        return out

    def sum_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its sum over the ranks, in place."""
        for t in tensors:
            t.copy_(torch.stack(self.all_gather(t)).sum(0))

    def max_(self, tensors: list[Tensor]) -> None:
        """Replace each tensor by its maximum over the ranks, in place."""
        for t in tensors:
            t.copy_(torch.stack(self.all_gather(t)).amax(0))


def on_simulated_ranks(world_size: int, fn: Callable[[SimulatedRank], T], *, timeout: float = 60.0) -> list[T]:
    """Run ``fn(rank)`` once per simulated rank, each on its own thread; return the results in rank order.

    Give each rank its own module (a step borrows its module's slots while it runs), and keep
    dropout off: threads share the process's default generator, so masks would depend on timing.
    An exception on any rank breaks the others' barrier and is raised here.

    >>> import torch
    >>> def total(collective):
    ...     t = torch.tensor([float(collective.rank + 1)])
    ...     collective.sum_([t])
    ...     return t.item()
    >>> on_simulated_ranks(3, total)
    [6.0, 6.0, 6.0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    room = _Room(world_size, threading.Barrier(world_size, timeout=timeout), [None] * world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(SimulatedRank(room, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            room.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"simulated-rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    return results


# -- memory ------------------------------------------------------------------------------------


def saved_for_backward(fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn()`` and return its result and the bytes autograd saved for backward while it ran.

    A deterministic memory measure for tests (activation checkpointing, a leaner loss), where peak
    memory would depend on the allocator.

    >>> import torch
    >>> w = torch.ones(3, requires_grad=True)
    >>> _, saved = saved_for_backward(lambda: (w * torch.arange(3.0)).sum())
    >>> saved  # the gradient of w needs the other factor: 3 float32
    12
    """
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


# -- resume in a fresh process --------------------------------------------------------------------

# What each fresh process runs: the user's ``fn(output_dir, resume_from_checkpoint, observers)``, with
# an observer that sends this process SIGTERM once a step >= stop_at is logged (mode "interrupt").
_CHILD = """
import importlib, os, runpy, signal, sys
target, output_dir, mode, stop_at, result_dir = sys.argv[1:6]
where, _, name = target.rpartition(":")
space = runpy.run_path(where, run_name="__trainfold_check__") if where.endswith(".py") else vars(
    importlib.import_module(where))
sent = []
def interrupt(state, logs):
    if mode == "interrupt" and not sent and int(state.step) >= int(stop_at):
        sent.append(int(state.step))
        os.kill(os.getpid(), signal.SIGTERM)
result = space[name](output_dir, mode == "resume", [interrupt])
from trainfold.testing import dump_result
dump_result(result, result_dir)
"""

_UNLOGGED = ("runtime", "per_second", "train_")  # wall-clock numbers, and the summary of one process's part


def dump_result(result: Any, result_dir: str | os.PathLike) -> None:
    """Write a ``TrainResult``'s state (safetensors), status and log (JSON) for ``compare_results``."""
    import safetensors.torch  # noqa: PLC0415

    from trainfold.core.tree import flatten  # noqa: PLC0415

    Path(result_dir).mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in flatten(result.state).items()}
    safetensors.torch.save_file(tensors, os.path.join(result_dir, "state.safetensors"))
    logs = [
        {k: v for k, v in entry.items() if not any(u in k for u in _UNLOGGED)}
        for entry in result.log_history
        if "train_runtime" not in entry
    ]  # not one process's summary
    record = {"status": result.status, "global_step": result.global_step, "log_history": logs}
    Path(result_dir, "result.json").write_text(json.dumps(record))


@attrs.frozen
class ResumeCheck:
    """The outcome of ``check_resume``: where the run stopped, and every difference from the run never stopped."""

    stopped_at: int
    final_step: int
    differing: tuple[str, ...]  # state keys whose tensors are not torch.equal
    differing_logs: tuple[int, ...]  # steps whose logged values (loss, grad_norm, eval_*, ...) differ

    @property
    def ok(self) -> bool:
        """Say whether the resumed run equals the uninterrupted one bitwise, state and logs."""
        return not self.differing and not self.differing_logs

    def __str__(self) -> str:
        if self.ok:
            return f"stopped at step {self.stopped_at}, resumed to step {self.final_step}: bitwise equal"
        return (
            f"stopped at step {self.stopped_at}, resumed to step {self.final_step}: tensors differ "
            f"{list(self.differing)[:8]}{' ...' if len(self.differing) > 8 else ''}, "
            f"logs differ at steps {list(self.differing_logs)[:8]}"
        )


def check_resume(
    target: str,
    *,
    stop_at: int,
    workdir: str | os.PathLike | None = None,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
) -> ResumeCheck:
    """Check that a run stopped by SIGTERM at step ``stop_at`` and resumed in a fresh process ends bitwise equal.

    ``target`` is ``"path/to/script.py:fn"`` or ``"package.module:fn"``, where
    ``fn(output_dir, resume_from_checkpoint, observers)`` builds the run and returns
    ``train(model, args, data, observers=observers, resume_from_checkpoint=resume_from_checkpoint)``
    with ``args.output_dir = output_dir`` and ``enable_jit_checkpoint=True`` (build everything
    inside ``fn``, seeded: each call is a fresh process). Three fresh processes run it: once to the
    end; once until an observer sends it SIGTERM after the first logged step ``>= stop_at`` (use
    ``logging_steps=1`` to stop exactly there); once resumed from that run's JIT checkpoint. Every
    tensor of the final states is compared with ``torch.equal`` and every logged value by step.

    ``check_resume("my_run.py:run", stop_at=5).ok`` is True when resume is bitwise; ``str()`` of the
    result names what differs. A process that fails raises ``RuntimeError`` with its stderr.
    """
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="trainfold-resume-"))
    child_env = {**os.environ, **(env or {})}

    def start(mode: str, out: Path, result: Path) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _CHILD, target, str(out), mode, str(stop_at), str(result)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env,
        )

    def finish(proc: subprocess.Popen[str], what: str) -> None:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            raise RuntimeError(f"check_resume: the {what} run of {target!r} took over {timeout} s") from None
        if proc.returncode == -signal.SIGTERM and what == "interrupted":
            raise ValueError(
                f"check_resume: {target!r} was not preempted (SIGTERM killed it): pass "
                "enable_jit_checkpoint=True and the observers to train"
            )
        if proc.returncode != 0:
            raise RuntimeError(f"check_resume: the {what} run of {target!r} exited {proc.returncode}:\n{err[-4000:]}")

    runs = {name: (root / name / "output", root / name / "result") for name in ("uninterrupted", "interrupted")}
    procs = {name: start("interrupt" if name == "interrupted" else "plain", *paths) for name, paths in runs.items()}
    for name, proc in procs.items():
        finish(proc, name)
    stopped = _read_result(runs["interrupted"][1])
    if stopped["status"] != "preempted":
        raise ValueError(
            f"check_resume: {target!r} was not preempted (status {stopped['status']!r} at step "
            f"{stopped['global_step']}): pass enable_jit_checkpoint=True and the observers to train, and "
            f"stop_at={stop_at} below the run's last step"
        )
    resumed_dir = root / "interrupted" / "resumed"
    finish(start("resume", runs["interrupted"][0], resumed_dir), "resumed")
    differing, differing_logs = compare_results(runs["uninterrupted"][1], resumed_dir)
    return ResumeCheck(
        int(stopped["global_step"]), int(_read_result(resumed_dir)["global_step"]), differing, differing_logs
    )


def compare_results(expected: str | os.PathLike, got: str | os.PathLike) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Return ``(state keys whose tensors differ, steps whose logs differ)`` between two ``dump_result`` folders."""
    import safetensors.torch  # noqa: PLC0415

    a = safetensors.torch.load_file(Path(expected) / "state.safetensors")
    b = safetensors.torch.load_file(Path(got) / "state.safetensors")
    differing = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    logs = _differing_logs(_read_result(Path(expected))["log_history"], _read_result(Path(got))["log_history"])
    return tuple(differing), logs


def _read_result(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "result.json").read_text())


def _differing_logs(want: list[dict[str, Any]], have: list[dict[str, Any]]) -> tuple[int, ...]:
    """Return the steps whose log entries differ (by kind: train logs and eval logs compared apart)."""

    def by_step(entries: list[dict[str, Any]]) -> dict[tuple[int, bool], dict[str, Any]]:
        return {(int(e.get("step", -1)), any(k.startswith("eval_") for k in e)): e for e in entries if "step" in e}

    a, b = by_step(want), by_step(have)
    return tuple(sorted({step for step, _ in a.keys() | b.keys() if a.get((step, _)) != b.get((step, _))}))
