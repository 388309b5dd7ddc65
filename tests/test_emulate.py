"""The host emulation of GPU kernels (``kiln.ir.loops.emulate``) against numpy.

Every kernel is written by hand in the loop IR's text form; its emulation runs in the
interpreter and, once per kernel, natively through ``compile_c``.  Expected values come from
numpy or from independent models of the GPU constructs (PTX's shuffle rules written with
Python bit operations, ``TaskMapping.worker2task``).
"""

from __future__ import annotations

import itertools
import math
import re
import textwrap

import numpy as np
import pytest

from kiln.backends.cpu.native import compile_c
from kiln.ir.errors import VerificationError
from kiln.ir.loops import Barrier, If, Loop, Shuffle, parse_program, repeat, spatial
from kiln.ir.loops.emulate import emulate
from kiln.ir.loops.gpu import Launch, kernel_launch
from kiln.ir.loops.interp import run

RTOL, ATOL = 1e-4, 1e-5


def make(name: str, buffers: str, body: str, grid=(("bx", "x", 2),), block=(("tx", "x", 32),)):
    """A kernel: ``buffers`` (one declaration a line), block loops ``grid`` and thread loops
    ``block`` (``(iterator, axis, extent)``, outermost first) around the per-thread ``body``;
    statements without a label get ``s0``, ``s1``, ..."""
    counter = itertools.count()
    lines = [f"program {name}() {{"] + ["  buffer " + b.strip() for b in buffers.strip().splitlines()]
    depth = 1
    for kind, loops in (("blockIdx", grid), ("threadIdx", block)):
        for it, axis, n in loops:
            lines.append("  " * depth + f'for {it} in [0, {n}) @mapped("{kind}.{axis}") {{')
            depth += 1
    for line in textwrap.dedent(body).strip().splitlines():
        line = re.sub(r"^(\s*)([A-Za-z_]\w*\[)", lambda m: f"{m.group(1)}s{next(counter)}: {m.group(2)}", line)
        lines.append("  " * depth + line)
    for d in range(depth - 1, 0, -1):
        lines.append("  " * d + "}")
    lines.append("}")
    return parse_program("\n".join(lines))


def execute(kernel, inputs: dict[str, np.ndarray], native: bool = True) -> dict[str, np.ndarray]:
    """Run the emulation of ``kernel`` on copies of ``inputs`` in the interpreter (and natively,
    checking both agree); missing global buffers start as zeros.  Returns the interpreter's arrays."""
    program = emulate(kernel)
    arrays = {}
    for b in program.buffers:
        if b.scope != "global":
            continue
        shape = tuple(int(d.value) for d in b.shape)
        arrays[b.name] = inputs[b.name].copy() if b.name in inputs else np.zeros(shape, b.dtype.numpy)
    native_arrays = {k: v.copy() for k, v in arrays.items()}
    run(program, {}, arrays)
    if native:
        compile_c(program)({}, native_arrays)
        for k in arrays:
            np.testing.assert_allclose(native_arrays[k], arrays[k], rtol=RTOL, atol=ATOL, err_msg=f"native {k}")
    return arrays


# ----------------------------------------------------------------------------- shared memory
def test_block_tree_reduction_with_barriers_in_a_uniform_loop():
    n, t = 300, 64
    grid = math.ceil(n / t)
    k = make("block_sum", f"x: f32[{n}]\ny: f32[{grid}]\nsh: f32[{t}] shared", f"""
        if (bx * {t} + tx < {n}) {{
          sh[tx] = x[bx * {t} + tx]
        }} else {{
          sh[tx] = 0.0:f32
        }}
        barrier
        for k in [0, 6) {{
          if (tx < i64(exp2(5 - k))) {{
            sh[tx] = sh[tx] + sh[tx + i64(exp2(5 - k))]
          }}
          barrier
        }}
        if (tx == 0) {{
          y[bx] = sh[0]
        }}
    """, grid=(("bx", "x", grid),), block=(("tx", "x", t),))
    program = emulate(k)
    # the uniform loop holding the barrier is hoisted out of the thread loops
    stage = next(lp for lp in program.loops() if lp.iterator == "k")
    assert [type(n) for n in stage.body] == [Loop] and stage.body[0].iterator == "tx"
    assert not any(isinstance(n, Barrier) for n, _ in program.walk())
    assert all(b.scope != "shared" for b in program.buffers) and program.buffer("sh").scope == "local"
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = execute(k, {"x": x})
    want = np.add.reduceat(np.pad(x, (0, grid * t - n)), np.arange(0, grid * t, t))
    np.testing.assert_allclose(out["y"], want, rtol=RTOL, atol=ATOL)


def test_register_state_across_barriers_in_a_two_dimensional_block():
    k = make("rotate", "x: f32[3, 32]\ny: f32[3, 32]\nsh: f32[32] shared\nr: f32[2] register", """
        r[0] = x[bx, tx + 8 * ty]
        sh[tx + 8 * ty] = r[0] * 2.0:f32
        barrier
        r[1] = sh[floormod(tx + 8 * ty + 1, 32)]
        barrier
        for k in [0, 3) {
          sh[tx + 8 * ty] = r[0]
          barrier
          r[0] = r[0] + sh[floormod(tx + 8 * ty + k + 1, 32)]
          barrier
        }
        y[bx, tx + 8 * ty] = r[0] + r[1]
    """, grid=(("bx", "x", 3),), block=(("ty", "y", 4), ("tx", "x", 8)))
    program = emulate(k)
    assert program.buffer("r").scope == "local" and [int(d.value) for d in program.buffer("r").shape] == [4, 8, 2]
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    out = execute(k, {"x": x})
    r0, r1 = x.copy(), 2 * np.roll(x, -1, axis=1)
    for step in range(3):
        r0 = r0 + np.roll(r0, -(step + 1), axis=1)
    np.testing.assert_allclose(out["y"], r0 + r1, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- warp shuffles
def shfl_reference(values: np.ndarray, mode: str, offsets: np.ndarray, width: int) -> np.ndarray:
    """``shfl.sync`` of PTX on each warp of ``values`` (one per linear thread id), with
    Python's bit operations."""
    out = values.copy()
    for t in range(values.size):
        lane, b = t % 32, int(offsets[t]) & 31
        first = lane & ~(width - 1)
        last = first + width - 1
        j, ok = {"xor": (lane ^ b, (lane ^ b) <= last), "down": (lane + b, lane + b <= last),
                 "up": (lane - b, lane - b >= first), "idx": (first | (b & (width - 1)), True)}[mode]
        out[t] = values[t - lane + j] if ok else values[t]
    return out


@pytest.mark.parametrize("width", [32, 16, 8])
def test_warp_shuffles_in_every_mode(width):
    log = width.bit_length() - 1
    lin = "tx + 16 * ty"
    down = "\n".join(f"r[1] = shfl_down(r[2], {width >> (s + 1)}, {width})\nr[2] = r[2] + r[1]" for s in range(log))
    k = make(f"shuffles{width}", "x: f32[2, 64]\nall_xor: f32[2, 64]\nall_down: f32[2, 64]\nscan: f32[2, 64]\n"
             "bcast: f32[2, 64]\nedge_xor: f32[2, 64]\nedge_down: f32[2, 64]\nedge_up: f32[2, 64]\none_xor: f32[2, 64]\n"
             "r: f32[6] register", f"""
        r[0] = x[bx, {lin}]
        r[2] = r[0]
        r[3] = r[0]
        for k in [0, {log}) {{
          r[1] = shfl_xor(r[0], i64(exp2(k)), {width})
          r[0] = r[0] + r[1]
          r[4] = shfl_up(r[3], i64(exp2(k)), {width})
          if (floormod({lin}, {width}) >= i64(exp2(k))) {{
            r[3] = r[3] + r[4]
          }}
        }}
        {down}
        all_xor[bx, {lin}] = r[0]
        all_down[bx, {lin}] = r[2]
        scan[bx, {lin}] = r[3]
        r[5] = x[bx, {lin}]
        bcast[bx, {lin}] = shfl_idx(r[5], floormod(3 * ({lin}) + 1, 32), {width})
        edge_xor[bx, {lin}] = shfl_xor(r[5], {width}, {width})
        edge_down[bx, {lin}] = shfl_down(r[5], {width + 1}, {width})
        one_xor[bx, {lin}] = shfl_xor(r[5], 1, {width})
        edge_up[bx, {lin}] = shfl_up(r[5], 3, {width})
    """, block=(("ty", "y", 4), ("tx", "x", 16)))
    program = emulate(k)
    assert not any(isinstance(n, Shuffle) for n, _ in program.walk())
    x = np.random.default_rng(width).integers(-8, 8, (2, 64)).astype(np.float32)
    out = execute(k, {"x": x})
    groups = x.reshape(2, -1, width)
    np.testing.assert_allclose(out["all_xor"], np.repeat(groups.sum(-1), width, axis=-1).reshape(2, 64))
    np.testing.assert_allclose(out["scan"], np.cumsum(groups, axis=-1).reshape(2, 64))
    lanes = np.arange(64)
    for b in range(2):
        v = x[b].copy()
        for s in range(log):
            v = v + shfl_reference(v, "down", np.full(64, width >> (s + 1)), width)
        np.testing.assert_allclose(out["all_down"][b], v)
        np.testing.assert_allclose(out["all_down"][b, ::width], groups[b].sum(-1))
        np.testing.assert_array_equal(out["bcast"][b], shfl_reference(x[b], "idx", (3 * lanes + 1) % 32, width))
        np.testing.assert_array_equal(out["edge_xor"][b], shfl_reference(x[b], "xor", np.full(64, width), width))
        np.testing.assert_array_equal(out["edge_down"][b], shfl_reference(x[b], "down", np.full(64, width + 1), width))
        np.testing.assert_array_equal(out["one_xor"][b], shfl_reference(x[b], "xor", np.ones(64, int), width))
        np.testing.assert_array_equal(out["edge_up"][b], shfl_reference(x[b], "up", np.full(64, 3), width))


def test_shuffle_reference_model_matches_cuda_documentation():
    v = np.arange(32.0)
    assert list(shfl_reference(v, "xor", np.full(32, 1), 32)[:4]) == [1, 0, 3, 2]
    assert list(shfl_reference(v, "down", np.full(32, 2), 8)[4:8]) == [6, 7, 6, 7]  # own value past the group
    assert list(shfl_reference(v, "up", np.full(32, 1), 8)[8:11]) == [8, 8, 9]
    assert list(shfl_reference(v, "idx", np.full(32, 9), 8)[8:10]) == [9, 9]  # lane 9 % 8 of the group
    assert shfl_reference(v, "xor", np.full(32, 8), 8)[9] == 1  # an earlier group is readable
    assert shfl_reference(v, "xor", np.full(32, 8), 8)[1] == 1  # a later one is not: own value


# ----------------------------------------------------------------------------- grids, blocks, guards
def test_multi_dimensional_grid_and_block():
    k = make("ids", "out: f32[2, 3, 2, 2, 3, 4]\nflat: f32[12, 24]", """
        out[bz, by, bx, tz, ty, tx] = f32(tx + 4 * (ty + 3 * tz) + 100 * (bx + 2 * (by + 3 * bz)))
        for (i) in spatial(24) on tx + 4 * (ty + 3 * tz) {
          flat[bx + 2 * (by + 3 * bz), i] = f32(i + 1)
        }
    """, grid=(("bz", "z", 2), ("by", "y", 3), ("bx", "x", 2)), block=(("tz", "z", 2), ("ty", "y", 3), ("tx", "x", 4)))
    assert kernel_launch(k) == Launch((2, 3, 2), (4, 3, 2))
    out = execute(k, {})
    bz, by, bx, tz, ty, tx = np.indices((2, 3, 2, 2, 3, 4))
    np.testing.assert_array_equal(out["out"], tx + 4 * (ty + 3 * tz) + 100 * (bx + 2 * (by + 3 * bz)))
    np.testing.assert_array_equal(out["flat"], np.tile(np.arange(1, 25, dtype=np.float32), (12, 1)))


def expected_tasks(mapping, workers: range) -> list[int]:
    return [task[0] for w in workers for task in mapping.worker2task(w)]


def test_guards_of_mappings_smaller_and_larger_than_the_launch():
    k = make("guards", "a: f32[192]\nb: f32[3, 100]\nc: f32[3, 64]\nd: f32[3, 96]", """
        for (i) in spatial(150) on tx + 64 * bx {
          a[i] = f32(i + 1)
        }
        for (i) in spatial(100) on tx {
          b[bx, i] = f32(i + 1)
        }
        for (i) in spatial(16) * repeat(4) on tx {
          c[bx, i] = f32(tx + 1)
        }
        for (i) in repeat(3) * spatial(32) on tx {
          d[bx, i] = d[bx, i] + 1.0:f32
        }
    """, grid=(("bx", "x", 3),), block=(("tx", "x", 64),))
    guards = [n for n, _ in emulate(k).walk() if isinstance(n, If)]
    # a: 192 workers for 150 tasks; c: 16 of 64 threads work; d: 32 of 64; b needs none (64 of 100)
    assert [str(g.cond) for g in guards] == ["tx + 64 * bx < 150", "tx < 16", "tx < 32"]
    out = execute(k, {})
    want_a = np.zeros(192, np.float32)
    want_a[expected_tasks(spatial(150), range(192))] = np.arange(1, 151)
    np.testing.assert_array_equal(out["a"], want_a)
    want_b = np.zeros(100, np.float32)
    done = expected_tasks(spatial(100), range(64))
    want_b[done] = np.array(done) + 1
    np.testing.assert_array_equal(out["b"], np.tile(want_b, (3, 1)))
    assert (out["b"][:, 64:] == 0).all()  # workers 64..99 do not exist
    owner = np.zeros(64, np.float32)
    for w in range(64):
        for (task,) in (spatial(16) * repeat(4)).worker2task(w):
            owner[task] = w + 1
    np.testing.assert_array_equal(out["c"], np.tile(owner, (3, 1)))
    np.testing.assert_array_equal(out["d"], np.ones((3, 96), np.float32))


# ----------------------------------------------------------------------------- vector copies
def test_async_and_plain_vector_copies():
    k = make("copies", "x: f32[16, 64]\ny: f32[16, 64]\nh: f16[2, 64]\nhy: f16[2, 64]\n"
             "sh: f32[8, 64] shared\nr: f32[4] register\nq: f16[8] register", """
        for (i, j) in spatial(8, 16) on tx {
          sh[i, 4 * j] = async_vec4(x[bx * 8 + i, 4 * j])
        }
        commit_copies
        wait_copies 0
        barrier
        for (i, j) in spatial(8, 16) on tx {
          r[0] = vec4(sh[7 - i, 4 * j])
          for (v) in repeat(4) on 0 {
            r[v] = r[v] * 2.0:f32
          }
          y[bx * 8 + i, 4 * j] = vec4(r[0])
        }
        for (j) in spatial(8) on tx {
          q[0] = vec8(h[bx, 8 * j])
          hy[bx, 8 * j] = vec8(q[0])
        }
    """, block=(("tx", "x", 128),))
    x = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
    h = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float16)
    out = execute(k, {"x": x, "h": h})
    want = 2 * x.reshape(2, 8, 64)[:, ::-1].reshape(16, 64)
    np.testing.assert_allclose(out["y"], want, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(out["hy"], h)


# ----------------------------------------------------------------------------- a tiled matmul
def matmul_kernel(m: int, n: int, kk: int):
    """C = A @ B: 16x16 tiles of C per block, 8x8 threads of 2x2 each, K in steps of 8 through
    double-buffered shared tiles filled by asynchronous copies."""
    gm, gn, kt = math.ceil(m / 16), math.ceil(n / 16), math.ceil(kk / 8)

    def load(buf: str, tile: str) -> str:
        return f"""
            for (i, k) in repeat(2, 1) * spatial(8, 8) on tx + 8 * ty {{
              if (by * 16 + i < {m} && {tile} * 8 + k < {kk}) {{
                As[{buf}, i, k] = async_vec1(A[by * 16 + i, {tile} * 8 + k])
              }} else {{
                As[{buf}, i, k] = 0.0:f32
              }}
            }}
            for (k, j) in repeat(1, 2) * spatial(8, 8) on tx + 8 * ty {{
              if ({tile} * 8 + k < {kk} && bx * 16 + j < {n}) {{
                Bs[{buf}, k, j] = async_vec1(B[{tile} * 8 + k, bx * 16 + j])
              }} else {{
                Bs[{buf}, k, j] = 0.0:f32
              }}
            }}"""

    body = f"""
        for (i, j) in repeat(2, 2) on 0 {{
          acc[i, j] = 0.0:f32
        }}
        {textwrap.dedent(load("0", "0")).strip()}
        commit_copies
        for kt in [0, {kt}) {{
          if (kt + 1 < {kt}) {{
            {textwrap.indent(textwrap.dedent(load("floormod(kt + 1, 2)", "(kt + 1)")).strip(), "  " * 6)}
          }}
          commit_copies
          wait_copies 1
          barrier
          for kk in [0, 8) {{
            for (i, j) in repeat(2, 2) on 0 {{
              acc[i, j] += As[floormod(kt, 2), 2 * ty + i, kk] * Bs[floormod(kt, 2), kk, 2 * tx + j]
            }}
          }}
          barrier
        }}
        wait_copies 0
        for (i, j) in repeat(2, 2) on 0 {{
          if (by * 16 + 2 * ty + i < {m} && bx * 16 + 2 * tx + j < {n}) {{
            C[by * 16 + 2 * ty + i, bx * 16 + 2 * tx + j] = acc[i, j]
          }}
        }}
    """
    buffers = f"A: f32[{m}, {kk}]\nB: f32[{kk}, {n}]\nC: f32[{m}, {n}]\nAs: f32[2, 16, 8] shared\n" \
              f"Bs: f32[2, 8, 16] shared\nacc: f32[2, 2] register"
    return make(f"matmul_{m}_{n}_{kk}", buffers, body, grid=(("by", "y", gm), ("bx", "x", gn)),
                block=(("ty", "y", 8), ("tx", "x", 8)))


def check_matmul(m: int, n: int, kk: int, native: bool) -> None:
    rng = np.random.default_rng(m * 10000 + n * 100 + kk)
    a = rng.standard_normal((m, kk)).astype(np.float32)
    b = rng.standard_normal((kk, n)).astype(np.float32)
    out = execute(matmul_kernel(m, n, kk), {"A": a, "B": b}, native=native)
    np.testing.assert_allclose(out["C"], a.astype(np.float64) @ b, rtol=RTOL, atol=1e-4)


@pytest.mark.parametrize("m, n, kk, native", [(17, 100, 1, True), (1, 17, 100, False), (100, 1, 17, False)])
def test_double_buffered_tiled_matmul(m, n, kk, native):
    check_matmul(m, n, kk, native)


@pytest.mark.slow
@pytest.mark.parametrize("m, n, kk", list(itertools.product((1, 17, 100), repeat=3)))
def test_double_buffered_tiled_matmul_every_shape(m, n, kk):
    check_matmul(m, n, kk, native=False)


# ----------------------------------------------------------------------------- structure
def test_emulated_program_keeps_global_buffers_and_orders_locals():
    k = make("order", "z: f32[64]\nr: f32[1] register\na: f32[64]\nsh: f32[32] shared", """
        r[0] = z[bx * 32 + tx]
        sh[tx] = shfl_down(r[0], 1, 32)
        barrier
        a[bx * 32 + tx] = sh[31 - tx]
    """)
    program = emulate(k)
    assert [(b.name, b.scope) for b in program.buffers] == [
        ("z", "global"), ("a", "global"), ("r", "local"), ("sh", "local"), ("shfl_f32", "local")]
    assert program.name == "order" and not program.params
    assert all(lp.annotation.mode == "serial" for lp in program.loops())
    assert [lp.name for lp in program.body[0].body] == ["tx", "tx_1", "tx_2", "tx_3"]


def test_emulate_verifies_first():
    k = make("bad", "x: f32[64]", """
        if (tx < 16) {
          barrier
        }
    """)
    with pytest.raises(VerificationError, match="barrier is under if"):
        emulate(k)
