"""Loop IR: construction, naming, verification, the text form, and the numpy interpreter."""

from __future__ import annotations

import numpy as np
import pytest

import kiln.loops as kl
from kiln.ir.errors import ParseError, VerificationError
from kiln.ir.loops import (
    Annotation, Binary, Buffer, Const, If, Load, Loop, Param, Program, Reduce, Store, Var, affine_expr,
    affine_form, parse_expr, substitute,
)
from kiln.ir.loops.interp import compile_python
from kiln.ir.types import DType

FULL = """program demo(N: i64, M: i64, alpha: f64, scale: f32) {
  buffer C: f64[N, M]
  buffer A: f64[N, M + 1]
  buffer t: f32[N] local
  buffer s: f64[]
  buffer h: i32[8] shared
  for i in [0, N) @parallel {
    for j in [max(0, i - 1), min(M, i + 3)) step 2 @unrolled(4) {
      S0: C[i, j] = C[i, j] * alpha
      j_1: for j2 in [0, M) @mapped("threadIdx.x") {
        S1: C[i, j2] += alpha * A[i, j2 + 1]
        S2: t[i] max= -3:i32 + f32(2.5:f32) * -(scale - -2) / 2.0
        if (i >= 1 && !(j < 2) || i == 3) {
          S3: s[] = select(i < 2, exp(-1.5), -inf) - -0.0
        } else {
          S4: s[] *= 2.0
        }
        S5: h[floormod(i, 8)] = i32(floordiv(i - 9, 4)) % 3:i32 + i / 2
        S6: t[i] min= f32(sqrt(pow(A[i, 0], 2.0)) + abs(-4))
      }
    }
    for v in [0, 4) @vectorized {
      S7: C[i, v] = f64(i != v) + f64(true)
    }
  }
}"""


def test_text_round_trips_exactly():
    prog = kl.parse(FULL)
    assert str(prog) == FULL
    assert str(kl.parse(str(prog))) == FULL


@pytest.mark.parametrize("text", ["-3", "- 3", "-(3)", "a - -3", "-(a * b)", "a - (b - c)", "(a < b) == (c < d)",
                                  "-(-x)", "2 * -x", "1.5e-07:f32 + inf", "!(a && b) || c", "a / b % c",
                                  "floordiv(-a, 4) * 3"])
def test_expressions_print_parse_print(text):
    once = str(parse_expr(text))
    assert str(parse_expr(once)) == once
    assert parse_expr(once) == parse_expr(str(parse_expr(once)))


def test_negative_literal_is_a_constant():
    assert parse_expr("-3") == Const(-3)
    assert parse_expr("-2.5:f32") == Const(-2.5, DType.float32)
    assert parse_expr("-(3)") != Const(-3)


def test_names_labels_and_uniquification():
    body = (
        Loop("i", 0, "N", (Store("A", ("i",), 1.0),)),
        Loop("i", 0, "N", (Store("A", ("i",), 2.0, name="S0"), Store("A", ("i",), 3.0))),
        Loop("i_1", 0, "N", (Store("A", ("i_1",), 4.0),)),
    )
    prog = Program("names", (Param("N"),), (Buffer("A", ("N",)),), body)
    # Unlabeled loops take their iterator's name, made unique in pre-order.
    assert [lp.name for lp in prog.loops()] == ["i", "i_1", "i_1_1"]
    assert [s.name for s in prog.statements()] == ["S1", "S0", "S2", "S3"]
    text = str(prog)
    assert "i_1: for i in [0, N)" in text and "i_1_1: for i_1 in [0, N)" in text
    assert str(kl.parse(text)) == text


def test_programs_can_be_built_in_python_and_run():
    i, k = Var("i"), Var("k")
    prog = Program("matvec", (Param("N"), Param("K")),
                   (Buffer("A", ("N", "K")), Buffer("x", ("K",)), Buffer("y", ("N",))),
                   (Loop("i", 0, "N", (
                       Store("y", (i,), 0.0),
                       Loop("k", 0, "K", (Reduce("y", (i,), "+", Load("A", (i, k)) * Load("x", (k,))),)),
                   )),))
    rng = np.random.default_rng(0)
    a, x, y = rng.random((3, 4)), rng.random(4), np.zeros(3)
    kl.run(prog, {"N": 3, "K": 4}, {"A": a, "x": x, "y": y})
    np.testing.assert_allclose(y, a @ x, rtol=1e-12)


@pytest.mark.parametrize("text,message", [
    ("program p(N: i64) {\n  for i in [0, N) {\n    S0: A[i] = 1.0\n  }\n}", r"unknown buffer 'A'"),
    ("program p(N: i64) {\n  buffer A: f64[N]\n  S0: A[0, 1] = 1.0\n}", r"rank 1 .* 2 index"),
    ("program p(N: i64) {\n  buffer A: f64[N]\n  S0: A[k] = 1.0\n}", r"unknown variable 'k'"),
    ("program p(N: i64) {\n  buffer A: f64[N]\n  S0: A[0] = 1.0\n  S0: A[1] = 2.0\n}",
     r"two statements are named 'S0'"),
    ("program p(N: i64) {\n  buffer A: f64[N]\n  for N in [0, 3) {\n  }\n}", r"reuses the name 'N'"),
    ("program p(x: f64) {\n  buffer A: f64[x]\n}", r"shapes may use integer parameters only"),
    ("program p(N: i64) {\n  buffer A: f64[N]\n  for i in [0, 1.5) {\n  }\n}", r"not an integer expression"),
    ("program p(N: i64) {\n  buffer A: f64[N]\n  S0: A[1.0] = 1.0\n}", r"index 1.0 of 'A' is not an integer"),
])
def test_verification_errors_name_the_problem(text, message):
    with pytest.raises(VerificationError, match=message):
        kl.parse(text)


@pytest.mark.parametrize("text,line,col,message", [
    ("program p() {\n  for in [0, 1) {\n  }\n}", 2, 7, r"'in' is a keyword"),
    ("program p() {\n  buffer A: f64[2]\n  S0: A[0] = (1 +\n}", 4, 1, r"expected an expression"),
    ("program p() {\n  buffer A: q64[2]\n}", 2, 13, r"unknown dtype 'q64'"),
    ("program p() {\n  buffer A: f64[2]\n  S0: A[0] ^= 1\n}", 3, 12, r"unexpected character '\^'"),
    ("program p() {\n  buffer A: f64[2]\n  S0: A[0] -= 1\n}", 3, 12, r"expected '=', '\+=', '\*=', 'max=' or 'min='"),
    ("program p() {\n  for i in [0, 2) @fast {\n  }\n}", 2, 20, r"unknown loop annotation 'fast'"),
])
def test_parse_errors_carry_line_and_column(text, line, col, message):
    with pytest.raises(ParseError, match=message) as err:
        kl.parse(text)
    assert (err.value.line, err.value.col) == (line, col)


def test_affine_forms():
    form = affine_form(parse_expr("2 * (i - j) + 3 - j * 4 + N"))
    assert dict(form.coeffs) == {"i": 2, "j": -6, "N": 1} and form.const == 3
    assert affine_form(parse_expr("i * j")) is None
    assert affine_form(parse_expr("floordiv(i, 2)")) is None
    assert str(affine_expr({"j": 1, "i": -1}, 2)) == "j - i + 2"
    assert str(substitute(parse_expr("A[i, j + 1]"), {"i": parse_expr("t"), "j": parse_expr("t - i")})) == \
        "A[t, t - i + 1]"


SEMANTICS = """program sem(N: i64) {
  buffer ints: i64[6]
  buffer f: f64[4]
  buffer g: f32[2]
  buffer m: f64[2]
  S0: ints[0] = -7 / 2
  S1: ints[1] = -7 % 2
  S2: ints[2] = floordiv(-7, 2)
  S3: ints[3] = floormod(-7, 2)
  S4: ints[4] = i64(-2.7)
  S5: ints[5] = select(N > 0, 10, ints[N + 100])
  S6: f[0] = 7.0 % 2.5
  S7: f[1] = 1 / 4
  S8: f[2] = f64(1) / 4
  S9: f[3] = exp(0)
  S10: g[0] = 0.1:f32 + 0.2:f32
  S11: g[1] = 0.1 + 0.2
  for i in [0, N) {
    S12: m[0] max= f64(i)
    S13: m[1] min= f64(i) - 2.0
  }
}"""


def test_interpreter_follows_c_semantics():
    prog = kl.parse(SEMANTICS)
    arrays = {"ints": np.zeros(6, np.int64), "f": np.zeros(4), "g": np.zeros(2, np.float32), "m": np.zeros(2)}
    kl.run(prog, {"N": 3}, arrays)
    assert arrays["ints"].tolist() == [-3, -1, -4, 1, -2, 10]
    assert arrays["f"].tolist() == [2.0, 0.0, 0.25, 1.0]
    assert arrays["g"][0] == np.float32(0.1) + np.float32(0.2)
    assert arrays["g"][1] == np.float32(0.1 + 0.2)
    assert arrays["m"].tolist() == [2.0, -2.0]


def test_vectorized_loops_match_their_serial_meaning():
    text = """program vec(N: i64) {
  buffer A: f64[N]
  buffer B: f64[N]
  buffer R: f64[N]
  buffer s: f64[]
  buffer P: f64[N]
  for i in [0, N) {
    S0: A[i] = A[i] * 2.0 + R[N - 1 - i]
    S1: B[i] = A[i] + 1.0
    S2: s[] += A[i] * B[i]
  }
  for j in [1, N) {
    S3: P[j] = P[j - 1] + 1.0
  }
  for k in [0, N) {
    S4: B[k] = B[N - 1 - k] * 0.5
  }
}"""
    prog = kl.parse(text)
    src = compile_python(prog).__kiln_source__
    assert "v_i = np.arange" in src and "_accumulate" in src, src
    assert "for v_j in range" in src and "for v_k in range" in src, "loop-carried reuse must run serially"
    rng = np.random.default_rng(1)
    a, r, p = rng.random(6), rng.random(6), rng.random(6)
    arrays = {"A": a.copy(), "B": np.zeros(6), "R": r.copy(), "s": np.array(0.5), "P": p.copy()}
    kl.run(prog, {"N": 6}, arrays)
    want_a = a * 2 + r[::-1]
    want_b = want_a + 1
    acc = 0.5
    for x, y in zip(want_a, want_b):
        acc = acc + x * y
    for k in range(6):
        want_b[k] = want_b[5 - k] * 0.5
    np.testing.assert_array_equal(arrays["A"], want_a)
    np.testing.assert_array_equal(arrays["B"], want_b)
    assert arrays["s"] == acc
    np.testing.assert_array_equal(arrays["P"], p[0] + np.arange(6))


def test_run_checks_its_inputs():
    prog = kl.parse("program p(N: i64) {\n  buffer A: f64[N]\n  for i in [0, N) {\n    S0: A[i] = 1.0\n  }\n}")
    with pytest.raises(ValueError, match=r"missing parameter\(s\) \['N'\]"):
        kl.run(prog, {}, {"A": np.zeros(3)})
    with pytest.raises(ValueError, match=r"buffer 'A' needs a numpy array f64\[3\], got float64\[4\]"):
        kl.run(prog, {"N": 3}, {"A": np.zeros(4)})
    with pytest.raises(ValueError, match=r"no array for buffer 'A'"):
        kl.run(prog, {"N": 3}, {})


def test_local_buffers_are_allocated_and_returned():
    prog = kl.parse("program p(N: i64) {\n  buffer T: f64[N] local\n  buffer A: f64[N]\n  for i in [0, N) {\n"
                    "    S0: T[i] = f64(i) * 2.0\n    S1: A[i] = T[i] + 1.0\n  }\n}")
    a = np.zeros(4)
    locals_ = kl.run(prog, {"N": 4}, {"A": a})
    assert a.tolist() == [1.0, 3.0, 5.0, 7.0] and locals_["T"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_annotations_validate():
    with pytest.raises(ValueError, match="factor >= 1"):
        Annotation("unrolled", factor=0)
    with pytest.raises(ValueError, match="axis"):
        Annotation("mapped")
    assert Annotation("vectorized").is_parallel and not Annotation("unrolled", 2).is_parallel


def test_if_nodes_and_binary_helpers_build():
    node = If(Binary("<", Var("i"), Const(2)), (Store("A", (Var("i"),), 1.0),))
    prog = Program("p", (Param("N"),), (Buffer("A", ("N",)),), (Loop("i", 0, "N", (node,)),))
    a = np.zeros(4)
    kl.run(prog, {"N": 4}, {"A": a})
    assert a.tolist() == [1.0, 1.0, 0.0, 0.0]
