"""Tests of dead code elimination (pass ``dce``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph, TensorType, defop
from kiln.passes import Pass
from kiln.passes.dce import DeadCodeElimination

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
    assert [n.kind for n in result.graph.nodes] == [noise, "exp"]
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
