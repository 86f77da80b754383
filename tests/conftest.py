"""Shared test settings.

Hypothesis runs derandomized under CI (``CI=true``), so a green main stays green. Tests marked
``slow`` run in a reduced form by default (CI included); ``TRAINFOLD_SLOW=full`` runs them fully.
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

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def full_slow() -> bool:
    """True when slow tests should run at full size (``TRAINFOLD_SLOW=full``)."""
    return os.environ.get("TRAINFOLD_SLOW") == "full"
