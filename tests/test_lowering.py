"""Lowering graph kernels to loop programs: compute rules (kiln.ir.ops.compute) and
kiln.passes.lower.

Every op's lowered program is run with the loop interpreter against the op's reference on
the cases of ``tests/test_ops.py``; structure tests pin the emitted loop nests as text
(inlining, epilogues, stages, nest merging); the fused kernels of the test models are
lowered, round-tripped, checked by ``kiln.loops.Schedule`` and compared kernel by kernel
with the reference executor; a few kernels go through ``to_c`` and the native runner.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import kiln.loops as kl
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph, Node, TensorType, builtin_ops, get_op
from kiln.ir.loops import Load, Loop, Reduce, Store, Var, loads_of
from kiln.backends.cpu.toolchain import c_compiler as compiler
from kiln.ir.ops.compute import INLINE_COST, LoweringError, reshape_index, sanitize
from kiln.passes.lower import LoweredKernel, fuse_nests, lower_graph_kernels, lower_node
from tests.test_ops import CASES, Case

F32 = DType.float32
NO_COMPUTE: dict[str, str] = {}
"""Ops without a compute definition, with the reason (``index`` with a bool mask has a rule
that raises, because its result shape depends on the data)."""
NO_COMPUTE |= {name: "no C math function in the loop IR (kiln.ir.loops.expr.MATH_FUNCS); the cpu backend "
                     "runs the scipy reference"
               for name in ("erfc", "erfinv", "lgamma", "polygamma", "i0", "i0e", "i1", "i1e", "erfcx", "ndtri",
                            "log_ndtr", "entr", "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1",
                            "modified_bessel_i0", "modified_bessel_i1", "modified_bessel_k0",
                            "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
                            "spherical_bessel_j0", "airy_ai", "frexp_exponent", "nextafter", "zeta", "igamma", "igammac",
                            "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
                            "legendre_polynomial_p",
                            *(f"{s}chebyshev_polynomial_{k}" for s in ("", "shifted_") for k in "tuvw"))}
NO_COMPUTE |= {"inv": "a matrix factorization, not a loop nest: numpy's LAPACK on both backends",
               "det": "a matrix factorization, not a loop nest: numpy's LAPACK on both backends"}
NO_COMPUTE |= {name: "a matrix factorization, not a loop nest: numpy/scipy's LAPACK on both backends"
               for name in ("cholesky", "svd", "eigh", "lu", "qr", "geqrf", "matrix_exp", "ldl", "ldl_solve")}
NO_COMPUTE |= {"triangular_solve": "a sequential substitution over rows, not a loop nest: numpy on both backends",
               "lu_permutation": "row interchanges applied in sequence: numpy on both backends"}
NO_COMPUTE |= {"custom_vjp": "a user's autograd.Function: the inline-custom-vjp pass replaces it by its forward "
                             "graph before lowering"}
NO_COMPUTE |= {name: "a collective: a torch.distributed library call (kiln/ir/ops/collectives.py), not a loop nest"
               for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}


def T(*shape: int, dtype: DType = F32) -> TensorType:
    return TensorType(tuple(shape), dtype)


def run_kernel(kernel: LoweredKernel, node: Node, operands) -> list[np.ndarray]:
    arrays = {name: np.asarray(a, order="C") for name, a in zip(kernel.inputs, operands)} | kernel.constants
    arrays |= {name: np.zeros(v.shape, v.dtype.numpy) for name, v in zip(kernel.outputs, node.outputs)}
    kl.run(kernel.program, {}, arrays)
    return [arrays[name] for name in kernel.outputs]


def check_program(kernel: LoweredKernel, node: Node) -> None:
    """Buffers carry the graph types; the text round-trips; the program is legal as emitted."""
    program = kernel.program
    for name, v in [*zip(kernel.inputs, node.inputs), *zip(kernel.outputs, node.outputs)]:
        buf = program.buffer(name)
        assert (buf.scope, buf.dtype, tuple(d.value for d in buf.shape)) == ("global", v.dtype, tuple(v.shape))
    named = set(kernel.inputs) | set(kernel.outputs) | set(kernel.constants)
    assert {b.name for b in program.buffers if b.scope == "global"} == named
    text = str(program)
    assert str(kl.parse(text)) == text
    verdict = kl.Schedule(program).verify()
    assert verdict, verdict.explanation


def assert_close(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
        return
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    with np.errstate(invalid="ignore"):
        diff = np.where(got == want, 0.0, np.abs(got - want))
    scale = max(np.max(np.abs(want[finite]), initial=0.0), 1e-30)
    assert np.max(diff[finite], initial=0.0) <= tol * scale, f"relative error {np.max(diff[finite]) / scale:.3g}"


# ------------------------------------------------------------------------- every op
def test_every_op_has_a_compute_definition():
    missing = sorted(name for name, op in builtin_ops().items() if op.compute is None and name not in NO_COMPUTE)
    assert not missing, f"ops without a compute definition: {missing}"


def _single_node(c: Case) -> Node:
    g = Graph("case")
    operands = [g.add_input(f"x{i}", TensorType(a.shape, DType.from_numpy(a.dtype))) for i, a in enumerate(c.inputs)]
    return g.add_node(c.op, operands, c.attrs)


@pytest.mark.parametrize("c", CASES, ids=repr)
def test_lowered_op_matches_its_reference(c: Case):
    if c.op in NO_COMPUTE:
        pytest.skip(NO_COMPUTE[c.op])
    node = _single_node(c)
    kernel = lower_node(node)
    check_program(kernel, node)
    (got,) = run_kernel(kernel, node, c.inputs)
    with np.errstate(all="ignore"):
        want = get_op(c.op).reference(*c.inputs, **node.attrs)
    low = any(a.dtype in (np.float16, ml_dtypes.bfloat16) for a in (*c.inputs, want))
    assert_close(got, np.asarray(want), 2e-2 if low else 1e-5)


def test_a_bool_mask_index_is_not_lowered():
    g = Graph()
    x, m = g.add_input("x", T(3, 4)), g.add_input("m", T(3, 4, dtype=DType.bool))
    picked = g.add_node("index", [x, m], {"dims": (0,)})
    g.op("neg", g.op("reshape", x, shape=(4, 3)))
    assert [k is None for k in lower_graph_kernels(g)] == [True, True, False]
    assert lower_graph_kernels(g, skip=lambda n: n is picked)[1] is not None
    with pytest.raises(LoweringError, match=r"symbolic shape f32\[nnz\].*specialize the graph"):
        lower_node(picked)


# -------------------------------------------------------------------- program shapes
def _fused(body: Graph, kind: str, names: list[str]) -> Node:
    g = Graph()
    operands = [g.add_input(v.name, v.type) for v in body.inputs]
    return g.add_node("fused", operands, {"template": kind, "body": body}, names=names)


def _lower_and_check(node: Node, operands: list[np.ndarray]) -> LoweredKernel:
    kernel = lower_node(node)
    check_program(kernel, node)
    want = node.op.reference(*operands, **node.attrs)
    want = want if isinstance(want, tuple) else (want,)
    for got, w in zip(run_kernel(kernel, node, operands), want):
        assert_close(got, w, 1e-5)
    return kernel


rng = np.random.default_rng(0)


def rand(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_an_elementwise_chain_is_one_statement():
    body = Graph("add_relu_scale")
    x, b = body.add_input("x", T(2, 3)), body.add_input("b", T(3))
    body.set_outputs([body.op("mul", body.op("relu", body.op("add", x, b)), body.add_constant(np.float32(2.0)))])
    kernel = _lower_and_check(_fused(body, "elementwise", ["out"]), [rand(2, 3), rand(3)])
    assert str(kernel.program) == """\
program add_relu_scale() {
  buffer x: f32[2, 3]
  buffer b: f32[3]
  buffer out: f32[2, 3]
  for i0 in [0, 2) {
    for i1 in [0, 3) {
      S0: out[i0, i1] = max(x[i0, i1] + b[i1], 0.0:f32) * 2.0:f32
    }
  }
}"""
    assert (kernel.inputs, kernel.outputs, kernel.template, kernel.constants) == (["x", "b"], ["out"], "elementwise", {})


def test_a_matmul_epilogue_runs_in_the_matmul_loop_nest():
    body = Graph("linear_relu")
    x, w, b = body.add_input("x", T(4, 8)), body.add_input("w", T(8, 5)), body.add_input("b", T(5))
    body.set_outputs([body.op("relu", body.op("add", body.op("matmul", x, w), b))])
    kernel = _lower_and_check(_fused(body, "matmul", ["y"]), [rand(4, 8), rand(8, 5), rand(5)])
    assert str(kernel.program) == """\
program linear_relu() {
  buffer x: f32[4, 8]
  buffer w: f32[8, 5]
  buffer b: f32[5]
  buffer y: f32[4, 5]
  buffer v0_acc: f32[4, 5] local
  for i0 in [0, 4) {
    for i1 in [0, 5) {
      S0: v0_acc[i0, i1] = 0.0:f32
      for r0 in [0, 8) {
        S1: v0_acc[i0, i1] += x[i0, r0] * w[r0, i1]
      }
      S2: y[i0, i1] = max(v0_acc[i0, i1] + b[i1], 0.0:f32)
    }
  }
}"""


def test_a_reduction_prologue_is_inlined_and_the_result_stored_directly():
    body = Graph("sum_exp")
    x = body.add_input("x", T(3, 4))
    body.set_outputs([body.op("sum", body.op("exp", x), dims=(1,))])
    kernel = _lower_and_check(_fused(body, "reduction", ["s"]), [rand(3, 4)])
    assert str(kernel.program) == """\
program sum_exp() {
  buffer x: f32[3, 4]
  buffer s: f32[3]
  for i0 in [0, 3) {
    S0: s[i0] = 0.0:f32
    for r0 in [0, 4) {
      S1: s[i0] += exp(x[i0, r0])
    }
  }
}"""


def test_a_permuted_reduction_result_is_written_in_place_with_its_axes_permuted():
    """``permute(max_pool2d(x))`` (a pooling whose reader wants it channels-last): the
    reduction writes the result buffer directly, axes permuted, with no local stage and no
    copy nest; a reduction result read again by another result keeps working."""
    body = Graph("pool_nhwc")
    x = body.add_input("x", T(1, 5, 7, 6))
    pooled = body.op("max_pool2d", x, kernel=[3, 3], stride=[2, 2], padding=[1, 1])
    body.set_outputs([body.op("permute", pooled, dims=[0, 2, 3, 1])])
    kernel = _lower_and_check(_fused(body, "reduction", ["out"]), [rand(1, 5, 7, 6)])
    assert [b.name for b in kernel.program.buffers] == ["x", "out"]
    stores = [s for s in kernel.program.statements() if isinstance(s, (Store, Reduce))]
    assert {s.buffer for s in stores} == {"out"}
    assert all(s.indices[-1] == Var(kernel.program.body[0].iterator) for s in stores)  # the channel loop

    body = Graph("pool_twice")
    x = body.add_input("x", T(2, 3, 4, 5))
    pooled = body.op("sum", x, dims=(3,))
    body.set_outputs([body.op("permute", pooled, dims=[2, 0, 1]), body.op("neg", pooled)])
    kernel = _lower_and_check(_fused(body, "reduction", ["out", "negated"]), [rand(2, 3, 4, 5)])
    assert [b.name for b in kernel.program.buffers] == ["x", "out", "negated"]


def test_softmax_stages_share_the_row_loop():
    g = Graph()
    node = g.add_node("softmax", [g.add_input("x", T(3, 7))], {"dim": -1}, names=["p"])
    kernel = _lower_and_check(node, [rand(3, 7) * 30])
    assert str(kernel.program) == """\
program softmax_p() {
  buffer x: f32[3, 7]
  buffer p: f32[3, 7]
  buffer p_max: f32[3] local
  buffer p_sum: f32[3] local
  for i0 in [0, 3) {
    S0: p_max[i0] = -inf:f32
    for r0 in [0, 7) {
      S1: p_max[i0] max= x[i0, r0]
    }
    S2: p_sum[i0] = 0.0:f32
    r0_1: for r0 in [0, 7) {
      S3: p_sum[i0] += exp(x[i0, r0] - p_max[i0])
    }
    for i1 in [0, 7) {
      S4: p[i0, i1] = exp(x[i0, i1] - p_max[i0]) / p_sum[i0]
    }
  }
}"""


@pytest.mark.parametrize("rows", [3, 4])
def test_nests_whose_cells_do_not_line_up_stay_apart(rows: int):
    """Column means then ``x - mean``: the mean's loop runs over columns, the consumer's
    outer loop over rows, so the nests are not merged (also when the extents are equal)."""
    body = Graph("center")
    x = body.add_input("x", T(rows, 4))
    body.set_outputs([body.op("sub", x, body.op("mean", x, dims=(0,), keepdim=True))])
    kernel = _lower_and_check(_fused(body, "reduction", ["c"]), [rand(rows, 4)])
    assert [type(n).__name__ for n in kernel.program.body] == ["Loop", "Loop"]


def test_fuse_nests_merges_only_when_each_iteration_reads_its_own_cells():
    def nest(it: str, stmt) -> Loop:
        return Loop(it, 0, 4, (stmt,))

    produce = nest("i", Store("t", (Var("i"),), Load("x", (Var("i"),))))
    same_cell = nest("j", Store("y", (Var("j"),), Load("t", (Var("j"),))))
    neighbour = nest("j", Store("y", (Var("j"),), Load("t", (3 - Var("j"),))))
    merged = fuse_nests([produce, same_cell])
    assert len(merged) == 1 and [s.buffer for s in merged[0].body] == ["t", "y"]
    assert merged[0].body[1].value == Load("t", (Var("i"),))
    assert len(fuse_nests([produce, neighbour])) == 2
    overwrite = nest("j", Reduce("x", (Var("j"),), "+", Load("t", (Var("j"),))))
    assert len(fuse_nests([produce, overwrite])) == 2  # the second writes what the first reads


def test_outputs_used_inside_are_stored_once_and_read_back():
    body = Graph("add_layer_norm")
    a, b = body.add_input("a", T(2, 6)), body.add_input("b", T(2, 6))
    total = body.op("add", a, b)
    body.set_outputs([total, body.op("layer_norm", total, normalized_rank=1)])
    kernel = _lower_and_check(_fused(body, "reduction", ["s", "n"]), [rand(2, 6), rand(2, 6)])
    readers = {st.buffer for st in kernel.program.statements()
               if any(ld.buffer in ("a", "b") for ld in loads_of(st.value))}
    assert readers == {"s"}
    assert not [b for b in kernel.program.buffers if b.scope == "local" and b.shape == (2, 6)]


def test_a_costly_value_used_twice_is_stored_and_a_cheap_one_is_inlined():
    body = Graph("shared")
    x = body.add_input("x", T(5))
    levels = [x]
    for _ in range(3):  # each level reads the previous one twice: element costs 10, 28, 64
        v = levels[-1]
        levels.append(body.op("mul", body.op("tanh", v), body.op("sigmoid", v)))
    assert 28 <= INLINE_COST < 64
    cheap = body.op("neg", x)
    top = levels[-1]
    body.set_outputs([body.op("add", body.op("mul", top, top), body.op("mul", cheap, cheap))])
    kernel = _lower_and_check(_fused(body, "elementwise", ["y"]), [rand(5)])
    assert [b.name for b in kernel.program.buffers if b.scope == "local"] == [sanitize(top.name)]


def test_constants_are_literals_or_buffers_and_repeated_operands_share_a_buffer():
    body = Graph("scale_shift")
    x = body.add_input("x", T(2, 20))
    squares = np.arange(20, dtype=np.float32) ** 2
    table = body.add_constant(squares, name="table")
    body.set_outputs([body.op("add", body.op("mul", x, x), body.op("mul", table, body.add_constant(np.float32(0.5))))])
    kernel = _lower_and_check(_fused(body, "elementwise", ["y"]), [rand(2, 20)])
    assert list(kernel.constants) == ["table"]
    np.testing.assert_array_equal(kernel.constants["table"], squares)
    assert "table[i1] * 0.5:f32" in str(kernel.program)

    g = Graph()
    v = g.add_input("v", T(3))
    node = g.add_node("mul", [v, v], {})
    kernel = _lower_and_check(node, [rand(3)] * 2)
    assert kernel.inputs == ["v", "v"] and [b.name for b in kernel.program.buffers].count("v") == 1


@pytest.mark.parametrize("dtype", [DType.int64, DType.int32, DType.float32])
def test_ramp_constants_are_index_arithmetic_not_loads(dtype):
    # a folded arange (a one-hot's positions) as a fused operand and inside the body: the
    # kernel computes start + step * i instead of loading it, with the same results
    from kiln.ir.ops.ramp import ramp_of

    g = Graph()
    target = g.add_input("target", T(7, 1, dtype=DType.int64))
    grad = g.add_input("grad", T(7, 1))
    positions = g.add_constant(np.arange(1000, dtype=np.int64).reshape(1, 1000), name="positions")
    body = Graph("onehot")
    t, gr, p = (body.add_input(n, v.type) for n, v in (("t", target), ("g", grad), ("p", positions)))
    ramp = body.add_constant((5 - 3 * np.arange(1000)).astype(dtype.numpy).reshape(1000, 1).T, name="ramp")
    hot = body.op("where", body.op("eq", t, p), gr, body.add_constant(np.float32(0.0)))
    body.set_outputs([body.op("add", hot, body.op("cast", ramp, dtype=DType.float32))])
    node = g.add_node("fused", [target, grad, positions], {"body": body, "template": "elementwise"})
    operands = [np.random.default_rng(0).integers(0, 1000, (7, 1)), rand(7, 1), positions.data]
    kernel = _lower_and_check(node, operands)
    assert not kernel.constants and "positions[" not in str(kernel.program) and "ramp" not in str(kernel.program)
    assert ramp_of(np.arange(4).reshape(2, 2), DType.int64) is None  # two long axes
    assert ramp_of(np.array([0, 1, 3]), DType.int64) is None
    assert ramp_of(np.array([0.5, 1.5]), DType.float32) is None  # not integers
    assert ramp_of(np.array([[9], [7], [5]]), DType.int32) == (0, 9, -2)


def test_buffer_names_are_sanitized_graph_value_names():
    assert [sanitize(n) for n in ["0", "fc1.bias", "int", "exp", "i0", "r12", "x_1", "a.b.c"]] == [
        "v0", "fc1_bias", "int_", "exp_", "i0_", "r12_", "x_1", "a_b_c"]
    g = Graph()
    a, b = g.add_input("fc.w", T(2)), g.add_input("fc_w", T(2))
    kernel = lower_node(g.add_node("add", [a, b], {}, names=["for"]))
    assert (kernel.inputs, kernel.outputs) == (["fc_w", "fc_w_1"], ["for_"])


def test_reshape_splits_and_merges_axes_with_floordiv_and_floormod():
    from kiln.ir.loops import format_expr

    index = (Var("i0"), Var("i1"), Var("i2"))
    assert [format_expr(e) for e in reshape_index(index, (2, 3, 4), (6, 4))] == ["3 * i0 + i1", "i2"]
    assert [format_expr(e) for e in reshape_index(index[:1], (24,), (2, 12))] == ["floordiv(i0, 12)",
                                                                                   "floormod(i0, 12)"]
    assert [format_expr(e) for e in reshape_index(index[:2], (4, 6), (6, 4))] == [
        "floordiv(6 * i0 + i1, 4)", "floormod(6 * i0 + i1, 4)"]


# ------------------------------------------------------------------------- models
_BUDGET = 200_000
"""Statement instances a kernel may have to run in the interpreter; larger kernels are
checked structurally and a few of them natively."""


def _instances(program: kl.Program) -> int:
    total = 0
    for node, loops in program.walk():
        if isinstance(node, (Store, Reduce)):
            n = 1
            for lp in loops:
                n *= (lp.upper.value - lp.lower.value) if isinstance(lp.upper, kl.Const) and isinstance(
                    lp.lower, kl.Const) else 64
            total += n
    return total


def _all_values(graph: Graph, inputs, params) -> dict:
    """Every value of ``graph`` computed by the reference executor."""
    clone, vmap = graph.clone_with_map()
    results = [v for n in clone.nodes for v in n.outputs]
    clone.set_outputs(results)
    original = {new: old for old, new in vmap.items()}
    env = {original[v]: a for v, a in zip(results, run_graph(clone, inputs, params))}
    env |= dict(zip(graph.inputs, inputs)) | dict(zip(graph.params, params))
    return env | {c: c.data for c in graph.constants}


@pytest.fixture(scope="module", params=["mlp", "gpt2", "bert", "resnet18"])
def model_kernels(request):
    from kiln.frontends.torch.capture import capture
    from kiln.passes import default_pipeline
    from tests.models import MODELS

    build, inputs_fn = MODELS[request.param]
    args, kwargs = inputs_fn()
    captured = capture(build(), args, kwargs)
    graph = default_pipeline().run(captured.graph).graph
    inputs = [a.numpy() for a in args] + [v.numpy() for v in kwargs.values()]
    params = [captured.params[p.name].detach().numpy() for p in graph.params]
    env = _all_values(graph, inputs, params)
    return request.param, graph, lower_graph_kernels(graph), env


def test_model_kernels_lower_and_match_the_reference_executor(model_kernels):
    name, graph, kernels, env = model_kernels
    fused = [(n, k) for n, k in zip(graph.nodes, kernels) if n.op_name == "fused"]
    assert fused and all(k is not None for _, k in fused)
    assert all(k is None for n, k in zip(graph.nodes, kernels) if n.op.has("view"))
    ran = 0
    for node, kernel in zip(graph.nodes, kernels):
        if kernel is None:
            continue
        check_program(kernel, node)
        if _instances(kernel.program) > _BUDGET:
            continue
        for got, v in zip(run_kernel(kernel, node, [env[v] for v in node.inputs]), node.outputs):
            assert_close(got, env[v], 1e-4)
        ran += 1
    print(f"\n{name}: {sum(k is not None for k in kernels)} kernels lowered, {ran} run in the interpreter")
    assert ran >= min(3, len(fused))


def test_model_kernels_compile_to_c_and_match(model_kernels):
    if compiler() is None:
        pytest.skip("no C compiler")
    _, graph, kernels, env = model_kernels
    pairs = [(n, k) for n, k in zip(graph.nodes, kernels) if k is not None]
    picked = {k.template: (n, k) for n, k in sorted(pairs, key=lambda p: -_instances(p[1].program))}
    for node, kernel in list(picked.values())[:2]:
        native = kl.compile_c(kernel.program)
        arrays = {n: np.asarray(env[v], order="C") for n, v in zip(kernel.inputs, node.inputs)} | kernel.constants
        arrays |= {n: np.zeros(v.shape, v.dtype.numpy) for n, v in zip(kernel.outputs, node.outputs)}
        native({}, arrays)
        for n, v in zip(kernel.outputs, node.outputs):
            assert_close(arrays[n], env[v], 1e-4)


def test_torch_is_the_ground_truth_of_the_reference_used_above():
    """The per-op references these tests compare against are themselves checked against
    PyTorch in tests/test_ops.py; spot-check one lowered kernel against torch directly."""
    x = rand(2, 5, 6)
    g = Graph()
    node = g.add_node("layer_norm", [g.add_input("x", T(2, 5, 6))], {"normalized_rank": 1})
    (got,) = run_kernel(lower_node(node), node, [x])
    want = torch.nn.functional.layer_norm(torch.from_numpy(x), (6,)).numpy()
    assert_close(got, want, 1e-5)


def test_the_docs_example_runs_and_prints_the_documented_program(capsys):
    """The first example of "Lowering graph kernels" in docs/loops.md, and its output."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "loops.md").read_text()
    section = text[text.index("## Lowering graph kernels"):]
    code, printed = re.findall(r"^```(?:python)?\n(.*?)^```", section, re.DOTALL | re.MULTILINE)[:2]
    exec(compile(code, "docs/loops.md", "exec"), {})
    assert capsys.readouterr().out == printed
