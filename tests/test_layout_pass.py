"""Tests of view sinking (pass ``sink-views``)."""

from __future__ import annotations

import pytest
from passcheck import assert_same_outputs, check

import kiln.ir as ir
from kiln.passes.sink_views import SinkViews


def _g(body: str, sig: str = "%a: f32[2, 3, 4], %b: f32[2, 3, 4]") -> str:
    return f"graph @main({sig}) {{\n{body}\n}}"


CASES = {
    "equal permutes meet after a binary op": (_g("""
  %0: f32[4, 2, 3] = permute(%a) {dims=[2, 0, 1]}
  %1: f32[4, 2, 3] = permute(%b) {dims=[2, 0, 1]}
  %2: f32[4, 2, 3] = add(%0, %1)
  return %2"""), _g("""
  %3: f32[2, 3, 4] = add(%a, %b)
  %2: f32[4, 2, 3] = permute(%3) {dims=[2, 0, 1]}
  return %2""")),
    "a permute sinks through unary ops and cancels its inverse": (_g("""
  %0: f32[4, 2, 3] = permute(%a) {dims=[2, 0, 1]}
  %1: f32[4, 2, 3] = exp(%0)
  %2: f32[4, 2, 3] = gelu(%1) {approximate="tanh"}
  %3: f32[2, 3, 4] = permute(%2) {dims=[1, 2, 0]}
  return %3"""), _g("""
  %1: f32[2, 3, 4] = exp(%a)
  %2: f32[2, 3, 4] = gelu(%1) {approximate="tanh"}
  return %2""")),
    "rank-0 operands ride along": (_g("""
  %s: f32[] = const 3.0
  %0: f32[4, 2, 3] = permute(%a) {dims=[2, 0, 1]}
  %1: f32[4, 2, 3] = mul(%s, %0)
  %2: bool[4, 2, 3] = gt(%1, %t)
  return %2""", "%a: f32[2, 3, 4], %t: f32[]"), _g("""
  %s: f32[] = const 3.0
  %1: f32[2, 3, 4] = mul(%s, %a)
  %3: bool[2, 3, 4] = gt(%1, %t)
  %2: bool[4, 2, 3] = permute(%3) {dims=[2, 0, 1]}
  return %2""", "%a: f32[2, 3, 4], %t: f32[]")),
    "different permutes, shared permutes and non-scalar partners stay": (_g("""
  %0: f32[4, 2, 3] = permute(%a) {dims=[2, 0, 1]}
  %1: f32[4, 2, 3] = permute(%d) {dims=[0, 2, 1]}
  %2: f32[4, 2, 3] = add(%0, %1)
  %3: f32[4, 2, 3] = exp(%0)
  %4: f32[4, 2, 3] = add(%0, %c)
  return %2, %3, %4""", "%a: f32[2, 3, 4], %d: f32[4, 3, 2], %c: f32[4, 2, 3]"), None),
    "a transposed matmul operand stays": (_g("""
  %0: f32[4, 3] = permute(%w) {dims=[1, 0]}
  %1: f32[2, 3] = matmul(%x, %0)
  %2: f32[2, 3] = relu(%1)
  return %2""", "%x: f32[2, 4], %w: f32[3, 4]"), None),
    "expand folds into a broadcasting consumer": (_g("""
  %0: f32[2, 3] = expand(%r) {shape=[2, 3]}
  %1: f32[2, 3] = add(%0, %y)
  %2: f32[2, 3] = where(%m, %0, %y)
  return %1, %2""", "%r: f32[3], %y: f32[2, 3], %m: bool[2, 3]"), _g("""
  %1: f32[2, 3] = add(%r, %y)
  %2: f32[2, 3] = where(%m, %r, %y)
  return %1, %2""", "%r: f32[3], %y: f32[2, 3], %m: bool[2, 3]")),
    "unary ops run before an expand, on fewer elements": (_g("""
  %0: f32[5, 3] = expand(%r) {shape=[5, 3]}
  %1: f32[5, 3] = tanh(%0)
  return %1""", "%r: f32[1, 3]"), _g("""
  %2: f32[1, 3] = tanh(%r)
  %1: f32[5, 3] = expand(%2) {shape=[5, 3]}
  return %1""", "%r: f32[1, 3]")),
    "equal reshapes of equal shapes meet": (_g("""
  %0: f32[6, 4] = reshape(%a) {shape=[6, 4]}
  %1: f32[6, 4] = reshape(%b) {shape=[6, 4]}
  %2: f32[6, 4] = mul(%0, %1)
  return %2"""), _g("""
  %3: f32[2, 3, 4] = mul(%a, %b)
  %2: f32[6, 4] = reshape(%3) {shape=[6, 4]}
  return %2""")),
    "the transpose of a product moves onto its operands and cancels a transposed weight": (_g("""
  %0: f32[3, 2] = permute(%w) {dims=[1, 0]}
  %1: f32[4, 2] = matmul(%x, %0)
  %2: f32[2, 4] = permute(%1) {dims=[1, 0]}
  return %2""", "%x: f32[4, 3], %w: f32[2, 3]"), _g("""
  %3: f32[3, 4] = permute(%x) {dims=[1, 0]}
  %4: f32[2, 4] = matmul(%w, %3)
  return %4""", "%x: f32[4, 3], %w: f32[2, 3]")),
    "a product used elsewhere too keeps its transpose": (_g("""
  %1: f32[4, 2] = matmul(%x, %y)
  %2: f32[2, 4] = permute(%1) {dims=[1, 0]}
  return %1, %2""", "%x: f32[4, 3], %y: f32[3, 2]"), None),
    "reshapes of different source shapes stay": (_g("""
  %0: f32[6, 4] = reshape(%a) {shape=[6, 4]}
  %1: f32[6, 4] = reshape(%c) {shape=[6, 4]}
  %2: f32[6, 4] = mul(%0, %1)
  return %2""", "%a: f32[2, 3, 4], %c: f32[6, 2, 2]"), None),
}


@pytest.mark.parametrize("before, expected", CASES.values(), ids=CASES.keys())
def test_sink_views_cases(before, expected):
    check(SinkViews(), before, expected)


def test_view_count_never_grows_on_a_chain():
    g = ir.parse(_g("""
  %0: f32[4, 2, 3] = permute(%a) {dims=[2, 0, 1]}
  %1: f32[4, 2, 3] = permute(%b) {dims=[2, 0, 1]}
  %2: f32[4, 2, 3] = sub(%0, %1)
  %3: f32[4, 2, 3] = exp(%2)
  %4: f32[4, 2, 3] = mul(%3, %0)
  return %4"""))
    views = lambda graph: sum(n.op.has("view") for n in graph.nodes)  # noqa: E731
    result = SinkViews().run(g)
    assert views(result.graph) <= views(g)
    assert_same_outputs(g, result.graph)
