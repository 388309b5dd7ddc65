"""Tests of algebraic simplification (pass ``simplify``)."""

from __future__ import annotations

import numpy as np
import pytest
from passcheck import check

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType
from kiln.passes.simplify import Simplify, represents_exactly


def _g(body: str, sig: str = "%x: f32[2, 3]") -> str:
    return f"graph @main({sig}) {{\n{body}\n}}"


CASES = {
    "x*1 and 1*x": (_g("""
  %one: f32[] = const 1.0
  %0: f32[2, 3] = mul(%x, %one)
  %1: f32[2, 3] = mul(%one, %0)
  return %1"""), _g("  return %x")),
    "x*ones that broadcasts x to a larger shape stays": (_g("""
  %ones: f32[2, 2, 3] = const [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  %0: f32[2, 2, 3] = mul(%x, %ones)
  return %0"""), None),
    "x+0, 0+x, x-0": (_g("""
  %z: f32[3] = const [0.0, 0.0, -0.0]
  %0: f32[2, 3] = add(%z, %x)
  %1: f32[2, 3] = add(%0, %z)
  %2: f32[2, 3] = sub(%1, %z)
  return %2"""), _g("  return %x")),
    "0-x and x-1 stay": (_g("""
  %z: f32[] = const 0.0
  %one: f32[] = const 1.0
  %0: f32[2, 3] = sub(%z, %x)
  %1: f32[2, 3] = sub(%0, %one)
  return %1"""), None),
    "i32 + f32 zero changes the dtype and stays": (_g("""
  %z: f32[] = const 0.0
  %0: f32[3] = add(%x, %z)
  return %0""", "%x: i32[3]"), None),
    "x/1 only without rounding mode on floats": (_g("""
  %one: f32[] = const 1.0
  %0: f32[2, 3] = div(%x, %one)
  %1: f32[2, 3] = div(%0, %one) {rounding_mode="floor"}
  return %1"""), _g("""
  %one: f32[] = const 1.0
  %1: f32[2, 3] = div(%x, %one) {rounding_mode="floor"}
  return %1""")),
    "x*0 for integers becomes zeros, for floats stays": (_g("""
  %z: i32[] = const 0
  %zf: f32[] = const 0.0
  %0: i32[3] = mul(%z, %i)
  %1: f32[3] = mul(%f, %zf)
  return %0, %1""", "%i: i32[3], %f: f32[3]"), _g("""
  %zf: f32[] = const 0.0
  %0: i32[3] = full() {shape=[3], value=0, dtype=i32}
  %1: f32[3] = mul(%f, %zf)
  return %0, %1""", "%i: i32[3], %f: f32[3]")),
    "neg(neg(x))": (_g("""
  %0: f32[2, 3] = neg(%x)
  %1: f32[2, 3] = neg(%0)
  %2: f32[2, 3] = exp(%1)
  return %2, %0"""), _g("""
  %0: f32[2, 3] = neg(%x)
  %2: f32[2, 3] = exp(%x)
  return %2, %0""")),
    "log(exp(x))": (_g("""
  %0: f32[2, 3] = exp(%x)
  %1: f32[2, 3] = log(%0)
  return %1"""), _g("  return %x")),
    "exp(log(x)) only for provably non-negative x": (_g("""
  %0: f32[2, 3] = log(%x)
  %1: f32[2, 3] = exp(%0)
  %2: f32[2, 3] = abs(%x)
  %3: f32[2, 3] = log(%2)
  %4: f32[2, 3] = exp(%3)
  %5: f32[2, 3] = add(%1, %4)
  return %5"""), _g("""
  %0: f32[2, 3] = log(%x)
  %1: f32[2, 3] = exp(%0)
  %2: f32[2, 3] = abs(%x)
  %5: f32[2, 3] = add(%1, %2)
  return %5""")),
    "division by a power of two becomes an exact multiplication": (_g("""
  %c: f32[] = const -8.0
  %0: f32[2, 3] = div(%x, %c)
  return %0"""), _g("""
  %c: f32[] = const -0.125
  %0: f32[2, 3] = mul(%x, %c)
  return %0""")),
    "division by other constants stays": (_g("""
  %three: f32[] = const 3.0
  %zero: f32[] = const 0.0
  %tiny: f32[] = const 1e-45
  %mixed: f32[3] = const [2.0, 4.0, 2.0]
  %0: f32[2, 3] = div(%x, %three)
  %1: f32[2, 3] = div(%0, %zero)
  %2: f32[2, 3] = div(%1, %tiny)
  %3: f32[2, 3] = div(%2, %mixed)
  return %3"""), None),
    "permute of permute composes, inverse pairs vanish": (_g("""
  %0: f32[3, 4, 2] = permute(%y) {dims=[1, 2, 0]}
  %1: f32[4, 2, 3] = permute(%0) {dims=[1, 2, 0]}
  %2: f32[3, 4, 2] = permute(%1) {dims=[2, 0, 1]}
  %3: f32[2, 3, 4] = permute(%2) {dims=[-1, 0, 1]}
  return %1, %3""", "%y: f32[2, 3, 4]"), _g("""
  %1: f32[4, 2, 3] = permute(%y) {dims=[2, 0, 1]}
  return %1, %y""", "%y: f32[2, 3, 4]")),
    "reshape chains collapse; reshape to the same shape vanishes": (_g("""
  %0: f32[6] = reshape(%x) {shape=[-1]}
  %1: f32[3, 2] = reshape(%0) {shape=[3, 2]}
  %2: f32[2, 3] = reshape(%1) {shape=[2, -1]}
  %3: f32[1, 6] = reshape(%1) {shape=[1, 6]}
  return %2, %3"""), _g("""
  %3: f32[1, 6] = reshape(%x) {shape=[1, 6]}
  return %x, %3""")),
    "expand and slice that keep the shape vanish": (_g("""
  %0: f32[2, 3] = expand(%x) {shape=[2, -1]}
  %1: f32[2, 3] = slice(%0) {dim=1, start=0, end=9223372036854775807}
  %2: f32[2, 2] = slice(%1) {dim=1, start=1, end=3}
  %3: f32[4, 2, 3] = expand(%1) {shape=[4, 2, 3]}
  return %2, %3"""), _g("""
  %2: f32[2, 2] = slice(%x) {dim=1, start=1, end=3}
  %3: f32[4, 2, 3] = expand(%x) {shape=[4, 2, 3]}
  return %2, %3""")),
    "cast to the same dtype and lossless round trips vanish": (_g("""
  %0: f32[2, 3] = cast(%x) {dtype=f32}
  %1: f64[2, 3] = cast(%0) {dtype=f64}
  %2: f32[2, 3] = cast(%1) {dtype=f32}
  return %2"""), _g("  return %x")),
    "lossy round trips stay": (_g("""
  %0: f16[2, 3] = cast(%x) {dtype=f16}
  %1: f32[2, 3] = cast(%0) {dtype=f32}
  %2: i32[2, 3] = cast(%x) {dtype=i32}
  %3: f32[2, 3] = cast(%2) {dtype=f32}
  return %1, %3"""), None),
    "widening then another cast goes direct": (_g("""
  %0: i64[3] = cast(%i) {dtype=i64}
  %1: f32[3] = cast(%0) {dtype=f32}
  return %1""", "%i: i32[3]"), _g("""
  %1: f32[3] = cast(%i) {dtype=f32}
  return %1""", "%i: i32[3]")),
}


@pytest.mark.parametrize("before, expected", CASES.values(), ids=CASES.keys())
def test_simplify_cases(before, expected):
    check(Simplify(), before, expected)


@pytest.mark.parametrize("src, dst, exact", [
    (DType.float32, DType.float64, True), (DType.float16, DType.float32, True),
    (DType.bfloat16, DType.float32, True), (DType.float32, DType.float16, False),
    (DType.float16, DType.bfloat16, False), (DType.bfloat16, DType.float16, False),
    (DType.int8, DType.float16, True), (DType.uint8, DType.bfloat16, True),
    (DType.int32, DType.float32, False), (DType.int32, DType.float64, True),
    (DType.int64, DType.float64, False), (DType.uint8, DType.int8, False),
    (DType.int8, DType.int32, True), (DType.bool, DType.uint8, True),
    (DType.int32, DType.bool, False), (DType.float32, DType.int64, False),
])
def test_represents_exactly_matches_numpy_round_trips(src, dst, exact):
    assert represents_exactly(src, dst) == exact
    if src == DType.bool:
        values = np.array([False, True])
    elif src.is_integer:
        info = np.iinfo(src.numpy)
        values = np.array([info.min, info.max, info.max - 1], src.numpy)
    else:
        with np.errstate(all="ignore"):
            values = np.array([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -20, 3e38, 6e-8]).astype(src.numpy)
    with np.errstate(all="ignore"):
        converted = values.astype(dst.numpy)

    def exact_number(x):  # python int/float compare exactly with each other
        return float(x) if isinstance(x, (float, np.floating)) or type(x).__name__ == "bfloat16" else int(x)

    kept = [exact_number(a) == exact_number(b) for a, b in zip(values.tolist(), converted.tolist())]
    assert all(kept) == exact


def test_division_rewrite_is_bit_exact_on_extreme_values():
    g = ir.parse(_g("""
  %c: f32[] = const 4.0
  %0: f32[4] = div(%x, %c)
  return %0""", "%x: f32[4]"))
    after = Simplify().run(g).graph
    x = np.array([3.4e38, 1.4e-45, -7.1e-39, 1.0 / 3.0], np.float32)
    (want,) = run_graph(g, [x], [])
    (got,) = run_graph(after, [x], [])
    assert want.tobytes() == got.tobytes()


_CAUSAL_3x3 = "true, false, false, true, true, false, true, true, true"


@pytest.mark.parametrize("mask, causal", [
    (f"bool[3, 3] = const [{_CAUSAL_3x3}]", True),
    (f"bool[2, 1, 3, 3] = const [{_CAUSAL_3x3}, {_CAUSAL_3x3}]", True),
    ("f32[3, 3] = const [0.0, -inf, -inf, 0.0, 0.0, -inf, 0.0, 0.0, 0.0]", True),
    # one more masked score, a large negative instead of -inf, or another slice: not causal
    ("bool[3, 3] = const [true, false, false, true, false, false, true, true, true]", False),
    ("f32[3, 3] = const [0.0, -1e9, -1e9, 0.0, 0.0, -1e9, 0.0, 0.0, 0.0]", False),
    (f"bool[2, 1, 3, 3] = const [{_CAUSAL_3x3}, true, true, true, true, true, true, true, true, true]", False),
    ("bool[1, 3] = const [true, false, false]", False),
])
def test_a_constant_causal_mask_becomes_the_causal_flag(mask, causal):
    """An attention whose constant mask is ``tril(ones(L, S))`` in every slice runs with
    ``is_causal`` and no mask, and gives the same result; any other mask stays."""
    g = ir.parse(_g(f"""
  %m: {mask}
  %0: f32[2, 2, 3, 4] = scaled_dot_product_attention(%q, %q, %q, %m) {{scale=0.5}}
  return %0""", "%q: f32[2, 2, 3, 4]"))
    after = Simplify().run(g).graph
    (node,) = [n for n in after.nodes if n.op_name == "scaled_dot_product_attention"]
    assert (len(node.inputs) == 3 and node.attrs["is_causal"]) == causal
    q = np.random.default_rng(0).standard_normal((2, 2, 3, 4)).astype(np.float32)
    (want,) = run_graph(g, [q], [])
    (got,) = run_graph(after, [q], [])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
