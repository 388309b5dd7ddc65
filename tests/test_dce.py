"""Tests of dead code elimination (pass ``dce``)."""

from __future__ import annotations

import numpy as np
import pytest
from passcheck import check

import kiln.ir as ir
from kiln.ir import DType, Graph, TensorType, defop
from kiln.passes.dce import DeadCodeElimination

CASES = {
    "unused chain removed, inputs and params stay": ("""
graph @main(%x: f32[2, 3], %y: f32[3]) params(%w: f32[3]) {
  %c: f32[] = const 2.0
  %0: f32[2, 3] = exp(%x)
  %1: f32[2, 3] = mul(%0, %c)
  %2: f32[2, 3] = add(%x, %w)
  return %2
}""", """
graph @main(%x: f32[2, 3], %y: f32[3]) params(%w: f32[3]) {
  %2: f32[2, 3] = add(%x, %w)
  return %2
}"""),
    "unused constant removed": ("""
graph @main(%x: f32[3]) {
  %a: f32[3] = const [1.0, 2.0, 3.0]
  %b: f32[] = const 5.0
  %0: f32[3] = add(%x, %a)
  return %0
}""", """
graph @main(%x: f32[3]) {
  %a: f32[3] = const [1.0, 2.0, 3.0]
  %0: f32[3] = add(%x, %a)
  return %0
}"""),
    "multi-result node kept when one result is used": ("""
graph @main(%x: f32[4]) {
  %0: f32[4] = neg(%x)
  %1: f32[4] = abs(%0)
  return %0
}""", """
graph @main(%x: f32[4]) {
  %0: f32[4] = neg(%x)
  return %0
}"""),
    "everything live": ("""
graph @main(%x: f32[4]) {
  %c: f32[] = const 1.5
  %0: f32[4] = mul(%x, %c)
  %1: f32[4] = exp(%0)
  return %1, %0
}""", None),
    "constant output kept": ("""
graph @main(%x: f32[2]) {
  %c: f32[2] = const [1.0, 2.0]
  %0: f32[2] = neg(%x)
  return %c
}""", """
graph @main(%x: f32[2]) {
  %c: f32[2] = const [1.0, 2.0]
  return %c
}"""),
}


@pytest.mark.parametrize("before, expected", CASES.values(), ids=CASES.keys())
def test_dce_cases(before, expected):
    check(DeadCodeElimination(), before, expected)


def _noise_op() -> str:
    name = "test_dce_noise"
    if not ir.has_op(name):
        @defop(name, infer=lambda types: types[0], traits=("elementwise", "random"))
        def _noise(x):
            return x + np.random.default_rng().standard_normal(x.shape).astype(x.dtype)
    return name


def test_impure_nodes_are_never_removed():
    noise = _noise_op()
    g = Graph()
    x = g.add_input("x", TensorType((3,), DType.float32))
    unused_noise = g.op(noise, x)
    g.op("neg", unused_noise)
    g.set_outputs([g.op("exp", x)])
    result = DeadCodeElimination().run(g)
    assert result.changed
    assert [n.op_name for n in result.graph.nodes] == [noise, "exp"]
    assert not DeadCodeElimination().run(result.graph).changed


def test_multi_result_nodes_live_while_any_result_is_used():
    name = "test_dce_split"
    if not ir.has_op(name):
        @defop(name, infer=lambda types: (types[0], types[0]))
        def _split(x):
            return x, -x
    g = Graph()
    x = g.add_input("x", TensorType((3,), DType.float32))
    node = g.add_node(name, [x])
    g.set_outputs([node.outputs[1]])
    assert not DeadCodeElimination().run(g).changed
    g.set_outputs([x])
    assert DeadCodeElimination().run(g).graph.nodes == []
