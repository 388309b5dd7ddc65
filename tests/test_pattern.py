"""Tests of the declarative pattern API and the greedy rewrite driver (kiln.passes.pattern)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kiln.ir as ir
from kiln.ir import DType, Graph, TensorType, defop
from kiln.passes import PassManager, get_pass
from kiln.passes.pattern import (
    FLOAT_DTYPES,
    RewriteError,
    any_value,
    apply_patterns,
    const,
    match,
    op,
    pattern_pass,
    rewrite,
)

F32 = DType.float32


def _graph(text: str) -> Graph:
    return ir.parse(text)


def canon(g: Graph) -> str:
    """The text of ``g`` with constant and node-result names renumbered in definition order,
    so graphs equal up to value names print the same."""
    names = [v.name for v in [*g.constants, *(o for n in g.nodes for o in n.outputs)]]
    mapping = {n: f"#{i}" for i, n in enumerate(names)}
    return re.sub(r"%([A-Za-z0-9_.]+)", lambda m: "%" + mapping.get(m.group(1), m.group(1)), str(g))


def _root(g: Graph, name: str) -> ir.Value:
    return next(v for v in g.values() if v.name == name)


MUL_GRAPH = """
graph @main(%x: f32[2, 3], %y: f32[2, 3]) {
  %one: f32[] = const 1.0
  %0: f32[2, 3] = mul(%one, %x)
  %1: f32[2, 3] = mul(%x, %y)
  %2: f32[2, 3] = sub(%1, %1)
  %3: f32[2, 3] = sub(%1, %0)
  return %2, %3
}
"""


# ------------------------------------------------------------------------------ matching
def test_commutative_matches_either_order_only_when_asked():
    g = _graph(MUL_GRAPH)
    either = op("mul", any_value("x"), const(value=1), commutative=True)
    ordered = op("mul", any_value("x"), const(value=1))
    m = match(either, _root(g, "0"), g)
    assert m is not None and m["x"].name == "x"
    assert match(ordered, _root(g, "0"), g) is None


def test_repeated_capture_name_must_bind_the_same_value():
    g = _graph(MUL_GRAPH)
    same = op("sub", any_value("a"), any_value("a"))
    assert match(same, _root(g, "2"), g) is not None
    assert match(same, _root(g, "3"), g) is None


def test_nested_operand_patterns_and_captured_nodes():
    g = _graph(MUL_GRAPH)
    pat = op("sub", op("mul", any_value("x"), any_value("y"), name="prod"), any_value("z"))
    m = match(pat, _root(g, "3"), g)
    assert m is not None
    assert (m["x"].name, m["y"].name, m["z"].name) == ("x", "y", "0")
    assert m.node("prod").op_name == "mul"
    assert m.root.op_name == "sub" and m.value.name == "3"
    with pytest.raises(KeyError, match="captured no value named 'w'"):
        m["w"]


def test_commutative_backtracks_into_the_second_order():
    g = _graph("""
graph @main(%x: f32[3]) {
  %0: f32[3] = exp(%x)
  %1: f32[3] = neg(%x)
  %2: f32[3] = add(%0, %1)
  return %2
}""")
    pat = op("add", op("neg", any_value("a")), op("exp", any_value("b")), commutative=True)
    m = match(pat, _root(g, "2"), g)
    assert m is not None and m["a"] is m["b"]


def test_type_predicates():
    g = _graph("""
graph @main(%x: f32[2, 3], %i: i32[4]) {
  %0: f32[2, 3] = neg(%x)
  %1: i32[4] = neg(%i)
  return %0, %1
}""")
    x0, x1 = _root(g, "0"), _root(g, "1")
    assert match(op("neg", any_value(dtype=FLOAT_DTYPES)), x0, g) is not None
    assert match(op("neg", any_value(dtype=FLOAT_DTYPES)), x1, g) is None
    assert match(op("neg", any_value(dtype=DType.int32)), x1, g) is not None
    assert match(op("neg", any_value(dtype=lambda d: d.is_integer)), x1, g) is not None
    assert match(op("neg", shape=(2, 3)), x0, g) is not None
    assert match(op("neg", shape=(3, 2)), x0, g) is None
    assert match(op("neg", rank=1), x1, g) is not None
    assert match(op("neg", rank=lambda r: r > 1), x1, g) is None
    assert match(op(("neg", "abs"), where=lambda v: v.name == "1"), x1, g) is not None


def test_attribute_predicates():
    g = _graph("""
graph @main(%x: f32[2, 3]) {
  %0: f32[3, 2] = permute(%x) {dims=[1, 0]}
  return %0
}""")
    v = _root(g, "0")
    assert match(op("permute", attrs={"dims": (1, 0)}), v, g) is not None
    assert match(op("permute", attrs={"dims": [1, 0]}), v, g) is not None
    assert match(op("permute", attrs={"dims": (0, 1)}), v, g) is None
    assert match(op("permute", attrs={"dims": lambda d: len(d) == 2}), v, g) is not None
    assert match(op("permute", attrs={"nope": 1}), v, g) is None


def test_constant_predicates_see_constants_and_full():
    g = _graph("""
graph @main(%x: f32[3]) {
  %ones: f32[3] = const [1.0, 1.0, 1.0]
  %mixed: f32[3] = const [1.0, 2.0, 1.0]
  %f: f32[3] = full() {shape=[3], value=1.0, dtype=f32}
  %0: f32[3] = mul(%x, %ones)
  %1: f32[3] = mul(%x, %mixed)
  %2: f32[3] = mul(%x, %f)
  %3: f32[3] = mul(%x, %x)
  return %0, %1, %2, %3
}""")
    ones = op("mul", any_value(), const("c", value=1))
    assert match(ones, _root(g, "0"), g) is not None
    assert match(ones, _root(g, "1"), g) is None
    m = match(ones, _root(g, "2"), g)
    assert m is not None and m.splat("c") == 1.0
    np.testing.assert_array_equal(m.const("c"), np.ones(3, np.float32))
    assert match(ones, _root(g, "3"), g) is None
    positive = op("mul", any_value(), const(data_where=lambda a: bool(np.all(a > 0))))
    assert match(positive, _root(g, "1"), g) is not None


def test_one_use_counts_graph_outputs_as_uses():
    g = _graph("""
graph @main(%x: f32[3]) {
  %0: f32[3] = neg(%x)
  %1: f32[3] = neg(%0)
  %2: f32[3] = neg(%x)
  %3: f32[3] = neg(%2)
  return %1, %2, %3
}""")
    pat = op("neg", op("neg", any_value(), one_use=True))
    assert match(pat, _root(g, "1"), g) is not None
    assert match(pat, _root(g, "3"), g) is None
    m = match(op("neg", any_value("x")), _root(g, "3"), g)
    assert [m.use_count(_root(g, n)) for n in ("x", "0", "1", "2")] == [2, 1, 1, 2]


def test_wildcard_root_is_rejected():
    with pytest.raises(ValueError, match="root pattern must be op"):
        rewrite(any_value("x"))(lambda m, b: None)
    with pytest.raises(ValueError, match="commutative=True needs exactly two"):
        op("add", any_value(), commutative=True)


# ------------------------------------------------------------------------------ rewriting
@rewrite(op("mul", any_value("x"), const(value=1), commutative=True))
def _mul_one(m, b):
    return m["x"] if m["x"].type == m.value.type else None


@rewrite(op("sub", any_value("a"), any_value("b"), dtype=FLOAT_DTYPES))
def _sub_to_add_neg(m, b):
    return b.op("add", m["a"], b.op("neg", m["b"]))


def test_apply_patterns_rewrites_to_fixpoint_and_keeps_input():
    g = _graph(MUL_GRAPH)
    before = str(g)
    result = apply_patterns(g, [_mul_one, _sub_to_add_neg])
    assert result.changed
    assert str(g) == before
    expected = _graph("""
graph @main(%x: f32[2, 3], %y: f32[2, 3]) {
  %1: f32[2, 3] = mul(%x, %y)
  %4: f32[2, 3] = neg(%1)
  %5: f32[2, 3] = add(%1, %4)
  %6: f32[2, 3] = neg(%x)
  %7: f32[2, 3] = add(%1, %6)
  return %5, %7
}""")
    assert canon(result.graph) == canon(expected)
    ir.verify(result.graph)
    again = apply_patterns(result.graph, [_mul_one, _sub_to_add_neg])
    assert not again.changed and again.graph is result.graph


def test_builder_nodes_are_discarded_when_the_rewrite_declines():
    @rewrite(op("neg", any_value("x")))
    def declines(m, b):
        b.op("exp", m["x"])
        b.const(np.arange(3, dtype=np.float32))
        return None

    g = _graph("graph @main(%x: f32[3]) {\n  %0: f32[3] = neg(%x)\n  return %0\n}")
    result = apply_patterns(g, [declines])
    assert not result.changed and str(result.graph) == str(g)


def test_replacement_of_another_type_names_the_rewrite():
    @rewrite(op("neg", any_value("x")), name="broken_neg")
    def broken(m, b):
        return b.op("cast", m["x"], dtype=DType.float64)

    g = _graph("graph @main(%x: f32[3]) {\n  %0: f32[3] = neg(%x)\n  return %0\n}")
    with pytest.raises(RewriteError, match=r"rewrite 'broken_neg' replaced neg result %0: f32\[3\] "
                                           r"with %\w+: f64\[3\]"):
        apply_patterns(g, [broken])


def test_max_rounds_bounds_a_rewrite_that_never_settles():
    @rewrite(op("neg", any_value("x")))
    def flip(m, b):  # neg(x) -> neg(neg(neg(x))): always fires again
        return b.op("neg", b.op("neg", b.op("neg", m["x"])))

    g = _graph("graph @main(%x: f32[3]) {\n  %0: f32[3] = neg(%x)\n  return %0\n}")
    result = apply_patterns(g, [flip], max_rounds=3)
    assert result.changed
    assert sum(n.op_name == "neg" for n in result.graph.nodes) > 1


def _declare_impure_op() -> str:
    name = "test_pattern_noise"
    if not ir.has_op(name):
        @defop(name, infer=lambda types: types[0], traits=("elementwise", "random"))
        def _noise(x):
            return x + np.random.default_rng(0).standard_normal(x.shape).astype(x.dtype)
    return name


def test_dead_matched_nodes_are_dropped_but_impure_ones_stay():
    noise = _declare_impure_op()
    g = Graph()
    x = g.add_input("x", TensorType((3,), F32))
    noisy = g.op(noise, x)
    inner = g.op("neg", noisy)
    g.set_outputs([g.op("neg", inner)])

    @rewrite(op("neg", op("neg", any_value("x"))))
    def double_neg(m, b):
        return m["x"]

    result = apply_patterns(g, [double_neg])
    kinds = [n.op_name for n in result.graph.nodes]
    assert kinds == [noise]
    assert result.graph.outputs[0].producer.op_name == noise


def test_multi_result_root_replacement_checks_count():
    g = _graph("graph @main(%x: f32[3]) {\n  %0: f32[3] = neg(%x)\n  return %0\n}")

    @rewrite(op("neg", any_value("x")), name="two_for_one")
    def two(m, b):
        return (m["x"], m["x"])

    with pytest.raises(RewriteError, match=r"'two_for_one' returned 2 value\(s\) for neg with 1"):
        apply_patterns(g, [two])


def test_pattern_pass_registers_and_runs_from_pipeline_text():
    pattern_pass("test-pattern-mul-one", [_mul_one], doc="x*1 -> x")
    g = _graph(MUL_GRAPH)
    result = PassManager("test-pattern-mul-one{max_rounds=2}").run(g)
    assert result.changed
    assert "mul(%one" not in str(result.graph)
    assert get_pass("test-pattern-mul-one").spec() == "test-pattern-mul-one"
    assert re.search(r"%3: f32\[2, 3\] = sub\(%1, %x\)", str(result.graph))
