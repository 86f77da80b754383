"""Shared test settings.

Hypothesis runs derandomized under CI (``CI=true``), so a green main stays green. Tests marked
``slow`` run in a reduced form by default (CI included); ``TRAINFOLD_SLOW=full`` runs them fully.
``make test`` runs the suite on two pytest-xdist workers, a test file to a worker (``--dist loadfile``), in the
order collected (``--no-loadscope-reorder``): the longest files first (``LONGEST_FIRST``), so no long file starts
last while the other worker has nothing left to do.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on a 2-core runner: one thread each (two OpenMP threads a worker would
    # spin against the other worker's), and the processes the tests start inherit the same setting.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


# The files that take longest, longest first: CPU seconds of a reduced run with their subprocesses, one thread a
# process, measured one file at a time (December 2026; resource.getrusage of the pytest process and its children).
# A file missing here only starts later.
LONGEST_FIRST = (
    "test_sharded_checkpoint.py",  # 76-82
    "test_resume_stress.py",  # 51
    "test_benchmarks.py",  # 50 (each script's main() in the test process; its own children still start)
    "test_benchmarks_more.py",  # 49
    "test_grpo_async.py",  # 38 (reduced: one kill -9 engine)
    "test_sharded.py",  # 36
    "test_elastic_sessions.py",  # 35
    "test_cli.py",  # 33
    "test_notebooks.py",  # 27 (all seven in one interpreter)
    "test_files_stream_elastic.py",  # 27
    "test_resume_check.py",  # 24
    "test_distributed.py",  # 24
    "test_preempt.py",  # 21
    "test_step_fsdp.py",  # 21
    "test_global_rng_ranks.py",  # 16
    "test_checkpoint_faults.py",  # 16
    "test_chunked_loss.py",  # 11
    "test_compiled.py",  # 10 (inductor's compile, with a warm cache; 19 on a cold one)
    "test_rollout_engines.py",  # ~15
    "test_files_stream_packed.py",  # ~10
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collect the ``LONGEST_FIRST`` files first, in that order (the rest keep theirs): xdist's queue order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def full_slow() -> bool:
    """True when slow tests should run at full size (``TRAINFOLD_SLOW=full``)."""
    return os.environ.get("TRAINFOLD_SLOW") == "full"
