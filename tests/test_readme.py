"""Every ```python block of the README and of the documentation pages runs: in the order the README had them
before it was split into pages, in one namespace (later pages use what the quickstart built), in a scratch
directory. Pages that include others (``--8<--``) are run where their text lives."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (
    "README.md",
    "docs/functional.md",
    "docs/trainer.md",
    "docs/checkpoints.md",
    "docs/distributed.md",
    "docs/cli.md",
    "docs/logging.md",
    "docs/recipes.md",
    "docs/testing.md",
    "docs/performance.md",
    "docs/notebooks.md",
    "docs/pure.md",
    "docs/loop.md",
)
RUN_ELSEWHERE = {
    "docs/migration.md": "tests/test_migrate_docs.py",
    "docs/rl.md": "tests/test_docs_rl.py",
    "docs/rollout.md": "tests/test_rollout_docs.py",
    "docs/streaming.md": "tests/test_files_stream.py",
}


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def test_every_docs_page_is_run_here():
    pages = {"README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))}
    assert sorted(p for p in pages if python_blocks(p) and p not in PAGES and p not in RUN_ELSEWHERE) == []


def test_readme_has_examples():
    assert len(python_blocks("README.md")) >= 3


def test_readme_and_docs_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for page in PAGES:
        for i, block in enumerate(python_blocks(page)):
            exec(compile(block, f"{page} python block {i + 1}", "exec"), namespace)
