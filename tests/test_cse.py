"""Tests of common subexpression elimination (pass ``cse``)."""

from __future__ import annotations

import numpy as np
import pytest
from passcheck import check

import kiln.ir as ir
from kiln.ir import DType, Graph, TensorType, defop
from kiln.passes.cse import CommonSubexpressionElimination

CASES = {
    "same op and operands merge, uses redirected": ("""
graph @main(%x: f32[2, 3]) {
  %0: f32[2, 3] = exp(%x)
  %1: f32[2, 3] = exp(%x)
  %2: f32[2, 3] = add(%0, %1)
  return %2, %1
}""", """
graph @main(%x: f32[2, 3]) {
  %0: f32[2, 3] = exp(%x)
  %2: f32[2, 3] = add(%0, %0)
  return %2, %0
}"""),
    "commutative operands in either order": ("""
graph @main(%x: f32[3], %y: f32[3]) {
  %0: f32[3] = mul(%x, %y)
  %1: f32[3] = mul(%y, %x)
  %2: f32[3] = sub(%0, %1)
  return %2
}""", """
graph @main(%x: f32[3], %y: f32[3]) {
  %0: f32[3] = mul(%x, %y)
  %2: f32[3] = sub(%0, %0)
  return %2
}"""),
    "non-commutative order matters": ("""
graph @main(%x: f32[3], %y: f32[3]) {
  %0: f32[3] = sub(%x, %y)
  %1: f32[3] = sub(%y, %x)
  %2: f32[3] = add(%0, %1)
  return %2
}""", None),
    "different attributes do not merge": ("""
graph @main(%x: f32[2, 3]) {
  %0: f32[3] = sum(%x) {dims=[0]}
  %1: f32[2] = sum(%x) {dims=[1]}
  %2: f32[3] = sum(%x) {dims=[0]}
  return %0, %1, %2
}""", """
graph @main(%x: f32[2, 3]) {
  %0: f32[3] = sum(%x) {dims=[0]}
  %1: f32[2] = sum(%x) {dims=[1]}
  return %0, %1, %0
}"""),
    "equal constants deduplicated, chains merge transitively": ("""
graph @main(%x: f32[3]) {
  %a: f32[3] = const [1.0, 2.0, 3.0]
  %b: f32[3] = const [1.0, 2.0, 3.0]
  %c: f32[3] = const [1.0, 2.0, 4.0]
  %0: f32[3] = add(%x, %a)
  %1: f32[3] = add(%x, %b)
  %2: f32[3] = exp(%0)
  %3: f32[3] = exp(%1)
  %4: f32[3] = add(%x, %c)
  return %2, %3, %4
}""", """
graph @main(%x: f32[3]) {
  %a: f32[3] = const [1.0, 2.0, 3.0]
  %c: f32[3] = const [1.0, 2.0, 4.0]
  %0: f32[3] = add(%x, %a)
  %2: f32[3] = exp(%0)
  %4: f32[3] = add(%x, %c)
  return %2, %2, %4
}"""),
    "constants of different dtype or shape stay apart": ("""
graph @main(%x: f32[1]) {
  %a: f32[1] = const [1.0]
  %b: f32[] = const 1.0
  %c: f64[1] = const [1.0]
  %0: f32[1] = add(%x, %a)
  %1: f32[1] = add(%x, %b)
  %2: f64[1] = add(%x, %c)
  return %0, %1, %2
}""", None),
    "zero and negative zero are different constants": ("""
graph @main(%x: f32[2]) {
  %a: f32[] = const 0.0
  %b: f32[] = const -0.0
  %0: f32[2] = mul(%x, %a)
  %1: f32[2] = mul(%x, %b)
  return %0, %1
}""", None),
}


@pytest.mark.parametrize("before, expected", CASES.values(), ids=CASES.keys())
def test_cse_cases(before, expected):
    check(CommonSubexpressionElimination(), before, expected)


def test_impure_nodes_are_never_merged():
    name = "test_cse_noise"
    if not ir.has_op(name):
        @defop(name, infer=lambda types: types[0], traits=("elementwise", "random"))
        def _noise(x):
            return x + np.random.default_rng().standard_normal(x.shape).astype(x.dtype)
    g = Graph()
    x = g.add_input("x", TensorType((3,), DType.float32))
    g.set_outputs([g.op(name, x), g.op(name, x)])
    assert not CommonSubexpressionElimination().run(g).changed


def test_attribute_keys_tell_bool_from_int_and_zero_signs_apart():
    from kiln.passes.cse import freeze_attr

    assert freeze_attr(True) != freeze_attr(1)
    assert freeze_attr(0.0) != freeze_attr(-0.0)
    assert freeze_attr(float("nan")) == freeze_attr(float("nan"))
    assert freeze_attr([1, 2]) == freeze_attr((1, 2))
