"""kiln's layers import one way, and no module grows past 600 lines.

The check is static: every ``import`` and ``from ... import`` statement of every module under
``kiln/`` -- at module level, inside functions and methods, under ``if TYPE_CHECKING`` --
and every string literal passed to ``importlib.import_module`` is resolved to the kiln
module it names, and that module's layer must be the importer's layer or one below it.
See ``docs/architecture.md`` for what each layer holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kiln"

LAYERS = ["ir", "passes", "runtime", "backends", "frontends", "tuning", "compiler", "tools", "cli"]
"""Lowest first: a module may import its own layer and the layers before it."""

MAX_LINES = 600


def layer_of(module: str) -> str:
    """The layer of dotted kiln module ``module``."""
    parts = module.split(".")
    assert parts[0] == "kiln", module
    if module in ("kiln.compiler.cli", "kiln.__main__"):
        return "cli"  # the command line dispatches to the tools (``kiln zoo``) too
    if len(parts) == 1 or parts[1] in ("loops", "mapping", "jax", "train"):
        return "compiler"  # kiln/__init__.py (the public API), kiln/loops.py, mapping.py, jax.py, train.py
    top = parts[1]
    if top == "zoo":
        return "tools"
    if top == "export":
        return "tools"  # kiln.export: serving compiled models inside DuckDB
    if top == "workloads":
        return "tools"  # kiln.workloads: data preparation for the workload models
    if top == "schedule":
        return "compiler"  # kiln.schedule: model-level schedules, a public-API package
    if top in LAYERS:
        return top
    raise AssertionError(f"{module}: no layer is assigned to kiln.{top}; add it to LAYERS in {__file__}")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every kiln module ``path`` imports, wherever the import stands."""
    importer = module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node.level, node.module)
            found.append((node.lineno, base))
            # ``from kiln.passes import ordering`` imports the submodule kiln.passes.ordering
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if (ROOT / Path(*candidate.split("."))).with_suffix(".py").exists() or \
                        (ROOT / Path(*candidate.split(".")) / "__init__.py").exists():
                    found.append((node.lineno, candidate))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return [(line, m) for line, m in found if m == "kiln" or m.startswith("kiln.")]


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    assert MODULES
    for path in MODULES:
        layer_of(module_name(path))


def test_imports_run_one_way():
    violations = []
    for path in MODULES:
        importer = module_name(path)
        mine = LAYERS.index(layer_of(importer))
        for line, module in imports_of(path):
            if LAYERS.index(layer_of(module)) > mine:
                violations.append(f"{path.relative_to(ROOT)}:{line}: {importer} ({layer_of(importer)}) "
                                  f"imports {module} ({layer_of(module)})")
    assert not violations, "imports against the layer order " + " <- ".join(LAYERS) + ":\n" + "\n".join(violations)


def test_no_module_over_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in MODULES
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("source, expected", [
    ("import kiln.compiler.api\n", ["kiln.compiler.api"]),
    ("def f():\n    from kiln.tuning import measure\n", ["kiln.tuning", "kiln.tuning.measure"]),
    ("import importlib\nx = importlib.import_module('kiln.compiler')\n", ["kiln.compiler"]),
    ("from . import graph\n", ["kiln.ir", "kiln.ir.graph"]),
    ("from ..runtime import timing\n", ["kiln.runtime", "kiln.runtime.timing"]),
])
def test_the_checker_sees_every_form_of_import(tmp_path, source, expected):
    # a module at kiln/ir/probe.py of a scratch tree (ROOT points there while it is read)
    fake_root = tmp_path
    (fake_root / "kiln" / "ir").mkdir(parents=True)
    for rel in ("kiln/ir/graph.py", "kiln/runtime/timing.py", "kiln/tuning/measure.py"):
        (fake_root / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake_root / rel).write_text("")
    probe = fake_root / "kiln" / "ir" / "probe.py"
    probe.write_text(source)
    globals()["ROOT"], saved = fake_root, ROOT
    try:
        assert sorted(m for _, m in imports_of(probe)) == sorted(expected)
    finally:
        globals()["ROOT"] = saved


def test_the_checker_flags_an_upward_import():
    assert LAYERS.index(layer_of("kiln.compiler.api")) > LAYERS.index(layer_of("kiln.ir.graph"))
    assert layer_of("kiln.loops") == "compiler" and layer_of("kiln") == "compiler"
    assert layer_of("kiln.mapping") == "compiler"
    assert layer_of("kiln.zoo.run") == "tools" and layer_of("kiln.compiler.cli") == "cli"
