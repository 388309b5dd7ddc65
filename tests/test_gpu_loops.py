"""Kernel form, launch geometry and the kernel verifier (``kiln.ir.loops.gpu``)."""

from __future__ import annotations

import pytest

from kiln.ir.errors import VerificationError
from kiln.ir.loops import Binary, Const, Var, parse_program
from kiln.ir.loops.expr import affine_form
from kiln.ir.loops.gpu import (
    MAX_SHARED_BYTES, Launch, block_loops, kernel_body, kernel_launch, known_divisor, linear_thread, shared_bytes,
    thread_loops, verify_kernel,
)

from test_emulate import make


def ok(buffers: str, body: str, **kw):
    k = make("k", buffers, body, **kw)
    verify_kernel(k)
    return k


def fails(match: str, buffers: str, body: str, **kw) -> str:
    k = make("k", buffers, body, **kw)
    with pytest.raises(VerificationError, match=match) as info:
        verify_kernel(k)
    assert "kernel 'k'" in str(info.value)
    return str(info.value)


def program(text: str):
    return parse_program(text)


# ----------------------------------------------------------------------------- views
def test_launch_loops_body_and_linear_thread():
    k = make("k", "x: f32[4, 64]", "x[by, tx + 16 * ty] = 1.0:f32\nbarrier",
             grid=(("by", "y", 4), ("bx", "x", 3)), block=(("tz", "z", 2), ("ty", "y", 2), ("tx", "x", 16)))
    launch = kernel_launch(k)
    assert launch == Launch((3, 4, 1), (16, 2, 2)) and launch.threads == 64 and launch.blocks == 12
    assert [lp.iterator for lp in block_loops(k)] == ["by", "bx"]
    assert [lp.iterator for lp in thread_loops(k)] == ["tz", "ty", "tx"]
    assert [type(n).__name__ for n in kernel_body(k)] == ["Store", "Barrier"]
    lin = linear_thread(k)
    assert str(lin) == "tx + 16 * (ty + 2 * tz)"
    assert dict(affine_form(lin).coeffs) == {"tx": 1, "ty": 16, "tz": 32}
    one = make("one", "x: f32[4]", "x[ty] = 1.0:f32", grid=(("b", "z", 1),), block=(("ty", "y", 4),))
    assert kernel_launch(one) == Launch((1, 1, 1), (1, 4, 1)) and str(linear_thread(one)) == "ty"


def test_shared_bytes_and_known_divisor():
    k = ok("x: f32[64]\na: f16[2, 64] shared\nb: f64[8] shared\nr: f32[4] register", "x[tx] = 1.0:f32")
    assert shared_bytes(k) == 2 * 64 * 2 + 8 * 8
    t = Var("t")
    assert known_divisor(Binary("*", Const(4), Binary("floordiv", t, Const(3))), {}) == 4
    assert known_divisor(Binary("+", Binary("*", Const(8), t), Const(12)), {}) == 4
    assert known_divisor(Binary("floormod", Binary("*", Const(6), t), Const(4)), {}) == 2
    assert known_divisor(Binary("+", t, Const(4)), {"t": 8}) == 4
    assert known_divisor(Const(0), {}) == 0 and known_divisor(t, {}) == 1


# ----------------------------------------------------------------------------- kernel form
def test_kernels_have_no_parameters():
    with pytest.raises(VerificationError, match=r"has parameters \(N\); kernels have static shapes"):
        verify_kernel(program("""program k(N: i64) {
  buffer x: f32[N]
  for bx in [0, 1) @mapped("blockIdx.x") {
    for tx in [0, 32) @mapped("threadIdx.x") {
      s0: x[tx] = 1.0:f32
    }
  }
}"""))


@pytest.mark.parametrize("body, match", [
    ('for i in [0, 4) {\n s0: x[i] = 1.0:f32\n}', r"body must be exactly one loop @mapped\(\"blockIdx"),
    ('for tx in [0, 4) @mapped("threadIdx.x") {\n s0: x[tx] = 1.0:f32\n}', r"body must be exactly one loop"),
    ('for bx in [0, 4) @mapped("blockIdx.x") {\n s0: x[bx] = 1.0:f32\n}',
     r"body of block loop 'bx' must be exactly one loop @mapped\(\"threadIdx"),
    ('for bx in [0, 4) @mapped("blockIdx.x") {\n for tx in [0, 4) @mapped("threadIdx.x") {\n s0: x[tx] = 1.0:f32\n}\n'
     ' s1: x[bx] = 2.0:f32\n}', r"body of block loop 'bx' must be exactly one loop .* found 2 node\(s\)"),
    ('for bx in [0, 1) @mapped("blockIdx.x") {\n for tx in [0, 4) @mapped("threadIdx.x") {\n'
     ' for ty in [0, 4) @mapped("threadIdx.y") {\n s0: x[tx] = 1.0:f32\n}\n s1: x[tx] = 1.0:f32\n}\n}',
     r"loop 'ty' @mapped\(\"threadIdx.y\"\) is inside the per-thread code"),
    ('for bx in [1, 4) @mapped("blockIdx.x") {\n for tx in [0, 4) @mapped("threadIdx.x") {\n s0: x[tx] = 1.0:f32\n}\n}',
     r"block loop 'bx' starts at 1"),
    ('for bx in [0, 1) @mapped("blockIdx.x") {\n for tx in [0, 4) step 2 @mapped("threadIdx.x") {\n'
     ' s0: x[tx] = 1.0:f32\n}\n}', r"thread loop 'tx' has step 2"),
    ('for bx in [0, 1) @mapped("blockIdx.x") {\n for tx in [0, 0) @mapped("threadIdx.x") {\n s0: x[tx] = 1.0:f32\n}\n}',
     r"thread loop 'tx' has upper bound 0; a thread loop needs a constant extent >= 1"),
    ('for bx in [0, 2) @mapped("blockIdx.x") {\n for bx2 in [0, 2) @mapped("blockIdx.x") {\n'
     ' for tx in [0, 4) @mapped("threadIdx.x") {\n s0: x[tx] = 1.0:f32\n}\n}\n}',
     r"axis blockIdx.x is mapped twice, by loops 'bx' and 'bx2'"),
    ('for bx in [0, 2) @mapped("blockIdx.x") {\n for tx in [0, 4) @mapped("threadIdx.x") {\n'
     ' for ty in [0, 4) @mapped("threadIdx.y") {\n s0: x[tx] = 1.0:f32\n}\n}\n}',
     r"loop 'tx' mapped to threadIdx.x must be the innermost thread loop"),
])
def test_not_in_kernel_form(body, match):
    text = "program k() {\n  buffer x: f32[4]\n" + body + "\n}"
    with pytest.raises(VerificationError, match=match):
        verify_kernel(program(text))
    with pytest.raises(VerificationError, match=match):
        kernel_launch(program(text))


def test_launch_limits():
    fails(r"2048 threads per block .* exceed 1024", "x: f32[4]", "x[0] = 1.0:f32",
          block=(("ty", "y", 2), ("tx", "x", 1024)))
    fails(r"block extent 128 along z exceeds 64", "x: f32[4]", "x[0] = 1.0:f32",
          block=(("tz", "z", 128), ("tx", "x", 2)))
    fails(r"grid extent 70000 along y exceeds 65535", "x: f32[4]", "x[0] = 1.0:f32",
          grid=(("by", "y", 70000),))


# ----------------------------------------------------------------------------- buffers
def test_local_buffers_and_shared_memory_limit():
    fails(r"buffer 't' is local; kernels have no local buffers", "x: f32[32]\nt: f32[32] local", "x[tx] = t[tx]")
    words = MAX_SHARED_BYTES // 4
    ok(f"x: f32[32]\ns: f32[{words}] shared", "s[tx] = x[tx]")
    fails(rf"{MAX_SHARED_BYTES + 4} bytes of shared memory \('s' {MAX_SHARED_BYTES}, 'u' 4\) exceed",
          f"x: f32[32]\ns: f32[{words}] shared\nu: f32[1] shared", "s[tx] = x[tx]")


def test_register_buffers_are_indexed_independently_of_threads_and_blocks():
    ok("x: f32[64]\nr: f32[4] register", """
        for (i) in repeat(4) on 0 {
          r[i] = x[4 * floormod(tx, 16) + i]
        }
        for j in [0, 4) {
          x[4 * floormod(tx, 16) + j] = r[3 - j]
        }
    """)
    fails(r"register buffer 'r' is indexed by tx in statement s0, which depends on thread iterator 'tx'",
          "x: f32[32]\nr: f32[32] register", "r[tx] = x[tx]")
    fails(r"register buffer 'r' is indexed by bx .* depends on block iterator 'bx'",
          "x: f32[32]\nr: f32[2] register", "x[tx] = r[bx]")
    # a spatial task coordinate is a function of the worker, here the thread
    fails(r"register buffer 'r' is indexed by floormod\(tx, 4\).*thread iterator 'tx'",
          "x: f32[32]\nr: f32[4] register", """
        for (i, j) in spatial(8, 4) on tx {
          r[j] = x[tx]
        }
    """)
    fails(r"indexed by j in the bounds of loop 'k'.*thread iterator 'tx'", "x: f32[32]\nr: f32[4] register", """
        for j in [0, floormod(tx, 4)) {
          for k in [0, r[j]) {
            x[tx] = 1.0:f32
          }
        }
    """.replace("r[j]", "i64(r[j])"))


def test_per_thread_loops_run_serially():
    fails(r"per-thread loop 'j' is @parallel", "x: f32[32]", "for j in [0, 2) @parallel {\n x[tx] = 1.0:f32\n}")
    ok("x: f32[32]", "for j in [0, 2) @unrolled(2) {\n x[tx] = 1.0:f32\n}")


# ----------------------------------------------------------------------------- uniform control flow
def test_barriers_under_uniform_control_flow_pass():
    ok("x: f32[64]\ns: f32[32] shared", """
        for k in [0, 2 + bx) {
          if (bx == 1 && k < 3) {
            s[tx] = x[tx]
            barrier
          }
          barrier warp
        }
        for (i) in spatial(32) * repeat(2) on tx {
          x[i] = s[floormod(i, 32)]
          barrier
        }
        for (i) in spatial(4) on bx {
          barrier
        }
    """)


@pytest.mark.parametrize("body, match", [
    ("if (tx < 16) {\n barrier\n}", r"barrier is under if \(tx < 16\), which depends on thread iterator 'tx'"),
    ("for k in [0, tx) {\n barrier\n}", r"barrier is under loop 'k', which depends on thread iterator 'tx'"),
    ("for j in [0, floormod(tx, 2) + 1) {\n for k in [0, 2) {\n barrier warp\n}\n}",
     r"barrier warp is under loop 'j'"),
    ("if (x[0] > 0.0:f32) {\n barrier\n}", r"barrier is under if \(x\[0\] > 0.0:f32\), which depends on a value "
                                          r"loaded from 'x'"),
    ("for k in [0, i64(x[0])) {\n barrier\n}", r"depends on a value loaded from 'x'"),
    # 32 workers of 64 threads: the lowered task loop guards its body by tx < 32
    ("for (i) in spatial(32) on tx {\n barrier\n}", r"barrier is under if \(tx < 32\)"),
    ("if (tx == 0) {\n r[0] = shfl_xor(r[1], 1, 32)\n}", r"shuffle s0 is under if \(tx == 0\)"),
])
def test_collectives_under_non_uniform_control_flow_fail(body, match):
    text = fails(match, "x: f32[64]\nr: f32[2] register", body, block=(("tx", "x", 64),))
    assert "deadlocks" in text


def test_shuffle_width_divides_the_block():
    ok("x: f32[48]\nr: f32[2] register", "r[0] = shfl_xor(x[tx], 1, 16)", block=(("tx", "x", 48),))
    fails(r"shuffle s0 has width 32, which does not divide the 48 threads", "x: f32[48]\nr: f32[2] register",
          "r[0] = shfl_xor(x[tx], 1, 32)", block=(("tx", "x", 48),))


# ----------------------------------------------------------------------------- vector copies
def test_vector_copy_rules():
    buffers = "x: f32[4, 64]\nh: f16[4, 64]\nd: f64[4, 64]\ns: f32[4, 64] shared\nr: f32[8] register"
    ok(buffers, """
        for (i, j) in spatial(4, 8) on tx {
          s[i, 8 * j] = async_vec4(x[i, 8 * j])
          r[4] = vec4(x[i, 8 * j + 4])
        }
        commit_copies
        wait_copies 0
        for k in [0, 64) step 4 {
          r[0] = vec4(s[0, k])
        }
    """)
    fails(r"vector copy s0 moves 32 bytes \(8 x f32\); the widest vector access is 16 bytes", buffers,
          "r[0] = vec8(x[0, 0])")
    fails(r"vector copy s0 moves 32 bytes \(4 x f64\)", buffers, "d[0, 0] = vec4(d[1, 0])")
    fails(r"asynchronous vector copy s0 moves 2 bytes \(1 x f16\); cp.async copies 4, 8 or 16 bytes",
          buffers + "\nhs: f16[64] shared", "hs[tx] = async_vec1(h[0, tx])\ncommit_copies\nwait_copies 0")
    fails(r"vector copy s0: cannot prove the index 4 \* tx \+ 2 of 'x' is a multiple of the width 4", buffers,
          "r[0] = vec4(x[0, 4 * tx + 2])")
    fails(r"vector copy s0: cannot prove the index k of 's'", buffers,
          "for k in [0, 64) step 2 {\n r[0] = vec4(s[0, k])\n}")
    fails(r"the last dimension of 'y' \(6\) is not a multiple of the width 4", buffers + "\ny: f32[2, 6]",
          "r[0] = vec4(y[1, 0])")
    with pytest.raises(VerificationError, match="a vector copy keeps the dtype"):
        make("k", buffers, "r[0] = vec4(h[0, 0])")


def test_asynchronous_copies_are_committed_and_waited_for():
    buffers = "x: f32[64]\ns: f32[64] shared"
    copy = "s[tx] = async_vec1(x[tx])"
    ok(buffers, f"{copy}\ncommit_copies\nfor k in [0, 2) {{\n {copy}\n commit_copies\n wait_copies 1\n}}\n"
       "wait_copies 0\nbarrier")
    message = fails(r"asynchronous copy s0 is not followed by 'commit_copies' and then 'wait_copies 0'",
                    buffers, copy, block=(("tx", "x", 64),))
    assert "barrier" in message
    fails(r"asynchronous copy s0 is not followed", buffers, f"{copy}\nwait_copies 0", block=(("tx", "x", 64),))
    fails(r"asynchronous copy s0 is not followed", buffers, f"{copy}\ncommit_copies\nwait_copies 1",
          block=(("tx", "x", 64),))
    fails(r"asynchronous copy s0 is not followed", buffers,  # the last iteration's copy is never committed
          f"for k in [0, 2) {{\n commit_copies\n wait_copies 0\n {copy}\n}}", block=(("tx", "x", 64),))
