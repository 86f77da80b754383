"""Shared test settings.

Hypothesis runs derandomized under CI (``CI=true``), so a green main stays green. Tests marked
``slow`` run in a reduced form by default (CI included); ``TRAINFOLD_SLOW=full`` runs them fully.
``make test`` runs the suite on two pytest-xdist workers, a test file to a worker (``--dist loadfile``).
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


@pytest.fixture
def full_slow() -> bool:
    """True when slow tests should run at full size (``TRAINFOLD_SLOW=full``)."""
    return os.environ.get("TRAINFOLD_SLOW") == "full"
