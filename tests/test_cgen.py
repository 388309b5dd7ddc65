"""The C-family printer base (:class:`kiln.ir.loops.cgen.CStylePrinter`): the plain C and
OpenMP printers print what they printed before the base existed, every dialect decision goes
through a hook, and f16/bf16 are spelled as the C dialects spell them."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kiln.loops as kl
from kiln.backends.cpu.codegen import KernelPrinter, sanitize_program
from kiln.backends.cpu.toolchain import c_compiler
from kiln.ir.loops.cgen import C_PRELUDE, CStylePrinter, to_c
from kiln.ir.types import DType

sys.path.insert(0, str(Path(__file__).parent))
from test_loops_ir import FULL  # noqa: E402

REDUCTIONS = """program r() {
  buffer X: f32[256, 512]
  buffer O: f32[256]
  buffer M: f32[]
  buffer T: f32[4, 4] local
  for i in [0, 256) {
    for k in [0, 512) {
      S0: O[i] += X[i, k]
    }
  }
  for i in [0, 256) {
    for k in [0, 512) @vectorized {
      S1: M[] max= X[i, k]
    }
  }
  for a in [0, 4) @parallel {
    for b in [0, 4) @parallel {
      S2: T[a, b] = exp(X[a, b]) * 0.5:f32
    }
  }
}
"""

# What to_c and the cpu backend's printer printed for these programs before they shared a base
# (the compile cache and the benchmarks rely on float32 code staying byte-for-byte the same).
FULL_C = """\
void demo(long N, long M, double alpha, float scale, double C[N][M], double A[N][M + 1], double s[1]) {
  float (*t) = calloc(KILN_MAX(N, 1), sizeof *t);
  int (*h) = calloc(KILN_MAX(8, 1), sizeof *h);
  #pragma omp parallel for
  for (long i = 0; i < N; i++) {
    #pragma GCC unroll 4
    for (long j = KILN_MAX(0, i - 1); j < KILN_MIN(M, i + 3); j += 2) {
      C[i][j] = C[i][j] * alpha;
      /* mapped to threadIdx.x */
      for (long j2 = 0; j2 < M; j2++) {
        C[i][j2] += alpha * A[i][j2 + 1];
        t[i] = KILN_MAX(t[i], ((int)-3) + ((float)(2.5f)) * -(scale - -2) / 2.0);
        if (i >= 1 && !(j < 2) || i == 3) {
          s[0] = (i < 2 ? exp(-1.5) : -INFINITY) - -0.0;
        } else {
          s[0] *= 2.0;
        }
        h[kiln_floormod(i, 8)] = ((int)(kiln_floordiv(i - 9, 4))) % ((int)3) + i / 2;
        t[i] = KILN_MIN(t[i], ((float)(sqrt(pow(A[i][0], 2.0)) + labs(-4))));
      }
    }
    #pragma omp simd
    for (long v = 0; v < 4; v++) {
      C[i][v] = ((double)(i != v)) + ((double)(1));
    }
  }
  free(t);
  free(h);
}
"""

FULL_KERNEL = """\
static void k(long v0, long v1, double v2, float v3, double b0[restrict v0][v1], double b1[restrict v0][v1 + 1], double b3[restrict 1]) {
  float (*b2) = calloc(KILN_MAX(v0, 1), sizeof *b2);
  int b4[8] = {0};
  const double inv0_1 = ((int)-3) + ((float)(2.5f)) * -(v3 - -2) / 2.0;
  const double inv1_1 = exp(-1.5);
  #pragma omp parallel for schedule(static)
  for (long v4 = 0; v4 < v0; v4++) {
    #pragma GCC unroll 4
    for (long v5 = KILN_MAX(0, v4 - 1); v5 < KILN_MIN(v1, v4 + 3); v5 += 2) {
      b0[v4][v5] = b0[v4][v5] * v2;
      for (long v6 = 0; v6 < v1; v6++) {
        b0[v4][v6] += v2 * b1[v4][v6 + 1];
        b2[v4] = KILN_MAX(b2[v4], inv0_1);
        if (v4 >= 1 && !(v5 < 2) || v4 == 3) {
          b3[0] = (v4 < 2 ? inv1_1 : -INFINITY) - -0.0;
        } else {
          b3[0] *= 2.0;
        }
        b4[kiln_floormod(v4, 8)] = ((int)(kiln_floordiv(v4 - 9, 4))) % ((int)3) + v4 / 2;
        b2[v4] = KILN_MIN(b2[v4], ((float)(sqrt(pow(b1[v4][0], 2.0)) + labs(-4))));
      }
    }
    #pragma omp simd
    for (long v7 = 0; v7 < 4; v7++) {
      b0[v4][v7] = ((double)(v4 != v7)) + ((double)(1));
    }
  }
  free(b2);
}"""

REDUCTIONS_KERNEL = """\
static void k(float X[restrict 256][512], float O[restrict 256], float M[restrict 1]) {
  float T[4][4] = {0};
  for (long i = 0; i < 256; i++) {
    {
      float acc0 = O[i];
      #pragma omp simd reduction(+:acc0)
      for (long k = 0; k < 512; k++) {
        acc0 += X[i][k];
      }
      O[i] = acc0;
    }
  }
  {
    float acc1 = M[0];
    #pragma omp parallel for schedule(static) reduction(max:acc1)
    for (long i = 0; i < 256; i++) {
      #pragma omp simd reduction(max:acc1)
      for (long k = 0; k < 512; k++) {
        acc1 = KILN_MAX(acc1, X[i][k]);
      }
    }
    M[0] = acc1;
  }
  #pragma omp parallel for schedule(static) collapse(2)
  for (long a = 0; a < 4; a++) {
    for (long b = 0; b < 4; b++) {
      T[a][b] = kiln_expf(X[a][b]) * 0.5f;
    }
  }
}"""


def test_plain_c_is_unchanged():
    assert to_c(kl.parse(FULL), prelude=False) == FULL_C
    assert to_c(kl.parse(FULL)) == C_PRELUDE + "\n" + FULL_C


def test_openmp_printer_is_unchanged():
    program, _ = sanitize_program(kl.parse(FULL))
    assert KernelPrinter(program).function("k") == FULL_KERNEL
    assert KernelPrinter(kl.parse(REDUCTIONS)).function("k") == REDUCTIONS_KERNEL


def test_the_openmp_printer_specializes_the_base_without_copying_it():
    assert issubclass(KernelPrinter, CStylePrinter)
    own = set(vars(KernelPrinter))
    # the shared machinery is inherited, not re-implemented
    for name in ("function", "signature", "params", "declare_local", "statement", "for_loop", "loop_header",
                 "const", "call", "binary", "cast", "ref"):
        assert name not in own, name
    assert KernelPrinter.prelude.startswith(CStylePrinter.prelude)  # plus the blend helpers of .speculate


HALF = """program half(N: i64) {
  buffer A: f16[N]
  buffer B: f16[N]
  buffer Z: bf16[N]
  for i in [0, N) {
    S0: B[i] = exp(A[i]) * 0.5:f16 + f16(abs(A[i]))
  }
}"""


def test_half_types_are_spelled_as_c_spells_them():
    text = to_c(kl.parse(HALF), prelude=False)
    assert "_Float16 A[N]" in text and "_Float16 B[N]" in text and "__bf16 Z[N]" in text
    assert "((_Float16)0.5f)" in text  # a float literal cast: exact, whatever the compiler's f16 suffix
    assert "expf(A[i])" in text and "fabsf(A[i])" in text  # math in float
    assert "((_Float16)(fabsf(A[i])))" in text


def test_the_cpu_printer_computes_half_types_in_float_and_rounds_every_op():
    text = KernelPrinter(kl.parse(HALF)).function("k")
    assert "unsigned short" in text and "_Float16" not in text and "__bf16" not in text
    assert "kiln_f16_load(" in text and "kiln_f16_store(" in text  # widen on load, narrow on store
    assert "kiln_round_f16(kiln_expf(" in text  # each arithmetic result rounded, as torch computes
    assert KernelPrinter.type_name(DType.bfloat16) == "unsigned short"
    assert CStylePrinter.type_name(DType.bfloat16) == "__bf16"


def _compiles(source: str) -> bool:
    cc = c_compiler()
    if cc is None:
        return False
    proc = subprocess.run([cc, "-x", "c", "-std=c99", "-fsyntax-only", "-"], input=source, capture_output=True,
                          text=True, check=False)
    return proc.returncode == 0


@pytest.mark.skipif(not _compiles("_Float16 x = 1;"), reason="no C compiler with _Float16")
def test_float16_programs_compile_and_compute():
    program = kl.parse(HALF.replace("  buffer Z: bf16[N]\n", ""))
    a = np.linspace(-3, 2, 37).astype(np.float16)
    b = np.zeros_like(a)
    kl.compile_c(program)({"N": a.size}, {"A": a, "B": b})
    x = a.astype(np.float32)
    want = (np.exp(x) * np.float32(0.5) + np.abs(x)).astype(np.float16)
    np.testing.assert_allclose(b.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=0)


class _Dialect(CStylePrinter):
    """A made-up dialect overriding every hook, to show no C spelling is hard-wired."""

    types = {DType.float32: "real_t", DType.int64: "idx_t", DType.int32: "int_t"}
    function_prefix = "KERNEL "

    def float_literal(self, text, dtype):
        return f"R({text})", 8

    def math_function(self, fn, dtype):
        return f"m_{fn}"

    def cast(self, dtype, text):
        return f"to_{self.type_name(dtype)}({text})"

    def loop_pragmas(self, n):
        return [f"// {n.annotation.mode}"] if n.annotation.mode != "serial" else []

    def loop_header(self, n):
        return f"FOR({n.iterator}, {self.expr(n.lower)}, {self.expr(n.upper)}) {{"

    def buffer_param(self, b):
        return f"{self.type_name(b.dtype)} *{b.name}"

    def ref(self, buffer, indices):
        return f"AT({buffer}, {', '.join(self.expr(i) for i in indices) or '0'})"

    def stack_local(self, b):
        return True


def test_every_dialect_decision_is_a_hook():
    program = kl.parse("""program d(N: i64, s: f32) {
  buffer A: f32[N, 4]
  buffer T: f32[4] local
  for i in [0, N) @parallel {
    for j in [0, 4) @vectorized {
      S0: T[j] = exp(A[i, j]) * 1.5:f32 + s
      S1: A[i, j] = f32(i) + T[j]
    }
  }
}""")
    text = _Dialect(program).function("d")
    assert text.splitlines()[0] == "KERNEL void d(long N, real_t s, real_t *A) {"
    assert "real_t T[4] = {0};" in text
    assert "// parallel" in text and "// vectorized" in text and "#pragma" not in text
    assert "FOR(i, 0, N) {" in text and "for (" not in text
    assert "AT(T, j) = m_exp(AT(A, i, j)) * R(1.5) + s;" in text
    assert "AT(A, i, j) = to_real_t(i) + AT(T, j);" in text
    assert "float" not in text and "[" not in text.split("\n", 2)[2]
    with pytest.raises(ValueError, match="f64"):
        _Dialect.type_name(DType.float64)


SIMD_AROUND_PARALLEL = """program s() {
  buffer X: f32[64, 512]
  buffer O: f32[64, 512]
  buffer R: f32[64]
  for i in [0, 64) @vectorized {
    for j in [0, 512) @parallel {
      S0: O[i, j] = X[i, j] * 2.0:f32
    }
    for k in [0, 512) {
      S1: R[i] += X[i, k]
    }
  }
}
"""


def test_no_parallel_region_opens_inside_an_omp_simd_loop(tmp_path):
    """OpenMP forbids a parallel region inside ``omp simd``: a tuned schedule that vectorizes
    an outer loop and marks an inner one parallel prints the inner loop without a region (a
    region there is a compile error), and a reduction inside gets no region either."""
    kernel = KernelPrinter(kl.parse(SIMD_AROUND_PARALLEL)).function("k")
    simd_at = kernel.index("#pragma omp simd")
    assert "omp parallel" not in kernel[simd_at:], kernel
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "k.c"
    src.write_text("#include <math.h>\n#include <stdlib.h>\n#include <string.h>\n" + kernel)
    proc = subprocess.run([cc, "-fopenmp", "-c", str(src), "-o", str(tmp_path / "k.o")], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr


ROW_INVARIANTS = """program rows() {
  buffer X: f32[64, 100]
  buffer M: f32[64]
  buffer S: f32[64]
  buffer Y: f32[64, 100]
  buffer G: f32[64, 100]
  for i in [0, 64) @parallel {
    for j in [0, 100) @vectorized {
      S0: Y[i, j] = X[i, j] - M[i] - log(S[i])
    }
    for j in [0, 100) {
      S1: M[i] = M[i] + X[i, j]
    }
    for j in [0, 100) @vectorized {
      if (i < 60) {
        S2: G[i, j] = X[i, j] * S[i + 4]
      }
    }
  }
}
"""


def test_row_invariant_loads_and_math_are_read_once_before_the_inner_loop(tmp_path):
    """Before an innermost loop, the values it reads and does not change (a softmax row's
    maximum, the log of its sum) become ``const`` locals, which GCC needs to vectorize the loop;
    a buffer the loop writes (``M`` in S1) and a load under an ``if`` (S2) stay in the loop."""
    kernel = KernelPrinter(kl.parse(ROW_INVARIANTS)).function("k")
    lines = [line.strip() for line in kernel.splitlines()]
    first_loop = next(i for i, line in enumerate(lines) if line.startswith("for (long") and "< 100" in line)
    hoisted = [line for line in lines[:first_loop] if line.startswith("const float row")]
    assert len(hoisted) == 2 and "logf(" in hoisted[1], hoisted  # M[i], then log(S[i]) (M[i] not repeated)
    statements = [line for line in lines if line.startswith(("Y[", "M[", "G["))]
    y, m, g = (next(s for s in statements if s.startswith(p)) for p in ("Y[", "M[", "G["))
    assert "M[" not in y.split("=", 1)[1] and "logf" not in y
    assert "M[i]" in m.split("=", 1)[1]  # written by its own loop: read there
    assert "S[i + 4]" in g  # guarded: not read before the loop
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(0)
    data = {"X": rng.standard_normal((64, 100)).astype(np.float32), "M": rng.standard_normal(64).astype(np.float32),
            "S": rng.uniform(1, 2, 64).astype(np.float32), "Y": np.zeros((64, 100), np.float32),
            "G": np.zeros((64, 100), np.float32)}
    want = {k: v.copy() for k, v in data.items()}
    want["Y"] = want["X"] - want["M"][:, None] - np.log(want["S"])[:, None]
    want["M"] = want["M"] + want["X"].sum(axis=1)
    want["G"][:60] = want["X"][:60] * want["S"][4:64, None]
    source = tmp_path / "k.c"
    source.write_text("#include <math.h>\n#include <stdlib.h>\n#include <string.h>\n" + kernel
                      + "void run(void **p) { k(p[0], p[1], p[2], p[3], p[4]); }\n")
    lib = tmp_path / "k.so"
    proc = subprocess.run([cc, "-fopenmp", "-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC", str(source),
                           "-o", str(lib), "-lm"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    pointers = (ctypes.c_void_p * 5)(*(data[k].ctypes.data for k in ("X", "M", "S", "Y", "G")))
    ctypes.CDLL(str(lib)).run(pointers)
    for key in ("Y", "M", "G"):
        np.testing.assert_allclose(data[key], want[key], rtol=1e-5, atol=1e-5)


def test_bool_buffers_are_bytes_and_a_masked_softmax_blends_its_branches():
    """The cpu printer keeps bool buffers as bytes (GCC vectorizes no ``_Bool`` load) holding
    0 or 1 -- casts and stores go through ``_Bool`` -- and prints a data select whose branch
    calls a math function as ``kiln_blend_f32`` (both branches evaluated: the loop
    vectorizes); a bounds guard stays a conditional.  Results match eager exactly for the
    bools, within 1e-5 for the floats, at odd sizes."""
    import torch

    import kiln

    def f(x, mask):
        soft = torch.where(mask, torch.softmax(x, dim=-1), 0.0)
        truthy = (x * 0.25).bool()           # a cast: 0.1 -> True, 0 -> False
        either = mask + (x > 0.5)             # bool + bool: logical or
        pooled = torch.nn.functional.max_pool1d(x, 3, 1, 1)  # padding: a guarded load
        return soft, truthy, either & mask, pooled

    x = torch.randn(3, 5, 17)
    x[0, 0, :4] = 0.0
    mask = torch.rand(3, 5, 17) > 0.3
    compiled = kiln.compile(f, (x, mask), backend="cpu")
    for got, want in zip(compiled(x, mask), f(x, mask)):
        if want.dtype == torch.bool:
            assert got.dtype == torch.bool and torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    source = compiled.executable.source
    assert "_Bool b" not in source and "unsigned char b" in source
    assert "kiln_blend_f32(" in source
    blended = [line for line in source.splitlines() if "kiln_blend_f32(" in line and "=" in line]
    assert all("expf(" in line for line in blended), blended
