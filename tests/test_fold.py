"""Tests of constant folding (pass ``fold``)."""

from __future__ import annotations

import numpy as np
import pytest
from passcheck import assert_same_outputs, check

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph
from kiln.passes import PassManager
from kiln.passes.fold import ConstantFolding

CASES = {
    "arithmetic on constants folds, chains included": ("""
graph @main(%x: f32[3]) {
  %a: f32[3] = const [1.0, 2.0, 3.0]
  %b: f32[] = const 2.0
  %0: f32[3] = mul(%a, %b)
  %1: f32[3] = exp(%0)
  %2: f32[3] = add(%x, %1)
  return %2
}""", """
graph @main(%x: f32[3]) {
  %c: f32[3] = const [7.3890557, 54.59815, 403.42877]
  %2: f32[3] = add(%x, %c)
  return %2
}"""),
    "creation ops count as constants": ("""
graph @main(%x: i64[4]) {
  %0: i64[4] = arange() {end=4, dtype=i64}
  %1: i64[4] = full() {shape=[4], value=3, dtype=i64}
  %2: i64[4] = mul(%0, %1)
  %3: i64[4] = add(%x, %2)
  return %3
}""", """
graph @main(%x: i64[4]) {
  %c: i64[4] = const [0, 3, 6, 9]
  %3: i64[4] = add(%x, %c)
  return %3
}"""),
    "views, reductions and casts of constants fold": ("""
graph @main(%x: f16[2]) {
  %a: f32[2, 2] = const [1.0, 2.0, 3.0, 4.0]
  %0: f32[2, 2] = permute(%a) {dims=[1, 0]}
  %1: f32[2] = sum(%0) {dims=[1]}
  %2: f16[2] = cast(%1) {dtype=f16}
  %3: f16[2] = add(%x, %2)
  return %3
}""", """
graph @main(%x: f16[2]) {
  %c: f16[2] = const [4.0, 6.0]
  %3: f16[2] = add(%x, %c)
  return %3
}"""),
    "params and inputs are never folded": ("""
graph @main(%x: f32[2]) params(%w: f32[2]) {
  %a: f32[] = const 2.0
  %0: f32[2] = mul(%w, %a)
  %1: f32[2] = add(%x, %0)
  return %1
}""", None),
    "constant output becomes a constant": ("""
graph @main(%x: f32[2]) {
  %a: i32[2] = const [1, 2]
  %0: i32[2] = neg(%a)
  return %0
}""", """
graph @main(%x: f32[2]) {
  %c: i32[2] = const [-1, -2]
  return %c
}"""),
}


@pytest.mark.parametrize("before, expected", CASES.values(), ids=CASES.keys())
def test_fold_cases(before, expected):
    check(ConstantFolding(), before, expected)


BIG = """
graph @main(%x: f32[300, 300]) {
  %0: f32[300, 300] = full() {shape=[300, 300], value=0.5, dtype=f32}
  %1: f32[300, 300] = exp(%0)
  %2: f32[300, 300] = add(%x, %1)
  return %2
}"""


def test_results_over_max_elements_stay_nodes():
    check(ConstantFolding(), BIG, None)
    folded = ConstantFolding(max_elements=300 * 300).run(ir.parse(BIG))
    assert folded.changed and [n.op_name for n in folded.graph.nodes] == ["add"]
    assert_same_outputs(ir.parse(BIG), folded.graph)


def test_max_elements_option_from_pipeline_text():
    (p,) = PassManager("fold{max_elements=2}").passes
    assert p == ConstantFolding(max_elements=2)
    text = """
graph @main(%x: f32[3]) {
  %a: f32[3] = const [1.0, 2.0, 3.0]
  %0: f32[3] = neg(%a)
  %1: f32[3] = add(%x, %0)
  return %1
}"""
    assert not p.run(ir.parse(text)).changed
    assert ConstantFolding().run(ir.parse(text)).changed


def test_folded_values_have_the_reference_dtype_and_bits():
    g = ir.parse("""
graph @main(%x: bf16[3]) {
  %a: bf16[3] = const [1.0, 3.0, 0.1]
  %0: bf16[3] = sqrt(%a)
  %1: bf16[3] = mul(%x, %0)
  return %1
}""")
    result = ConstantFolding().run(g)
    (const,) = result.graph.constants
    assert const.dtype == DType.bfloat16
    want = run_graph(ir.parse("""
graph @main() {
  %a: bf16[3] = const [1.0, 3.0, 0.1]
  %0: bf16[3] = sqrt(%a)
  return %0
}"""), [], [])[0]
    assert const.data.tobytes() == want.tobytes()


def test_failing_reference_is_left_to_the_runtime():
    g = Graph()
    a = g.add_constant(np.array([1, 2], dtype=np.int64))
    idx = g.add_constant(np.array([5], dtype=np.int64))
    g.set_outputs([g.op("index_select", a, idx, dim=0)])
    assert not ConstantFolding().run(g).changed
