"""The package's layout rules, checked with ``ast``: layers, cycles, private names, sizes.

Layers, bottom up (a module imports only from its own layer or lower ones, lazily or not):
``core`` < ``distributed`` < ``optim`` < ``data`` < ``step`` < ``evaluation`` < ``ckpt`` < ``observe``
< ``rollout`` < ``loop`` < ``trainer`` < ``sft`` < ``dpo`` < ``grpo`` < ``reward`` < ``kto`` < ``cli`` < the top level
(``trainfold/__init__``, ``testing``). No algorithm package imports another: what they share lives below
them (``core``, ``data``, ``trainer``).
No module imports another module's ``_private`` name; no two modules import each other, even
through others; no module is over 500 lines and no function over 60.

Run it as a script to list every violation: ``python tests/test_layout.py``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "trainfold"
LAYERS = (
    "core",
    "distributed",
    "optim",
    "data",
    "step",
    "evaluation",
    "ckpt",
    "observe",
    "rollout",
    "loop",
    "trainer",
    "sft",
    "dpo",
    "grpo",
    "reward",
    "kto",
    "cli",
)
ALGORITHMS = ("sft", "dpo", "grpo", "reward", "kto")
# What each package imports, besides itself (the top level, ``trainfold/__init__``, imports them all). An arrow
# not here is a new coupling: move the piece to the layer it belongs to, or, where it is one, declare it here.
PACKAGE_IMPORTS = {
    "core": set(),
    "distributed": set(),
    "optim": {"core"},
    "data": {"core"},
    "step": {"core", "distributed", "optim"},
    "evaluation": {"core", "distributed"},
    "ckpt": {"core", "distributed", "data"},
    "observe": {"core", "ckpt"},
    "rollout": {"core"},
    "loop": {"core", "data", "evaluation", "ckpt", "observe"},
    "trainer": {"core", "distributed", "optim", "data", "step", "evaluation", "ckpt", "observe", "loop"},
    "sft": {"core", "data", "trainer"},
    "dpo": {"core", "data", "trainer"},
    "grpo": {"core", "data", "rollout", "trainer"},
    "reward": {"core", "trainer"},
    "kto": {"core", "data", "trainer"},
    "cli": {"core", "distributed", "data", "ckpt", "observe", "trainer"},
    "testing": {"core", "data"},
}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ("trainfold", *path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)  # the top: trainfold/__init__, testing


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, str, int]]:
    """Yield ``(module, imported name or "", line)`` for every trainfold import in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "trainfold":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub, "", node.lineno
                else:
                    yield target, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "trainfold":
                    yield alias.name, "", node.lineno


def graph(known: dict[str, Path]) -> dict[str, set[str]]:
    return {
        name: {target for target, _, _ in imports(name, path, known) if target != name and target in known}
        for name, path in known.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer_violations(known: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in known.items():
        if name == "trainfold":
            continue
        for target, _, line in imports(name, path, known):
            if target in known and layer(target) > layer(name):
                bad.append(f"{name}:{line} imports {target} (a higher layer)")
    return bad


def private_imports(known: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in known.items():
        for target, imported, line in imports(name, path, known):
            if imported.startswith("_") and not imported.startswith("__") and target != name:
                bad.append(f"{name}:{line} imports {target}.{imported}")
    return bad


def package_of(name: str) -> str:
    """The folder of ``trainfold`` a module is in (``trainfold`` itself for the top level's own files)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS + ("testing",) else "trainfold"


def package_arrows(known: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """Each ``(package, package it imports)`` arrow, with the imports that draw it."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for name, path in known.items():
        for target, _, line in imports(name, path, known):
            mine, theirs = package_of(name), package_of(target)
            if target in known and mine != theirs:
                arrows.setdefault((mine, theirs), []).append(f"{name}:{line} imports {target}")
    return arrows


def long_modules(known: dict[str, Path]) -> list[str]:
    return [
        f"{name}: {n} lines"
        for name, path in known.items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]


def long_functions(known: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - start + 1
                if n > MAX_FUNCTION_LINES:
                    bad.append(f"{name}.{node.name}:{node.lineno}: {n} lines")
    return bad


def test_lower_layers_never_import_higher_ones():
    assert layer_violations(modules()) == []


def test_no_module_imports_another_modules_private_names():
    assert private_imports(modules()) == []


def test_no_import_cycle():
    assert cycles(graph(modules())) == []


def test_no_algorithm_package_imports_another():
    sideways = {k: v for k, v in package_arrows(modules()).items() if k[0] in ALGORITHMS and k[1] in ALGORITHMS}
    assert sideways == {}


def test_each_package_imports_only_the_packages_it_declares():
    arrows = package_arrows(modules())
    undeclared = {k: v for k, v in arrows.items() if k[0] != "trainfold" and k[1] not in PACKAGE_IMPORTS[k[0]]}
    assert undeclared == {}
    unused = sorted((p, q) for p, qs in PACKAGE_IMPORTS.items() for q in qs if (p, q) not in arrows)
    assert unused == []  # an arrow cut: take it off PACKAGE_IMPORTS


def test_modules_and_functions_are_short():
    known = modules()
    assert long_modules(known) == []
    assert long_functions(known) == []


def test_the_checker_sees_a_cycle_and_a_layer_violation():
    edges = {"trainfold.core.a": {"trainfold.step.b"}, "trainfold.step.b": {"trainfold.core.a"}, "trainfold.x": set()}
    assert cycles(edges) == [["trainfold.core.a", "trainfold.step.b"]]
    assert layer("trainfold.core.a") < layer("trainfold.step.b") < layer("trainfold.cli.demo")


if __name__ == "__main__":
    known = modules()
    report = {
        "layers": layer_violations(known),
        "private": private_imports(known),
        "cycles": [" <-> ".join(c) for c in cycles(graph(known))],
        "modules": long_modules(known),
        "functions": long_functions(known),
    }
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for kind, items in report.items():
        items = [i for i in items if only in i]
        print(f"== {kind}: {len(items)}")
        for item in items:
            print("  ", item)
