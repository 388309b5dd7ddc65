"""Tests of canonicalization (pass ``canonicalize``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph
from kiln.passes import Pass, PassManager
from kiln.passes.canonicalize import Canonicalize

# ----------------------------------------------------------------- before/after checking
def canon(g: Graph) -> str:
    """The text of ``g`` with constant and node-result names renumbered in definition order,
    so graphs equal up to value names print the same."""
    names = [v.name for v in [*g.constants, *(o for n in g.nodes for o in n.outputs)]]
    mapping = {n: f"#{i}" for i, n in enumerate(names)}
    return re.sub(r"%([A-Za-z0-9_.]+)", lambda m: "%" + mapping.get(m.group(1), m.group(1)), str(g))


def random_arrays(values, rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for v in values:
        dt = v.dtype
        if dt.is_floating:
            out.append(rng.standard_normal(v.shape).astype(dt.numpy))
        elif dt == DType.bool:
            out.append(rng.random(v.shape) > 0.5)
        else:
            out.append(rng.integers(0 if dt == DType.uint8 else -5, 6, v.shape).astype(dt.numpy))
    return out


def assert_same_outputs(before: Graph, after: Graph, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    inputs, params = random_arrays(before.inputs, rng), random_arrays(before.params, rng)
    with np.errstate(all="ignore"):
        want = run_graph(before, inputs, params)
        got = run_graph(after, inputs, params)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-6, atol=1e-6)


def check(p: Pass, before: str, expected: str | None) -> Graph:
    """Run ``p`` on ``before``; compare with ``expected`` (None = unchanged), verify, compare
    outputs on random inputs, and check that a second run changes nothing."""
    g = ir.parse(before)
    result = p.run(g)
    want = ir.parse(expected) if expected is not None else g
    assert canon(result.graph) == canon(want)
    assert result.changed == (expected is not None)
    ir.verify(result.graph)
    assert_same_outputs(g, result.graph)
    assert not p.run(result.graph).changed
    return result.graph


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
