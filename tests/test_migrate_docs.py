"""Every ```python block of docs/migration.md runs, in order, in one namespace (in a scratch directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migration.md"


def test_the_migration_guide_runs(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "migration_guide"}
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 5
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/migration.md python block {i + 1}", "exec"), namespace)
