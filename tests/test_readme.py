"""Every ```python block of the README runs, in order, in one namespace (in a scratch directory)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 3


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(python_blocks()):
        code = compile(block, f"README.md python block {i + 1}", "exec")
        exec(code, namespace)
