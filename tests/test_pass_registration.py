"""Passes register without an import list: every module of ``kiln/passes/`` is loaded by
``kiln.passes.base.load_passes``, and a pass module may declare its place in the default
pipeline (``default_before``) while ``DEFAULT_PIPELINE`` stays one printable order."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from kiln.passes import DEFAULT_ORDER, DEFAULT_PIPELINE, Pass, PassResult, registered_passes
from kiln.passes.pipeline import compose_order

ROOT = Path(__file__).resolve().parents[1]
PASSES = ROOT / "kiln" / "passes"

WRITTEN_DEFAULT = ("inline-custom-vjp,canonicalize,simplify,fold,cse,sink-views,simplify,composites,sink-views,"
                   "simplify,cse,dce,fuse")


def _declared_pass_names() -> set[str]:
    """Names of the passes the modules directly in ``kiln/passes/`` register, read from their
    source: ``@register_pass`` classes (their ``name``) and ``pattern_pass("name", ...)``."""
    names = set()
    for path in PASSES.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                    getattr(d, "id", None) == "register_pass" for d in node.decorator_list):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == "name":
                        names.add(item.value.value)
            calls = [node.value] if isinstance(node, (ast.Assign, ast.Expr)) else []
            for call in calls:
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "pattern_pass":
                    names.add(call.args[0].value)
    return names


def _python(code: str, cwd: Path, pythonpath: Path | None = None) -> str:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_pass_is_registered_after_importing_the_manager_alone():
    declared = _declared_pass_names()
    assert {"decompose", "recompute", "fuse", "inline-custom-vjp"} <= declared
    out = _python("import json\n"
                  "import kiln.passes.manager as m\n"
                  "from kiln.passes.base import registered_passes\n"
                  "m.PassManager('decompose'), m.PassManager('recompute{max_users=2}')\n"
                  "print(json.dumps(sorted(registered_passes())))\n", cwd=ROOT)
    assert set(json.loads(out)) == declared


PROBE = '''
from dataclasses import dataclass
from typing import ClassVar

from kiln.passes.base import Pass, PassResult, register_pass


@register_pass
@dataclass(frozen=True)
class Probe(Pass):
    name: ClassVar[str] = "probe"
    default_before: ClassVar[str] = "fuse"

    def run(self, graph):
        return PassResult(graph, False)
'''


def test_a_new_pass_module_is_registered_and_joins_the_default_pipeline(tmp_path):
    """One new file in ``kiln/passes/`` (of a copy of kiln) and nothing else."""
    shutil.copytree(ROOT / "kiln", tmp_path / "kiln", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "kiln" / "passes" / "probe.py").write_text(PROBE)
    out = _python("import kiln.passes as p\n"
                  "print(p.__file__)\n"
                  "print(p.DEFAULT_PIPELINE)\n"
                  "print(p.default_pipeline().spec(), p.PassManager('cse,probe').spec())\n",
                  cwd=tmp_path, pythonpath=tmp_path)
    where, pipeline, specs = out.splitlines()
    assert Path(where).is_relative_to(tmp_path)
    assert pipeline == WRITTEN_DEFAULT.replace(",fuse", ",probe,fuse")
    assert specs == f"{pipeline} cse,probe"


def test_the_default_order_is_the_written_one():
    assert DEFAULT_PIPELINE == ",".join(DEFAULT_ORDER) == WRITTEN_DEFAULT
    assert not any(cls.default_before for cls in registered_passes().values())


def _fake(name: str, before: str | None) -> type[Pass]:
    @dataclass(frozen=True)
    class Fake(Pass):
        def run(self, graph):  # pragma: no cover - never run
            return PassResult(graph, False)

    Fake.name, Fake.default_before = name, before
    return Fake


def test_compose_order_inserts_declared_passes_before_the_first_anchor():
    order = ("a", "b", "a", "c")
    passes = [_fake("z", "a"), _fake("y", "a"), _fake("x", "c"), _fake("w", None)]
    assert compose_order(order, passes) == "y,z,a,b,a,x,c"
    assert compose_order(order, []) == "a,b,a,c"
    with pytest.raises(ValueError, match="asks to run before 'nope'"):
        compose_order(order, [_fake("z", "nope")])
    with pytest.raises(ValueError, match="in the written default order"):
        compose_order(order, [_fake("b", "c")])


@dataclass(frozen=True)
class _Declared(Pass):
    name: ClassVar[str] = "declared"
    default_before: ClassVar[str] = "fuse"
    level: int = 1

    def run(self, graph):  # pragma: no cover - never run
        return PassResult(graph, False)


def test_default_before_is_a_class_declaration_not_an_option():
    assert [f.name for f in dataclasses.fields(_Declared)] == ["level"]
    assert _Declared(level=2).spec() == "declared{level=2}" and _Declared().options == {"level": 1}
    assert compose_order(DEFAULT_ORDER, [_Declared]) == WRITTEN_DEFAULT.replace(",fuse", ",declared,fuse")
