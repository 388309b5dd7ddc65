"""Tests of the pass manager: pipeline text, verification, dumps, statistics, fixpoints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest

import kiln.ir as ir
from kiln.ir import Graph, VerificationError
from kiln.passes import (
    DEFAULT_PIPELINE,
    Pass,
    PassError,
    PassManager,
    PassResult,
    PipelineSyntaxError,
    default_pipeline,
    parse_pipeline,
    register_pass,
)
from kiln.passes.cse import CommonSubexpressionElimination
from kiln.passes.dce import DeadCodeElimination
from kiln.passes.fold import ConstantFolding

GRAPH = """
graph @main(%x: f32[2, 3]) {
  %c: f32[] = const 2.0
  %one: f32[] = const 1.0
  %0: f32[] = add(%c, %one)
  %1: f32[2, 3] = mul(%x, %0)
  %2: f32[2, 3] = mul(%x, %0)
  %3: f32[2, 3] = add(%1, %2)
  %4: f32[2, 3] = exp(%x)
  return %3
}
"""


@register_pass
@dataclass(frozen=True)
class OptionsProbe(Pass):
    """Identity pass whose options cover every kind pipeline text can spell."""

    name: ClassVar[str] = "test-pm-options"
    count: int = 1
    ratio: float = 0.5
    enabled: bool = False
    label: str = "x"
    sizes: tuple[int, ...] = ()
    names: list[str] = dataclasses.field(default_factory=list)
    limit: int | None = None

    def run(self, graph: Graph) -> PassResult:
        return PassResult(graph, False)


@register_pass
@dataclass(frozen=True)
class BreaksOrder(Pass):
    """Produces an invalid graph: its first node moves to the end (use before definition)."""

    name: ClassVar[str] = "test-pm-break-order"

    def run(self, graph: Graph) -> PassResult:
        g = graph.clone()
        g.nodes.append(g.nodes.pop(0))
        return PassResult(g, True)


@register_pass
@dataclass(frozen=True)
class Raises(Pass):
    name: ClassVar[str] = "test-pm-raises"

    def run(self, graph: Graph) -> PassResult:
        raise RuntimeError("boom in pass")


@register_pass
@dataclass(frozen=True)
class MutatesInput(Pass):
    name: ClassVar[str] = "test-pm-mutates"

    def run(self, graph: Graph) -> PassResult:
        graph.nodes.reverse()
        graph.nodes.reverse()
        graph.outputs = list(reversed(graph.outputs)) + []
        graph.name = "mutated"
        return PassResult(graph, True)


@register_pass
@dataclass(frozen=True)
class PeelOneNode(Pass):
    """Removes one unused node per run: needs several runs to reach its fixpoint."""

    name: ClassVar[str] = "test-pm-peel"

    def run(self, graph: Graph) -> PassResult:
        used = {v for n in graph.nodes for v in n.inputs} | set(graph.outputs)
        g = graph.clone()
        for node in reversed(g.nodes):
            if not any(v.name in {u.name for u in used} for v in node.outputs):
                g.remove_node(node)
                return PassResult(g, True)
        return PassResult(graph, False)


def test_pipeline_text_parses_option_types():
    (p,) = parse_pipeline('test-pm-options{count=3, ratio=1e-3,enabled=true,label="a,b",'
                          "sizes=[1,2,3],names=[u,v],limit=none}")
    assert p == OptionsProbe(count=3, ratio=1e-3, enabled=True, label="a,b", sizes=(1, 2, 3),
                             names=["u", "v"], limit=None)
    (q,) = parse_pipeline("test-pm-options{limit=7}")
    assert q.limit == 7
    assert parse_pipeline(p.spec()) == [p]


def test_pipeline_text_round_trips_through_spec():
    pm = PassManager("canonicalize, fold{max_elements=16},cse,dce")
    assert pm.spec() == "canonicalize,fold{max_elements=16},cse,dce"
    assert [type(p) for p in PassManager(pm.spec()).passes] == [
        type(p) for p in pm.passes]
    assert parse_pipeline("") == []


@pytest.mark.parametrize("text, message", [
    ("cse,no-such-pass", r"unknown pass 'no-such-pass'; registered passes: .*canonicalize.*cse"),
    ("fold{max_nodes=3}", r"pass 'fold' has no option 'max_nodes'; its options: max_elements"),
    ("fold{max_elements=many}", r"pass 'fold' option 'max_elements': expected int, got 'many'"),
    ("test-pm-options{enabled=maybe}", r"expected true or false, got 'maybe'"),
    ("test-pm-options{sizes=3}", r"expected a list like \[1,2\], got '3'"),
    ("fold{max_elements}", r"option 'max_elements' is not key=value"),
    ("fold{max_elements=1", r"unbalanced"),
    ("cse,,dce", r"empty pass name"),
])
def test_pipeline_text_errors(text, message):
    with pytest.raises(PipelineSyntaxError, match=message):
        PassManager(text)


def test_run_is_functional_and_reports_change():
    g = ir.parse(GRAPH)
    before = str(g)
    pm = PassManager([ConstantFolding(), CommonSubexpressionElimination(), DeadCodeElimination()])
    result = pm.run(g)
    assert str(g) == before
    assert result.changed
    assert [n.op_name for n in result.graph.nodes] == ["mul", "add"]


def test_verification_failure_names_pass_and_predecessors():
    g = ir.parse(GRAPH)
    pm = PassManager("cse,test-pm-break-order,dce")
    with pytest.raises(PassError, match=r"IR verification failed on the graph produced by pass "
                                        r"'test-pm-break-order' \(after: cse\)") as info:
        pm.run(g)
    assert info.value.pass_name == "test-pm-break-order"
    assert info.value.previous == ["cse"]
    assert isinstance(info.value.__cause__, VerificationError)
    assert str(info.value.graph) == str(PassManager("cse").run(g).graph)


def test_exception_inside_a_pass_is_chained():
    pm = PassManager("fold,cse,test-pm-raises")
    with pytest.raises(PassError, match=r"pass 'test-pm-raises' failed \(after: fold, cse\): "
                                        r"RuntimeError: boom in pass") as info:
        pm.run(ir.parse(GRAPH))
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(PassError, match=r"\(it was the first pass\)"):
        PassManager("test-pm-raises").run(ir.parse(GRAPH))


def test_unverified_pipeline_lets_a_broken_graph_through():
    result = PassManager("test-pm-break-order", verify=False).run(ir.parse(GRAPH))
    with pytest.raises(VerificationError):
        ir.verify(result.graph)


def test_check_input_unchanged_catches_a_mutating_pass():
    with pytest.raises(PassError, match=r"pass 'test-pm-mutates' modified its input graph"):
        PassManager("test-pm-mutates", check_input_unchanged=True).run(ir.parse(GRAPH))


def test_dump_dir_writes_ir_after_each_pass(tmp_path):
    PassManager("fold,cse", dump_dir=tmp_path).run(ir.parse(GRAPH))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00-input.kir", "01-fold.kir", "02-cse.kir"]
    dumped = ir.parse((tmp_path / "01-fold.kir").read_text())
    assert "const 3.0" in str(dumped)


def test_dump_env_var(tmp_path, monkeypatch):
    target = tmp_path / "dumps"
    monkeypatch.setenv("KILN_DUMP_IR", str(target))
    PassManager("fold{max_elements=8}").run(ir.parse(GRAPH))
    assert sorted(p.name for p in target.iterdir()) == ["00-input.kir", "01-fold_max_elements_8_.kir"]


def test_stats_and_report():
    pm = PassManager("fold,cse,dce")
    pm.run(ir.parse(GRAPH))
    assert [s.pass_spec for s in pm.stats] == ["fold", "cse", "dce"]
    fold, cse, dce = pm.stats
    assert (fold.nodes_before, fold.nodes_after, fold.changed) == (5, 4, True)
    assert fold.op_delta() == {"add": -1}
    assert (cse.nodes_after, cse.ops_after) == (3, {"add": 1, "exp": 1, "mul": 1})
    assert dce.ops_after == {"add": 1, "mul": 1}
    report = pm.report()
    assert "fold" in report and "5->4" in report and "exp-1" in report
    assert report.splitlines()[-1].startswith("total")
    quiet = PassManager("fold", collect_stats=False)
    quiet.run(ir.parse(GRAPH))
    assert quiet.stats == [] and "no passes ran" in quiet.report()


def test_fixpoint_repeats_until_nothing_changes():
    g = ir.parse(GRAPH.replace("return %3", "return %x"))
    once = PassManager("test-pm-peel").run(g)
    assert len(once.graph.nodes) == len(g.nodes) - 1
    pm = PassManager("test-pm-peel", fixpoint=True, max_iterations=20)
    result = pm.run(g)
    assert result.graph.nodes == [] and result.changed
    assert [s.changed for s in pm.stats][-1] is False
    bounded = PassManager("test-pm-peel", fixpoint=True, max_iterations=2).run(g)
    assert len(bounded.graph.nodes) == len(g.nodes) - 2


def test_pass_manager_nests_as_a_pipeline_object():
    inner = PassManager("fold,cse")
    outer = PassManager([inner, DeadCodeElimination()])
    result = outer.run(ir.parse(GRAPH))
    assert [s.pass_spec for s in outer.stats] == ["fold,cse", "dce"]
    assert [n.op_name for n in result.graph.nodes] == ["mul", "add"]


def test_default_pipeline():
    pm = default_pipeline()
    assert pm.spec() == DEFAULT_PIPELINE
    assert pm.fixpoint and pm.verify
    g = ir.parse(GRAPH)
    result = pm.run(g)
    assert result.changed and len(result.graph.nodes) < len(g.nodes)
    assert not default_pipeline().run(result.graph).changed
