"""Execute the notebooks in ``notebooks/`` top to bottom on the CPU; an error in any cell fails.

The kernel is ``python3`` from the ipykernel installed next to this Python, so the notebooks run
with the same interpreter and packages as the tests. Each runs in a fresh temporary directory
with ``MPLBACKEND=Agg`` (plots are drawn but never shown) and one CPU thread. Notebooks ship with their
outputs (plots inline), so they read on GitHub and in the docs; a test checks every code cell ran, in order,
without an error. ``python tests/test_notebooks.py`` executes them all again and writes the outputs back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXPECTED = (
    "01_compose_a_pipeline.ipynb",
    "02_custom_loss_and_property_tests.ipynb",
    "03_embed_the_step.ipynb",
    "04_dpo.ipynb",
    "05_grpo.ipynb",
    "06_hypergradient_learning_rate.ipynb",
    "07_loop.ipynb",
)
CELL_TIMEOUT_S = 300


def test_every_notebook_is_executed_here() -> None:
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(EXPECTED), f"notebooks/ holds {found}; add new ones to EXPECTED so they are executed"


PLOTS = set(EXPECTED)  # every notebook draws


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_ships_with_the_outputs_of_one_whole_run(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{name}: run it top to bottom once (python {__file__})"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{name}: a cell failed"
    if name in PLOTS:
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}: its plots are missing"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", f"{name}: kernelspec must be python3"


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # One thread: the notebooks' models are tiny, and on a busy 2-core runner two OpenMP threads
    # spin against other processes (a TinyLM step measured 75x slower than with one thread).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets debugpy's frozen-modules note
    monkeypatch.setenv("JUPYTER_PREFER_ENV_PATH", "1")  # this environment's python3 kernel, not a user's
    monkeypatch.delenv("JUPYTER_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"{name} failed (kernel {sys.executable}):\n{exc}", pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, json.dumps(errors, indent=1)[:4000]


def execute_in_place() -> None:
    """Run every notebook top to bottom (inline plots, a scratch directory) and write it back with its outputs."""
    import os
    import tempfile

    os.environ.update(OMP_NUM_THREADS="1", PYDEVD_DISABLE_FILE_VALIDATION="1", JUPYTER_PREFER_ENV_PATH="1")
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend: the plots become PNG outputs
    for name in EXPECTED:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        with tempfile.TemporaryDirectory() as scratch:
            nbclient.NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": scratch}}).execute()
        nbformat.write(nb, NOTEBOOKS / name)


if __name__ == "__main__":
    execute_in_place()
