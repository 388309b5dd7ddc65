"""The CUDA kernel generators (``kiln.backends.cuda.kernels``) in host emulation.

Every plan's kernels are verified (``verify_kernel``), race-checked (``check_races``),
emulated (``emulate``) and run in order in the numpy interpreter; the results are compared
with the lowered program itself run in the interpreter.  Graphs are built directly (no
capture), so each case costs milliseconds of planning plus its emulation.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from kiln.backends.cuda.kernels import GpuPlan, KernelOptions, plan_kernels
from kiln.backends.cuda.kernels.matmul import SPACE, MatmulConfig, example_kernel, fits, matmul_configs
from kiln.ir import DType, Graph, TensorType
from kiln.ir.errors import ScheduleError
from kiln.ir.loops import Barrier, Loop, Shuffle, VectorCopy, parse_program
from kiln.ir.loops.emulate import emulate
from kiln.ir.loops.gpu import kernel_launch, verify_kernel
from kiln.ir.loops.interp import run
from kiln.ir.poly.races import check_races
from kiln.passes.lower import LoweredKernel, lower_node
from kiln.passes.pipeline import default_pipeline

F32, F16, BF16 = DType.float32, DType.float16, DType.bfloat16
GENERIC = KernelOptions(kinds=())
CONV = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
SMALL = SPACE[-1]  # the 8 x 16 tile: cheap to emulate


# ============================================================================ helpers
def _shape(buffer) -> tuple[int, ...]:
    return tuple(int(d.value) for d in buffer.shape)


def _inputs(lowered: LoweredKernel, seed: int = 0, bool_density: float = 0.7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for b in lowered.program.buffers:
        if b.scope != "global":
            continue
        shape = _shape(b)
        if b.name in lowered.constants:
            arrays[b.name] = lowered.constants[b.name].copy()
        elif b.name in lowered.inputs and b.dtype == DType.bool:
            arrays[b.name] = rng.random(shape) < bool_density
        elif b.name in lowered.inputs:
            arrays[b.name] = rng.standard_normal(shape).astype(b.dtype.numpy)
        else:
            arrays[b.name] = np.full(shape, 7, b.dtype.numpy)  # outputs: garbage to overwrite
    return arrays


def run_plan(plan: GpuPlan, arrays: dict[str, np.ndarray]) -> None:
    """Verify, race-check and emulate every kernel of ``plan``, in order, on ``arrays``."""
    scratch = {s.name: np.zeros(_shape(s), s.dtype.numpy) for s in plan.scratch}
    pool = {**arrays, **scratch}
    for k in plan.kernels:
        verify_kernel(k.program)
        check_races(k.program)
        program = emulate(k.program)
        run(program, {}, {b.name: pool[b.name] for b in program.buffers if b.scope == "global"})


def check(lowered: LoweredKernel, options: KernelOptions | None = None, node=None, arrays=None,
          rtol: float = 1e-4, atol: float = 1e-5) -> GpuPlan:
    """Plan ``lowered``, check the plan's contract, run it and compare with the lowered
    program; returns the plan."""
    plan = plan_kernels(lowered, template=lowered.template, node=node, options=options)
    check_contract(lowered, plan)
    arrays = _inputs(lowered) if arrays is None else arrays
    expected = {k: v.copy() for k, v in arrays.items()}
    run(lowered.program, {}, expected)
    got = {k: v.copy() for k, v in arrays.items()}
    run_plan(plan, got)
    for name in lowered.outputs:
        np.testing.assert_allclose(got[name].astype(np.float64), expected[name].astype(np.float64),
                                   rtol=rtol, atol=atol, err_msg=f"output {name} of {plan.kinds()}")
    return plan


def check_contract(lowered: LoweredKernel, plan: GpuPlan) -> None:
    program = lowered.program
    assert plan.arguments == tuple(b.name for b in program.buffers if b.scope == "global")
    assert plan.constants.keys() == lowered.constants.keys()
    declared = {b.name: b for b in program.buffers}
    scratch = {s.name: s for s in plan.scratch}
    assert not set(scratch) & set(plan.arguments)
    names = [k.name for k in plan.kernels]
    assert len(set(names)) == len(names) and all(n.isidentifier() for n in names)
    for k in plan.kernels:
        assert str(parse_program(str(k.program))) == str(k.program)
        for b in k.program.buffers:
            if b.scope != "global":
                continue
            assert b.name in plan.arguments or b.name in scratch, (k.name, b.name)
            ref = scratch.get(b.name) or declared[b.name]
            assert (_shape(b), b.dtype) == (_shape(ref), ref.dtype)


def lowered(graph: Graph, passes: bool = True) -> list[tuple[LoweredKernel, object]]:
    """The lowered programs of ``graph``'s non-view nodes (after the default passes)."""
    g = default_pipeline()(graph).graph if passes else graph
    return [(lower_node(n), n) for n in g.nodes if not n.op.has("view")]


def single(op: str, types: list[tuple[tuple[int, ...], DType]], attrs=None) -> tuple[LoweredKernel, object]:
    g = Graph()
    xs = [g.add_input(f"x{k}", TensorType(shape, dt)) for k, (shape, dt) in enumerate(types)]
    node = g.add_node(op, xs, attrs or {}, names=["y"])
    return lower_node(node), node


def matmul_graph(M: int, N: int, K: int, dtype: DType = F32, bias: bool = False,  # noqa: N803
                 gelu: bool = False) -> Graph:
    g = Graph()
    a = g.add_input("a", TensorType((M, K), dtype))
    b = g.add_input("b", TensorType((K, N), dtype))
    y = g.add_node("matmul", [a, b], {}, names=["y"]).output
    if bias:
        c = g.add_input("c", TensorType((N,), dtype))
        y = g.add_node("add", [y, c], {}, names=["z"]).output
    if gelu:
        y = g.add_node("gelu", [y], {}, names=["g"]).output
    g.set_outputs([y])
    return g


def kernel_nodes(plan: GpuPlan, kind) -> list:
    return [n for k in plan.kernels for n, _ in k.program.walk() if isinstance(n, kind)]


# ============================================================================ generic
def test_generic_accepts_every_shape_of_program():
    """Forced generic: a fused matmul + bias + gelu, a softmax (three stages), a padded
    convolution (guards in the body), cumsum (bounds depending on the band), a full sum
    (no parallel loop: one thread), and an attention with its scores in scratch."""
    cases = [lowered(matmul_graph(5, 6, 7, bias=True, gelu=True))[0][0],
             single("softmax", [((3, 10), F32)], {"dim": -1})[0],
             single("conv", [((1, 3, 6, 6), F32), ((4, 3, 3, 3), F32)], CONV)[0],
             single("cumsum", [((4, 9), F32)], {"dim": 1})[0],
             single("sum", [((7, 5), F32)])[0],
             single("scaled_dot_product_attention", [((1, 2, 5, 8), F32)] * 3, {"is_causal": True})[0]]
    for case in cases:
        plan = check(case, GENERIC)
        assert set(plan.kinds()) == {"generic"}
    serial = plan_kernels(cases[4], template="", options=GENERIC)
    assert [kernel_launch(k.program).threads for k in serial.kernels] == [1]
    attention = plan_kernels(cases[5], template="", options=GENERIC)
    assert [s.name for s in attention.scratch] == ["y_scores"]


def test_generic_band_is_proved_not_assumed():
    """A prefix sum carries a dependence on its only loop: one thread runs it.  In the
    second nest (lower bound 2, step 2) only the outer loop is parallel: the band stops
    there, the inner loop runs serially per task."""
    program = parse_program("""
program scan() {
  buffer x: f32[300]
  buffer y: f32[300]
  buffer z: f32[300, 3]
  for i in [1, 300) {
    S0: y[i] = y[i - 1] + x[i]
  }
  for j in [2, 300) step 2 {
    for k in [1, 3) {
      S1: z[j, k] = z[j, k - 1] * 2.0:f32 + x[j]
    }
  }
}""")
    kernel = LoweredKernel(program, ["x", "y"], ["y", "z"], "opaque")
    plan = check(kernel, KernelOptions(kinds=(), block_size=64, max_blocks=2))
    serial, parallel = (kernel_launch(k.program) for k in plan.kernels)
    assert serial.threads * serial.blocks == 1
    # k carries a dependence, j does not: 149 tasks of j over 128 workers, k serial in each
    assert (parallel.grid, parallel.block) == ((2, 1, 1), (64, 1, 1))
    assert "repeat(2) * spatial(128)" in str(plan.kernels[1].program)


def test_generic_keeps_per_task_temporaries_in_registers():
    kernel, _ = single("layer_norm", [((6, 10), F32), ((10,), F32), ((10,), F32)], {"normalized_rank": 1})
    plan = check(kernel, GENERIC)
    scopes = {b.name: b.scope for b in plan.kernels[0].program.buffers}
    assert scopes["y_sum"] == "register" and not plan.scratch


# ============================================================================ matmul
MATMUL_SIZES = (1, 17, 100, 257)
FAST_MATMUL = [(1, 17, 100), (17, 100, 1), (100, 1, 257), (257, 17, 17), (17, 257, 100)]


@pytest.mark.parametrize("mnk", FAST_MATMUL)
def test_matmul_ragged(mnk):
    (kernel, _), = lowered(matmul_graph(*mnk), passes=False)
    plan = check(kernel, KernelOptions(matmul=SMALL))
    if min(mnk) > 1:
        assert plan.kinds() == ("matmul",)


@pytest.mark.slow
@pytest.mark.parametrize("mnk", [s for s in itertools.product(MATMUL_SIZES, repeat=3) if s not in FAST_MATMUL])
def test_matmul_ragged_all(mnk):
    (kernel, _), = lowered(matmul_graph(*mnk), passes=False)
    check(kernel, KernelOptions(matmul=SMALL))


def test_matmul_tiles_double_buffered_with_epilogue():
    """A fused bias + gelu epilogue, the default tile choice and a 64 x 64 tile: shared
    tiles ``[2, BK, ...]``, one barrier before the K loop and one per step."""
    (kernel, _), = lowered(matmul_graph(33, 40, 50, bias=True, gelu=True))
    for options in (None, KernelOptions(matmul=SPACE[1])):
        plan = check(kernel, options)
        assert plan.kinds() == ("matmul",)
        program = plan.kernels[0].program
        shared = [b for b in program.buffers if b.scope == "shared"]
        assert [_shape(b)[0] for b in shared] == [2, 2]
        k_loop = next(n for n, _ in program.walk() if isinstance(n, Loop) and n.iterator == "kt")
        assert [type(n) for n in k_loop.body].count(Barrier) == 1
        assert len(kernel_nodes(plan, Barrier)) == 2
        assert not plan.scratch  # the accumulator lives in registers


def test_matmul_batched_transposed_half():
    """bmm against a transposed operand (index arithmetic in the prologue) and f16 operands."""
    g = Graph()
    a = g.add_input("a", TensorType((3, 9, 20), F16))
    b = g.add_input("b", TensorType((3, 11, 20), F16))
    bt = g.add_node("permute", [b], {"dims": [0, 2, 1]}, names=["bt"]).output
    y = g.add_node("matmul", [a, bt], {}, names=["y"]).output
    g.set_outputs([y])
    kernels = [kn for kn in lowered(g) if kn[0].outputs == ["y"]]
    (kernel, _), = kernels
    plan = check(kernel, KernelOptions(matmul=SPACE[-2]), rtol=2e-3, atol=2e-3)
    assert plan.kinds() == ("matmul",) and kernel_launch(plan.kernels[0].program).grid[2] == 3


def test_matmul_recognizer_refuses_what_it_cannot_tile():
    """``acc += a[i, k] * b[k, j] * c[i, j]``: a factor uses both i and j -- generic, and right."""
    program = parse_program("""
program odd() {
  buffer a: f32[9, 5]
  buffer b: f32[5, 7]
  buffer c: f32[9, 7]
  buffer y: f32[9, 7]
  for i in [0, 9) {
    for j in [0, 7) {
      S0: y[i, j] = 0.0:f32
      for k in [0, 5) {
        S1: y[i, j] += a[i, k] * b[k, j] * c[i, j]
      }
    }
  }
}""")
    plan = check(LoweredKernel(program, ["a", "b", "c"], ["y"], "matmul"))
    assert "matmul" not in plan.kinds()


def test_matmul_configs_fit_and_are_race_free():
    configs = matmul_configs(257, 100, 17, checked=True)
    assert set(configs) == set(SPACE) and all(fits(c) for c in configs)
    assert matmul_configs(4096, 4096, 4096)[0] == SPACE[0]  # big problems: the big tile
    assert not fits(MatmulConfig((4, 4), (4, 4), (4, 4), 16))  # 256 accumulators per thread


def test_matmul_without_its_barriers_races():
    """The race checker sees the double buffer: dropping the per-step barrier is a race."""
    kernel = example_kernel(SMALL, 17, 17, 40).program

    def drop(nodes):
        out = []
        for n in nodes:
            if isinstance(n, Loop):
                body = drop(n.body)
                if n.iterator == "kt":
                    body = tuple(x for x in body if not isinstance(x, Barrier))
                n = replace(n, body=body)
            out.append(n)
        return tuple(out)

    broken = kernel.replace(body=drop(kernel.body))
    with pytest.raises(ScheduleError, match="race"):
        check_races(broken)


# ============================================================================ rows
ROW_LENGTHS = (1, 31, 33, 1000)


@pytest.mark.parametrize("length", ROW_LENGTHS)
def test_rows_softmax_layer_norm(length):
    rows = 3 if length == 1000 else 9
    for op, types, attrs in (
            ("softmax", [((rows, length), F32)], {"dim": -1}),
            ("layer_norm", [((rows, length), F32), ((length,), F32), ((length,), F32)],
             {"normalized_rank": 1})):
        kernel, _ = single(op, types, attrs)
        plan = check(kernel)
        if length == 1:
            continue  # a one-element row has no reduction loop left
        assert plan.kinds() == ("rows",) and kernel_nodes(plan, Shuffle)
        regs = [b for b in plan.kernels[0].program.buffers if b.name.startswith("x0_row")]
        assert regs, "the row is read once, into registers"


@pytest.mark.parametrize("op,attrs", [("sum", {"dims": [1]}), ("amax", {"dims": [1]}), ("log_softmax", {"dim": 1}),
                                      ("rms_norm", {"normalized_rank": 1}), ("argmax", {"dim": 1})])
def test_rows_reductions(op, attrs):
    types = [((5, 33), F32)]
    kernel, _ = single(op, types, attrs)
    plan = check(kernel)
    assert "rows" in plan.kinds()


def test_rows_full_reduction_and_block_mode():
    """A sum of everything is one row (block mode: shared slots and a barrier)."""
    kernel, _ = single("sum", [((40, 50), F32)])
    plan = check(kernel, rtol=1e-4, atol=1e-4)
    assert plan.kinds() == ("rows",) and kernel_nodes(plan, Barrier)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_rows_half(dtype):
    kernel, _ = single("softmax", [((4, 33), dtype)], {"dim": -1})
    tol = 1e-2 if dtype == BF16 else 2e-3
    assert check(kernel, rtol=tol, atol=tol).kinds() == ("rows",)


def test_rows_leave_column_reductions_to_threads():
    """Summing many columns down a strided axis: one thread per column reads coalesced."""
    kernel, _ = single("sum", [((6, 1500), F32)], {"dims": [0]})
    assert check(kernel).kinds() == ("generic",)


# ============================================================================ pointwise
def _pointwise(numel_shape, dtype=F32):
    g = Graph()
    x = g.add_input("x", TensorType(numel_shape, dtype))
    b = g.add_input("b", TensorType(numel_shape[-1:], dtype))
    m = g.add_node("mul", [x, x], {}, names=["m"]).output
    s = g.add_node("add", [m, b], {}, names=["s"]).output
    y = g.add_node("relu", [s], {}, names=["y"]).output
    g.set_outputs([y])
    (kernel, _), = lowered(g)
    return kernel


@pytest.mark.parametrize("shape", [(1,), (1000,), (4099,), (6, 40), (5, 9)])
def test_pointwise(shape):
    """Vectors of 4 along the last axis: rows of a multiple of 4, or one axis with a scalar
    tail (4099 = 1024 vectors + 3); (5, 9) has unaligned rows: scalar."""
    plan = check(_pointwise(shape))
    vectors = kernel_nodes(plan, VectorCopy)
    if shape[-1] >= 4 and (shape[-1] % 4 == 0 or len(shape) == 1):
        assert plan.kinds() == ("pointwise",) and {v.width for v in vectors} == {4} and len(vectors) == 3
    else:
        assert not vectors


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_pointwise_half(dtype):
    plan = check(_pointwise((5, 64), dtype), rtol=1e-2, atol=1e-2)
    assert kernel_nodes(plan, VectorCopy)


def test_pointwise_respects_alignment():
    kernel = _pointwise((1000,))
    plan = check(kernel, KernelOptions(alignment={"x": 4}))
    copies = kernel_nodes(plan, VectorCopy)
    assert copies and all("x" not in (c.src, c.dst) for c in copies)


# ============================================================================ attention
def _sdpa(q, k, mask=None, causal=False, dtype=F32):
    g = Graph()
    xs = [g.add_input("q", TensorType(q, dtype)), g.add_input("k", TensorType(k, dtype)),
          g.add_input("v", TensorType(k, dtype))]
    if mask is not None:
        xs.append(g.add_input("mask", TensorType(*mask)))
    node = g.add_node("scaled_dot_product_attention", xs, {"is_causal": causal}, names=["o"])
    return lower_node(node), node


@pytest.mark.parametrize("case", ["plain", "causal", "bool", "float", "half"])
def test_attention(case):
    q, k = (2, 2, 37, 16), (2, 2, 41, 16)
    if case == "bool":
        kernel, node = _sdpa(q, k, mask=((37, 41), DType.bool))
        arrays = _inputs(kernel)
        arrays["mask"][5] = False  # a fully masked row gives zeros
    else:
        kernel, node = _sdpa(q, k, mask=((2, 1, 41), F32) if case == "float" else None,
                             causal=case == "causal", dtype=F16 if case == "half" else F32)
        arrays = None
    tol = 2e-3 if case == "half" else 1e-4
    plan = check(kernel, KernelOptions(attention_block=16), node=node, arrays=arrays, rtol=tol, atol=tol)
    assert plan.kinds() == ("attention",) and not plan.scratch
    if case == "bool":
        run_plan(plan, arrays)
        assert np.all(arrays["o"][:, :, 5] == 0) and not np.isnan(arrays["o"]).any()


def test_attention_tiles_fit_shared_memory():
    kernel, node = _sdpa((1, 1, 3, 256), (1, 1, 3, 256))
    plan = plan_kernels(kernel, template="", node=node)
    shared = sum(math.prod(_shape(b)) * b.dtype.itemsize for b in plan.kernels[0].program.buffers
                 if b.scope == "shared")
    assert plan.kinds() == ("attention",) and shared <= 48 * 1024


# ============================================================================ every op
def test_every_op_case_plans_and_matches():
    """Each op case of ``tests/test_ops.py`` (real operands: valid indices, masks, windows)
    as a single-node program: planned with every kind allowed, emulated, and compared with
    its lowered program -- generality of the recognizers and of the generic fallback."""
    from tests.test_lowering import NO_COMPUTE, _single_node
    from tests.test_ops import CASES

    kinds: set[str] = set()
    for c in CASES:
        if c.op in NO_COMPUTE:
            continue
        node = _single_node(c)
        kernel = lower_node(node)
        arrays = _inputs(kernel)
        for name, a in zip(kernel.inputs, c.inputs):
            arrays[name] = np.asarray(a).astype(arrays[name].dtype).reshape(arrays[name].shape)
        half = any(np.asarray(a).dtype in (np.float16, BF16.numpy) for a in c.inputs)
        tol = 2e-2 if half else 1e-4
        try:
            with np.errstate(all="ignore"):
                plan = check(kernel, node=node, arrays=arrays, rtol=tol, atol=tol / 10)
        except AssertionError as e:
            raise AssertionError(f"{c!r}: {e}") from None
        kinds |= set(plan.kinds())
    assert kinds == {"generic", "pointwise", "rows", "matmul", "attention"}
