"""Tests of canonicalization (pass ``canonicalize``)."""

from __future__ import annotations

import pytest
from passcheck import assert_same_outputs, check

import kiln.ir as ir
from kiln.passes import PassManager
from kiln.passes.canonicalize import Canonicalize


def _g(body: str, sig: str = "%x: f32[2, 3], %y: f32[2, 3]") -> str:
    return f"graph @main({sig}) {{\n{body}\n}}"


CASES = {
    "commutative operands: constants second, then definition order": (_g("""
  %c: f32[] = const 2.0
  %0: f32[2, 3] = mul(%c, %x)
  %1: f32[2, 3] = add(%y, %x)
  %2: f32[2, 3] = maximum(%1, %x)
  %3: bool[2, 3] = eq(%2, %0)
  %4: f32[2, 3] = sub(%y, %x)
  return %3, %4"""), _g("""
  %c: f32[] = const 2.0
  %0: f32[2, 3] = mul(%x, %c)
  %1: f32[2, 3] = add(%x, %y)
  %2: f32[2, 3] = maximum(%x, %1)
  %3: bool[2, 3] = eq(%0, %2)
  %4: f32[2, 3] = sub(%y, %x)
  return %3, %4""")),
    "negative axes become non-negative, axis sets sorted": (_g("""
  %0: f32[2] = sum(%x) {dims=[-1]}
  %1: f32[] = amax(%x) {dims=[-1, 0]}
  %2: f32[2, 3] = softmax(%x) {dim=-1}
  %3: f32[3, 2] = permute(%x) {dims=[-1, 0]}
  %4: f32[2, 3] = flip(%x) {dims=[-1, -2]}
  %5: f32[4, 3] = cat(%x, %y) {dim=-2}
  %6: i64[2] = argmax(%x) {dim=-1}
  return %0, %1, %2, %3, %4, %5, %6"""), _g("""
  %0: f32[2] = sum(%x) {dims=[1]}
  %1: f32[] = amax(%x) {dims=[0, 1]}
  %2: f32[2, 3] = softmax(%x) {dim=1}
  %3: f32[3, 2] = permute(%x) {dims=[1, 0]}
  %4: f32[2, 3] = flip(%x) {dims=[0, 1]}
  %5: f32[4, 3] = cat(%x, %y) {dim=0}
  %6: i64[2] = argmax(%x) {dim=1}
  return %0, %1, %2, %3, %4, %5, %6""")),
    "slice bounds clamp, select index non-negative": (_g("""
  %0: f32[2, 2] = slice(%x) {dim=-1, start=-2, end=9223372036854775807}
  %1: f32[2, 0] = slice(%x) {dim=1, start=5, end=7}
  %2: f32[2] = select(%x) {dim=-1, index=-1}
  return %0, %1, %2"""), _g("""
  %0: f32[2, 2] = slice(%x) {dim=1, start=1, end=3}
  %1: f32[2, 0] = slice(%x) {dim=1, start=3, end=3}
  %2: f32[2] = select(%x) {dim=1, index=2}
  return %0, %1, %2""")),
    "reshape and expand spell out their shape; identity views vanish": (_g("""
  %0: f32[3, 2] = reshape(%x) {shape=[-1, 2]}
  %1: f32[2, 3] = reshape(%x) {shape=[2, -1]}
  %2: f32[4, 2, 3] = expand(%1) {shape=[4, -1, -1]}
  %3: f32[2, 3] = permute(%y) {dims=[0, 1]}
  %4: f32[2, 3] = add(%3, %1)
  return %0, %2, %4"""), _g("""
  %0: f32[3, 2] = reshape(%x) {shape=[3, 2]}
  %2: f32[4, 2, 3] = expand(%x) {shape=[4, 2, 3]}
  %4: f32[2, 3] = add(%x, %y)
  return %0, %2, %4""")),
    "sub of a float constant becomes add of its negation": (_g("""
  %c: f32[3] = const [1.0, -2.0, 0.0]
  %i: i32[] = const 1
  %0: f32[2, 3] = sub(%x, %c)
  %1: i32[4] = sub(%k, %i)
  return %0, %1""", "%x: f32[2, 3], %k: i32[4]"), _g("""
  %i: i32[] = const 1
  %n: f32[3] = const [-1.0, 2.0, -0.0]
  %0: f32[2, 3] = add(%x, %n)
  %1: i32[4] = sub(%k, %i)
  return %0, %1""", "%x: f32[2, 3], %k: i32[4]")),
    "already canonical": (_g("""
  %c: f32[] = const 2.0
  %0: f32[2, 3] = mul(%x, %c)
  %1: f32[2] = sum(%0) {dims=[1]}
  return %1"""), None),
}


@pytest.mark.parametrize("before, expected", CASES.values(), ids=CASES.keys())
def test_canonicalize_cases(before, expected):
    check(Canonicalize(), before, expected)


def test_canonical_forms_let_cse_merge_spelling_variants():
    g = ir.parse(_g("""
  %c: f32[] = const 0.5
  %0: f32[2, 3] = sub(%x, %c)
  %n: f32[] = const -0.5
  %1: f32[2, 3] = add(%n, %x)
  %2: f32[2] = sum(%0) {dims=[-1]}
  %3: f32[2] = sum(%1) {dims=[1]}
  %4: f32[2] = mul(%2, %3)
  return %4"""))
    result = PassManager("canonicalize,cse,dce").run(g)
    assert result.graph.op_histogram() == {"add": 1, "mul": 1, "sum": 1}
    assert_same_outputs(g, result.graph)
