"""Tests of constant folding (pass ``fold``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph
from kiln.passes import Pass, PassManager
from kiln.passes.fold import ConstantFolding

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
    assert folded.changed and [n.kind for n in folded.graph.nodes] == ["add"]
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
