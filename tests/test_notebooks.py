"""Execute the notebooks in ``notebooks/`` top to bottom on the CPU; an error in any cell fails.

The suite runs them all in one fresh interpreter (``python tests/test_notebooks.py --check DIR``, this Python and
its packages): each notebook's code cells in order in a namespace of its own, in a directory of its own, as a
kernel would run them (a cell's last expression is evaluated and its ``repr`` taken; after each cell its figures
are drawn to PNG and closed, as the inline backend does), with ``MPLBACKEND=Agg`` and one CPU thread. One
interpreter, not a Jupyter kernel a notebook: the suite pays ``import torch`` once (so cells are plain Python: no
IPython magics). Notebooks ship with their outputs (plots inline), so they read on GitHub and in the docs; a test
checks every code cell ran, in order, without an error. ``python tests/test_notebooks.py`` executes them all again
in Jupyter kernels (nbclient) and writes the outputs back.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import trainfold

nbformat = pytest.importorskip("nbformat")
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
TIMEOUT_S = 300  # a notebook


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Each notebook's error (its cell and traceback), or None: all run in one fresh interpreter."""
    scratch = tmp_path_factory.mktemp("notebooks")
    # One thread: the notebooks' models are tiny, and on a busy 2-core runner two OpenMP threads
    # spin against other processes (a TinyLM step measured 75x slower than with one thread).
    env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    src = str(Path(trainfold.__file__).resolve().parents[1])  # the trainfold these tests test
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    command = [sys.executable, __file__, "--check", str(scratch)]
    timeout = TIMEOUT_S * len(EXPECTED)
    done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((scratch / "results.json").read_text())


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs(name: str, runs: dict[str, str | None]) -> None:
    if runs[name] is not None:
        pytest.fail(f"{name} failed (python {sys.executable}):\n{runs[name]}", pytrace=False)


def run_cells(nb: nbformat.NotebookNode, name: str) -> None:
    """Run ``nb``'s code cells in order in a fresh namespace, as a kernel would; the first error propagates."""
    import io
    import linecache

    import matplotlib.pyplot as plt

    namespace: dict[str, object] = {"__name__": "__main__"}
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        where = f"<{name} cell {i + 1}>"
        linecache.cache[where] = (len(cell.source), None, cell.source.splitlines(True), where)  # for tracebacks
        tree = ast.parse(cell.source, where)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, where, "exec"), namespace)
        if last is not None:  # the cell's value, shown as its output
            repr(eval(compile(ast.Expression(last.value), where, "eval"), namespace))
        for number in plt.get_fignums():  # the inline backend draws each figure once its cell ends
            plt.figure(number).savefig(io.BytesIO(), format="png")
        plt.close("all")


def check_all(scratch: Path) -> None:
    """Run every notebook (``run_cells``), each in its own directory under ``scratch``; write their errors."""
    sys.path[0] = ""  # a kernel's path: its working directory first, not this file's folder
    results: dict[str, str | None] = {}
    path = sys.path[:]
    for name in EXPECTED:
        folder = scratch / Path(name).stem
        folder.mkdir()
        os.chdir(folder)
        try:
            run_cells(nbformat.read(NOTEBOOKS / name, as_version=4), name)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        sys.path[:] = path  # what a notebook put on the path is not the next one's
    (scratch / "results.json").write_text(json.dumps(results))


def execute_in_place() -> None:
    """Run every notebook top to bottom (inline plots, a scratch directory) and write it back with its outputs."""
    import tempfile

    import nbclient

    os.environ.update(OMP_NUM_THREADS="1", PYDEVD_DISABLE_FILE_VALIDATION="1", JUPYTER_PREFER_ENV_PATH="1")
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend: the plots become PNG outputs
    for name in EXPECTED:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        with tempfile.TemporaryDirectory() as scratch:
            nbclient.NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": scratch}}).execute()
        nbformat.write(nb, NOTEBOOKS / name)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check_all(Path(sys.argv[2]))
    else:
        execute_in_place()
