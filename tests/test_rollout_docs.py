"""Every ```python block of docs/rollout.md runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "rollout.md"


def test_rollout_doc_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {"__name__": "rollout_doc"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/rollout.md python block {i + 1}", "exec"), namespace)
