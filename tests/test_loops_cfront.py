"""``from_c`` (the C subset), ``to_c`` compiled with cc and run through ctypes."""

from __future__ import annotations

import numpy as np
import pytest

import kiln.loops as kl
from kiln.ir.errors import ParseError
from kiln.ir.loops.interp import buffer_shape
from kiln.backends.cpu.toolchain import c_compiler as compiler

needs_cc = pytest.mark.skipif(compiler() is None, reason="no C compiler")

BASE = "for (i = 0; i < N; i++)\n  for (j = 0; j < M; j++)\n    A[i][j] = B[i][j] + 1.0;\n"


@pytest.mark.parametrize("source", [
    "for (int i = 0; i < N; i++)\n  for (int j = 0; j < M; ++j)\n    A[i][j] = B[i][j] + 1.0;",
    "for (i = 0; i <= N - 1; i += 1) { for (j = 0; j <= M - 1; j = j + 1) { A[i][j] = B[i][j] + 1.0; } }",
    "/* comment */ #pragma scop\nfor (i = 0; i < N; i++) // rows\n  for (j = 0; j < M; j++) A[i][j] = (B[i][j]) + 1.0;",
])
def test_loop_spellings_read_the_same(source):
    src = source.replace("#pragma scop", "\n#pragma scop\n")
    assert str(kl.from_c(src)) == str(kl.from_c(BASE))


def test_declarations_labels_scalars_and_expressions():
    prog = kl.from_c("""
float h[N];
int cnt[4];
double s;
L1: for (i = 0; i < N; i += 2)
  for (j = max(0, i - 1); j < MIN(N, i + 3); j++) {
    S7: h[i] = (float)(h[i] * 2.0f) - sqrtf(fabs(x[j])) / pow(2.0, 3);
    s += i > j ? exp(-x[j]) : x[j] * alpha;
    cnt[i % 4] -= 1;
    x[j] /= 2;
  }
""", name="mix")
    text = str(prog)
    assert "buffer h: f32[N]" in text and "buffer cnt: i32[4]" in text and "buffer s: f64[]" in text
    assert "buffer x: f64[N]" in text  # inferred from x[j] with j < min(N, i + 3)
    assert "L1: for i in [0, N) step 2 {" in text
    assert "for j in [max(0, i - 1), min(N, i + 3)) {" in text
    assert "S7: h[i] = f32(h[i] * 2.0:f32) - sqrt(abs(x[j])) / pow(2.0, 3)" in text
    assert "S0: s[] += select(i > j, exp(-x[j]), x[j] * alpha)" in text
    assert "S1: cnt[i % 4] = cnt[i % 4] - 1" in text and "S2: x[j] = x[j] / 2" in text
    assert [p.name for p in prog.params] == ["N", "alpha"]
    assert prog.param("alpha").dtype.short == "f64" and prog.param("N").dtype.short == "i64"
    assert str(kl.parse(text)) == text


def test_function_definitions_give_parameters_and_local_buffers():
    prog = kl.from_c("""
static void kernel_blur(int n, float w, double A[n], double C[restrict n]) {
  double tmp[n];
  double acc = 0.0;
  for (int i = 0; i < n; i++) tmp[i] = A[i] * w;
  for (int i = 1; i < n - 1; i++) { acc += tmp[i]; C[i] = tmp[i - 1] + tmp[i + 1]; }
}""")
    assert prog.name == "kernel_blur"
    assert [(p.name, p.dtype.short) for p in prog.params] == [("n", "i64"), ("w", "f32")]
    scopes = {b.name: b.scope for b in prog.buffers}
    assert scopes == {"A": "global", "C": "global", "tmp": "local", "acc": "local"}
    assert "S0: acc[] = 0.0" in str(prog)


def test_inferred_extents_cover_every_access():
    prog = kl.from_c("for (i = 0; i < N; i++) for (j = 0; j <= i; j++) L[i + 1][j] = U[j][N - 1 - i] + L[i][j];")
    shapes = {b.name: [str(d) for d in b.shape] for b in prog.buffers}
    assert shapes == {"L": ["N + 1", "N"], "U": ["N", "N"]}


@pytest.mark.parametrize("source,line,col,message", [
    ("for (i = 0; i < N; i++)\n  while (1) A[i] = 0;", 2, 3, r"'while' is outside the supported C subset"),
    ("for (i = N; i > 0; i--)\n  A[i] = 0;", 1, 15, r"loop condition must be 'i < bound' or 'i <= bound'"),
    ("for (i = 0; i < N; i--)\n  A[i] = 0;", 1, 21, r"loop increment must be i\+\+"),
    ("for (i = 0; i < N; i += k)\n  A[i] = 0;", 1, 25, r"expected a positive integer step"),
    ("for (i = 0; i < N; i++)\n  A[i] = foo(i);", 2, 10, r"unknown function 'foo'"),
    ("for (i = 0; i < N; i++)\n  A[i] = i << 2;", 2, 12, r"operator '<<' is outside the supported C subset"),
    ("for (i = 0; i < N; i++)\n  A[i] = A[i][0];", 2, 10, r"'A' is used with 2 subscript\(s\) here but 1 at line 2"),
    ("double A[N];\nfor (i = 0; i < N; i++)\n  A[i][i] = 0;", 3, 3, r"array 'A' has rank 1 but is used with 2"),
    ("for (i = 0; i < N; i++)\n  i = 3;", 2, 3, r"cannot assign to loop iterator 'i'"),
    ("for (i = 0; i < N; i++)\n  A[i] = 0;\nB[0] = i;", 3, 8, r"'i' is a loop iterator and is used outside its loop"),
    ("for (i = 0; i < N; i++)\n  A[i * i] = 0;", 2, 3, r"A\[i \* i\] in S0, which is not affine.*declare it"),
    ("for (i = 0; i < N; i++)\n  A[i - 1] = 0;", 2, 3, r"'A' is accessed at a negative index"),
    ("void f(int n) { }\nvoid g(int n) { }", 2, 1, r"only one function definition is supported"),
    ("for (i = 0; i < N; i++) {\n  A[i] = 1;\n", 3, 1, r"expected a statement"),
])
def test_errors_outside_the_subset_have_line_and_column(source, line, col, message):
    with pytest.raises(ParseError, match=message) as err:
        kl.from_c(source)
    assert (err.value.line, err.value.col) == (line, col)


# ----------------------------------------------------------------------------- to_c
NATIVE_SOURCES = {
    "mixed": ("""
float h[N];
int cnt[4];
double s;
for (i = 0; i < N; i += 2)
  for (j = max(0, i - 1); j < MIN(N, i + 3); j++) {
    h[i] = (float)(h[i] * 2.0f) - sqrtf(fabs(x[j])) / pow(2.0, 3);
    s += i > j ? exp(-x[j]) : x[j] * alpha;
    cnt[i % 4] -= (i - 7) / 2 + (i - 7) % 3;
    x[j] /= 2;
    if (j > i || j == 0) y[j] = y[j] * tanh(x[j]); else y[j] += 1;
  }
""", {"N": 9, "alpha": 0.75}),
    "gemm": ("""
for (i = 0; i < NI; i++) {
  for (j = 0; j < NJ; j++) C[i][j] *= beta;
  for (k = 0; k < NK; k++)
    for (j = 0; j < NJ; j++) C[i][j] += alpha * A[i][k] * B[k][j];
}""", {"NI": 5, "NJ": 7, "NK": 3, "alpha": 1.5, "beta": -0.5}),
    "locals": ("""
void smooth(int n, double A[n], double C[n]) {
  double t[n][2];
  double m = -1e30;
  for (int i = 0; i < n; i++) { t[i][0] = A[i]; t[i][1] = A[i] * A[i]; }
  for (int i = 0; i < n; i++) { m = m > t[i][1] ? m : t[i][1]; C[i] = t[i][0] + m; }
}""", {"n": 6}),
}


def _arrays(program: kl.Program, params: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = {p.name: int(params[p.name]) for p in program.params if p.dtype.is_integer}
    out = {}
    for b in program.buffers:
        if b.scope != "global":
            continue
        shape = buffer_shape(program, b.name, sizes)
        data = np.asarray(rng.random(shape) * 4 - 1)
        out[b.name] = (np.round(data * 10) if b.dtype.is_integer else data).astype(b.dtype.numpy)
    return out


@needs_cc
@pytest.mark.parametrize("name", list(NATIVE_SOURCES))
def test_to_c_compiles_and_matches_the_interpreter(name):
    source, params = NATIVE_SOURCES[name]
    prog = kl.from_c(source, name=name)
    c_text = kl.to_c(prog)
    assert f"void {name}(" in c_text
    want = _arrays(prog, params, 3)
    got = {k: v.copy() for k, v in want.items()}
    kl.run(prog, params, want)
    kl.compile_c(prog)(params, got)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6 if got[k].dtype == np.float32 else 1e-12, err_msg=k)


@needs_cc
def test_to_c_prints_annotations_as_pragmas():
    prog = kl.parse("""program ann(N: i64) {
  buffer A: f64[N]
  for i in [0, N) @parallel {
    S0: A[i] = floordiv(i - 5, 2) + floormod(i - 5, 2)
  }
  for j in [0, N) @vectorized {
    S1: A[j] += 1.0
  }
  for k in [0, N) step 3 @unrolled(4) {
    S2: A[k] *= 2.0
  }
}""")
    text = kl.to_c(prog)
    assert "#pragma omp parallel for\n  for (long i = 0; i < N; i++)" in text
    assert "#pragma omp simd" in text and "#pragma GCC unroll 4" in text and "k += 3" in text
    a = np.zeros(8)
    b = a.copy()
    kl.run(prog, {"N": 8}, {"A": a})
    kl.compile_c(prog, openmp=True)({"N": 8}, {"A": b})
    np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- declared and inferred extents
TRMM = """for (i = 0; i < M; i++)
  for (j = 0; j < N; j++) {
    for (k = i + 1; k < M; k++)
      B[i][j] += A[k][i] * B[k][j];
    B[i][j] = alpha * B[i][j];
  }"""


def _shapes(prog: kl.Program) -> dict[str, list[str]]:
    return {b.name: [str(d) for d in b.shape] for b in prog.buffers}


def test_declared_extents_are_kept_and_undeclared_ones_are_the_bounding_box():
    # A[k][i] with k from i + 1: the accesses cover A[1..M-1][0..M-2] only
    assert _shapes(kl.from_c(TRMM)) == {"B": ["M", "N"], "A": ["M", "M - 1"]}
    assert _shapes(kl.from_c("double A[M][M];\n" + TRMM)) == {"A": ["M", "M"], "B": ["M", "N"]}
    assert _shapes(kl.from_c(TRMM, shapes={"A": ("M", "M")})) == {"A": ["M", "M"], "B": ["M", "N"]}
    signature = "void trmm(int M, int N, double alpha, double A[M][M], double B[M][N]) {\n" + TRMM + "\n}"
    assert _shapes(kl.from_c(signature)) == {"A": ["M", "M"], "B": ["M", "N"]}
    # a triangle read from both sides: the box of every access over the whole domain
    tri = kl.from_c("for (i = 0; i < N; i++) for (j = i; j < N; j++) U[i][j] = L[j][i] + L[N - 1 - i][j - i];")
    assert _shapes(tri) == {"U": ["N", "N"], "L": ["N", "N"]}
    prog = kl.from_c(TRMM, shapes={"A": ("M", "M")})
    arrays = {"A": np.ones((5, 5)), "B": np.ones((5, 4))}
    kl.run(prog, {"M": 5, "N": 4, "alpha": 2.0}, arrays)
    np.testing.assert_allclose(arrays["B"][:, 0], [10, 8, 6, 4, 2])


@pytest.mark.parametrize("source,shapes,line,col,message", [
    ("double A[N];\nfor (i = 0; i < N; i++)\n  A[i] = A[i + 1] * 2.0;", None, 3, 10,
     r"A\[i \+ 1\] in S0 reads A\[1\] at S0\[i=0\] with N=1, outside the declared extents A\[N\] = \(1\)"),
    ("void f(int n, double A[n][n]) {\n  for (int i = 0; i < n; i++)\n    for (int j = 0; j <= i; j++)\n"
     "      A[i][j + 1] = 0.0;\n}", None, 4, 7, r"A\[i, j \+ 1\] in S0 writes A\[0, 1\] at S0\[i=0, j=0\] with n=1"),
    ("double x[N];\nfor (i = 0; i < M; i++)\n  y[i] = x[i];", None, 3, 10,
     r"x\[i\] in S0 reads x\[1\] at S0\[i=1\] with N=1, M=2, outside the declared extents x\[N\] = \(1\)"),
    (TRMM, {"A": ("M - 1", "M")}, 4, 18, r"A\[k, i\] in S0 reads A\[1, 0\] at S0\[i=0, j=0, k=1\] with M=2, N=1"),
    (TRMM, {"A": ("M",)}, 4, 18, r"'A' is used with 2 subscript\(s\) but from_c\(shapes=...\) gives it 1"),
    ("double A[M][M];\n" + TRMM, {"A": ("M", "M")}, 1, 8, r"array 'A' is declared here and given a shape"),
    (TRMM, {"Q": (3,)}, 1, 1, r"gives a shape for 'Q', which the source never uses"),
])
def test_accesses_past_declared_extents_are_errors_at_the_access(source, shapes, line, col, message):
    with pytest.raises(ParseError, match=message) as err:
        kl.from_c(source, shapes=shapes)
    assert (err.value.line, err.value.col) == (line, col)


def test_conditional_and_non_affine_accesses_are_not_flagged():
    # the guard keeps i + 1 in range, a data-dependent index cannot be checked statically
    kl.from_c("double A[N], idx[N];\nfor (i = 0; i < N; i++) {\n  if (x[i] > 0.5) A[i] = 1.0;\n"
              "  A[(int)idx[i]] = 2.0;\n}")
    kl.from_c("double ey[NX][NY];\nfor (j = 0; j < NY; j++) ey[0][j] = 0.0;")  # fine whenever ey is not empty
