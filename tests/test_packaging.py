"""What the package declares is what CI tests: the torch bound in pyproject is the version the Makefile installs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:2])


def test_the_declared_torch_bound_is_the_version_ci_installs():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (bound,) = [d.split(">=")[1] for d in deps if d.startswith("torch>=")]
    (pinned,) = re.findall(r"^TORCH \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert _release(bound) == _release(pinned), f"pyproject declares torch>={bound}; CI tests torch=={pinned}"


def test_the_installed_torch_meets_the_declared_bound():
    import torch

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (bound,) = [d.split(">=")[1] for d in deps if d.startswith("torch>=")]
    assert _release(torch.__version__) >= _release(bound), (torch.__version__, bound)
