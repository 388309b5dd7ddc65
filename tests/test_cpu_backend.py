"""The native cpu backend: models against eager, each kernel kind against the reference
backend on odd shapes, memory plan, thread safety, hostile names, implementation choice."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import kiln
import kiln.ir as ir
from kiln.backends import get_backend
from kiln.backends.cpu.gemm import blas_symbols
from kiln.backends.common.memory_plan import BufferRequest, check_plan, plan_memory
from kiln.passes import default_pipeline
from kiln.runtime import torch_dtype

import kernel_graphs
from models import MODELS, first_tensor

REL_TOL = 1e-4


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Every build in this file uses a private compile cache."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kiln-cache"))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.double().abs().max().item(), 1e-12) if want.numel() else 1.0
    return (got.double() - want.double()).abs().max().item() / scale if want.numel() else 0.0


# ------------------------------------------------------------------ models


@pytest.mark.parametrize("name", list(MODELS))
def test_models_match_eager(name):
    builder, inputs_fn = MODELS[name]
    model = builder()
    args, kwargs = inputs_fn()
    with torch.no_grad():
        want = first_tensor(model(*args, **kwargs))
    compiled = kiln.compile(model, args, backend="cpu", example_kwargs=kwargs)
    info = compiled.executable.info
    assert info["kernels"] > 0 and not info["fallbacks"], info["fallbacks"]
    assert rel_err(first_tensor(compiled(*args, **kwargs)), want) <= REL_TOL
    torch._dynamo.reset()
    optimized = torch.compile(model, backend="kiln", options={"backend": "cpu"})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kiln.KilnFallbackWarning)
        got = first_tensor(optimized(*args, **kwargs))
    assert rel_err(got, want) <= REL_TOL


# ------------------------------------------------------------------ kernel kinds


def random_inputs(graph: ir.Graph, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for v in (*graph.inputs, *graph.params):
        shape = tuple(v.shape)
        if v.dtype.is_floating:
            out.append(torch.randn(shape, generator=g).to(torch_dtype(v.dtype)))
        elif v.dtype == ir.DType.bool:
            out.append(torch.rand(shape, generator=g) > 0.3)
        else:
            out.append(torch.randint(0, 3, shape, generator=g).to(torch_dtype(v.dtype)))
    return out


def check_against_reference(text: str, seed: int = 0, **options):
    """Fuse ``text`` with the default pipeline, build it with cpu, compare with the reference
    backend on the unfused graph; returns the executable."""
    graph = ir.parse(text)
    fused = default_pipeline().run(graph).graph
    exe = get_backend("cpu").build(fused, options)
    ref = get_backend("reference").build(graph, {"float64": True})
    args = random_inputs(graph, seed)
    for got, want in zip(exe(args), ref(args)):
        assert got.shape == want.shape
        assert rel_err(got, want) <= REL_TOL, (text, options)
    assert not exe.info["fallbacks"], exe.info["fallbacks"]
    return exe


ODD_SHAPES = [(1,), (3, 17), (17, 1000), (2, 3, 17)]


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_elementwise_kernels(shape):
    info = check_against_reference(kernel_graphs.elementwise(shape)).info
    assert info["kernels"] == 1


def test_exp_is_faithful_over_the_float_range():
    # generated kernels call kiln's own expf (kiln/backends/cpu/fast_math.py): within 1 ulp
    # of exp in double on [-87, 88.72], zero below (where the true result is under 1.7e-38),
    # inf above, NaN kept
    big = torch.finfo(torch.float32).max
    special = [-math.inf, math.inf, math.nan, -big, big, 88.7228, 88.72284, 89.0, -87.0, -87.01, -100.0,
               -104.0, 0.0, -0.0, 1e-30, -1e-30]
    x = torch.cat([torch.linspace(-87.0, 88.72, 100_003), torch.randn(4099) * 30, torch.tensor(special)])
    y = kiln.compile(lambda t: torch.exp(t), (x,))(x)
    ref = torch.exp(x.double())
    normal = (x >= -87.0) & (ref <= big)
    ulp = torch.exp2(torch.floor(torch.log2(ref[normal])) - 23)
    assert ((y[normal].double() - ref[normal]).abs() <= ulp).all()
    low = x < -87.0
    assert (y[low] == 0).all() and (ref[low] < 1.7e-38).all()
    assert torch.isinf(y[ref > big]).all() and torch.isnan(y[x.isnan()]).all()
    half = torch.linspace(-90.0, 88.0, 1001).to(torch.bfloat16)
    torch.testing.assert_close(kiln.compile(lambda t: torch.exp(t), (half,))(half), torch.exp(half), rtol=8e-3, atol=1e-37)


def test_masked_softmax_of_lowest_scores_matches_eager():
    # a causal mask applied with the lowest float (as transformers do) puts arguments far
    # below exp's range in most vectors of the softmax kernel
    lowest = torch.finfo(torch.float32).min
    mask = torch.ones(37, 37, dtype=torch.bool).tril()

    def f(s):
        p = torch.softmax(torch.where(mask, s, lowest), dim=-1)
        return torch.where(mask, p, 0.0)

    s = torch.randn(2, 3, 37, 37) * 4
    torch.testing.assert_close(kiln.compile(f, (s,))(s), f(s), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", [(3, 17), (1, 1000), (17, 3, 5)])
def test_reduction_and_normalization_kernels(shape):
    check_against_reference(kernel_graphs.reduction(shape))


def test_large_full_reduction_uses_per_thread_partials():
    exe = check_against_reference("""
graph @total(%x: f32[300, 1000]) {
  %0: f32[300, 1000] = mul(%x, %x)
  %1: f32[] = sum(%0)
  return %1
}""", threads=2)
    assert "#pragma omp parallel for" in exe.source and "reduction(+:" in exe.source


def _innermost_reduction_loop(body, enclosing=None):
    """The loop directly around the first ``+=`` statement of a loop program (or None)."""
    from kiln.ir.loops.program import If, Loop, Reduce

    for n in body:
        if isinstance(n, Loop):
            found = _innermost_reduction_loop(n.body, n)
            if found is not None:
                return found
        elif isinstance(n, If):
            found = _innermost_reduction_loop((*n.then, *n.orelse), enclosing)
            if found is not None:
                return found
        elif isinstance(n, Reduce):
            return enclosing
    return None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,cols", [(2, 1), (3, 17), (17, 1000), (512, 1024), (1000, 3)])
def test_sums_over_rows_run_along_the_rows(threads, rows, cols):
    """A sum over rows with an epilogue (a bias gradient and its AdamW-like update): the
    column loop is sunk below the row loop (split into blocks that run in parallel when it is
    long), so the innermost loop of the reduction reads along a row; the epilogue still
    sees the whole sum."""
    from kiln.backends.cpu.codegen import sanitize_program
    from kiln.backends.cpu.schedules import default_schedule
    from kiln.ir.loops.expr import Load, free_vars, walk
    from kiln.loops import Schedule
    from kiln.passes.lower import lower_node

    text = f"""
graph @bias_grad(%g: f32[{rows}, {cols}], %m: f32[{cols}]) {{
  %0: f32[{cols}] = sum(%g) {{dims=[0]}}
  %1: f32[{cols}] = mul(%0, %0)
  %2: f32[{cols}] = add(%m, %1)
  %3: f32[{cols}] = sub(%0, %m)
  return %2, %3
}}"""
    exe = check_against_reference(text, threads=threads)
    fused = default_pipeline().run(ir.parse(text)).graph
    (node,) = [n for n in fused.nodes if n.op.name == "fused"]
    program, _ = sanitize_program(lower_node(node).program)
    scheduled = default_schedule(program, "reduction", threads=threads)
    assert Schedule.replay(program, scheduled.trace).verify()
    if rows > 1 and cols > 1:
        loop = _innermost_reduction_loop(scheduled.program.body)
        loads = [e for s in loop.body for e in walk(s.value) if isinstance(e, Load)]
        assert loads and all(loop.iterator in free_vars(e.indices[-1]) for e in loads), scheduled.program
    if threads == 2 and cols >= 1000:
        assert "split" in {s["primitive"] for s in scheduled.trace}
        assert "#pragma omp parallel for" in exe.source


@pytest.mark.parametrize("select", ["rule", "generated"])
@pytest.mark.parametrize("m,k,n", [(1, 3, 17), (17, 1000, 3), (3, 17, 1)])
def test_matmul_kernels(select, m, k, n):
    info = check_against_reference(kernel_graphs.matmul_epilogue(m, k, n), select=select).info
    assert ("library+epilogue" if select == "rule" else "generated") in info["choices"].values()
    assert info["kernels"] == 1


@pytest.mark.parametrize("select", ["rule", "generated"])
def test_batched_matmul_with_broadcast(select):
    check_against_reference("""
graph @bmm(%a: f32[2, 3, 17, 5], %b: f32[3, 5, 1]) {
  %0: f32[2, 3, 17, 1] = matmul(%a, %b)
  %1: f32[2, 3, 17, 1] = mul(%0, %0)
  return %1
}""", select=select)


@pytest.mark.parametrize("select", ["rule", "generated"])
@pytest.mark.parametrize("stride,groups", [(1, 1), (2, 3)])
def test_conv_kernels(select, stride, groups):
    check_against_reference(kernel_graphs.conv_block(stride, groups), select=select)


@pytest.mark.parametrize("select", ["rule", "generated"])
def test_attention_and_embedding(select):
    check_against_reference("""
graph @attn(%ids: i64[1, 17], %mask: bool[1, 1, 17, 17]) params(%emb: f32[1000, 12]) {
  %0: f32[1, 17, 12] = embedding(%emb, %ids)
  %1: f32[1, 17, 3, 4] = reshape(%0) {shape=[1, 17, 3, 4]}
  %2: f32[1, 3, 17, 4] = permute(%1) {dims=[0, 2, 1, 3]}
  %3: f32[1, 3, 17, 4] = scaled_dot_product_attention(%2, %2, %2, %mask)
  return %3
}""", select=select)


def test_views_feeding_kernels_and_outputs():
    """Strided views read by kernels are copied, contiguous ones read in place; outputs
    that are views of intermediates stay valid after the next call."""
    text = """
graph @views(%x: f32[4, 6]) {
  %0: f32[4, 6] = exp(%x)
  %1: f32[6, 4] = permute(%0) {dims=[1, 0]}
  %2: f32[6, 4] = neg(%1)
  %3: f32[4, 3] = slice(%0) {dim=1, start=1, end=4}
  %4: f32[4, 3] = sqrt(%3)
  %5: f32[24] = reshape(%0) {shape=[24]}
  return %2, %4, %5
}"""
    check_against_reference(text)
    exe = get_backend("cpu").build(ir.parse(text))
    x = torch.randn(4, 6)
    first = [t.clone() for t in exe([x])]
    kept = exe([x])
    exe([torch.randn(4, 6)])
    for a, b in zip(first, kept):
        torch.testing.assert_close(a, b)


def test_fallback_kernels_read_views_of_arena_buffers():
    """A node run with its numpy reference on the host (matrix_exp) reads a view whose root
    sits at a non-zero arena offset; poisoned memory makes any misplaced read visible."""
    text = """
graph @fb(%x: f32[4, 8], %y: f32[100]) {
  %a: f32[100] = exp(%y)
  %b: f32[4, 8] = exp(%x)
  %c: f32[2, 4, 4] = reshape(%b) {shape=[2, 4, 4]}
  %e: f32[2, 4, 4] = matrix_exp(%c)
  %s: f32[] = sum(%a)
  %f: f32[2, 4, 4] = mul(%e, %s)
  return %f
}"""
    exe = get_backend("cpu").build(ir.parse(text), {"poison": True})
    assert exe.info["choices"]["%e = matrix_exp"] == "reference" and exe.info["arena_bytes"] > 400
    x, y = torch.randn(4, 8) * 0.3, torch.randn(100)
    want = torch.linalg.matrix_exp(x.exp().reshape(2, 4, 4)) * y.exp().sum()
    torch.testing.assert_close(exe([x, y])[0], want, rtol=1e-4, atol=0)


def test_non_contiguous_arguments():
    exe = get_backend("cpu").build(ir.parse("""
graph @nc(%x: f32[3, 5]) {
  %0: f32[3, 5] = mul(%x, %x)
  return %0
}"""))
    base = torch.randn(5, 3)
    torch.testing.assert_close(exe([base.t()])[0], base.t() * base.t())


# ------------------------------------------------------------------ memory plan


def test_memory_plan_reuses_and_never_overlaps_live_buffers():
    rng = np.random.default_rng(0)
    requests = []
    for i in range(60):
        first = int(rng.integers(0, 40))
        requests.append(BufferRequest(i, int(rng.integers(1, 5000)), first, first + int(rng.integers(0, 8))))
    plan = plan_memory(requests)
    check_plan(plan, requests)
    assert plan.arena_bytes < plan.total_bytes
    assert "planned peak" in plan.report()
    chain = [BufferRequest(i, 1024, i, i + 1) for i in range(10)]
    assert plan_memory(chain).arena_bytes == 2 * 1024


def test_model_memory_plan_is_smaller_than_the_sum():
    builder, inputs_fn = MODELS["mlp"]
    compiled = kiln.compile(builder(), inputs_fn()[0], backend="cpu")
    info = compiled.executable.info
    assert 0 < info["arena_bytes"] < info["intermediate_bytes"]


# ------------------------------------------------------------------ threads


def test_concurrent_calls_from_threads_are_safe():
    exe = get_backend("cpu").build(default_pipeline().run(ir.parse("""
graph @mt(%x: f32[8, 64]) params(%w: f32[64, 64], %g: f32[64], %b: f32[64]) {
  %0: f32[8, 64] = matmul(%x, %w)
  %1: f32[8, 64] = relu(%0)
  %2: f32[8, 64] = layer_norm(%1, %g, %b) {normalized_rank=1}
  %3: f32[8, 64] = matmul(%2, %w)
  return %3
}""")).graph)
    w, g, b = torch.randn(64, 64), torch.randn(64), torch.randn(64)
    inputs = [torch.randn(8, 64) for _ in range(4)]
    expected = [exe([x, w, g, b])[0] for x in inputs]
    errors: list[str] = []

    def worker(i: int) -> None:
        for _ in range(25):
            got = exe([inputs[i], w, g, b])[0]
            if not torch.equal(got, expected[i]):
                errors.append(f"thread {i}: wrong result")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert exe.plan.workspaces == 5  # the main thread's and one per worker


# ------------------------------------------------------------------ names


HOSTILE = '*/ system("rm -rf /"); /*\n#include <evil>\nint main'


def test_hostile_graph_and_value_names_never_reach_c():
    text = """
graph @g(%int: f32[3, 4], %exp: f32[4]) params(%for.while: f32[4]) {
  %main: f32[3, 4] = add(%int, %exp)
  %return: f32[3, 4] = mul(%main, %for.while)
  %0: f32[3, 4] = exp(%return)
  return %0
}"""
    graph = default_pipeline().run(ir.parse(text)).graph
    graph.name = HOSTILE
    exe = get_backend("cpu").build(graph)
    assert exe.info["kernels"] == 1
    assert "system" not in exe.source and "evil" not in exe.source and "rm -rf" not in exe.source
    x, e, p = torch.randn(3, 4), torch.randn(4), torch.randn(4)
    torch.testing.assert_close(exe([x, e, p])[0], torch.exp((x + e) * p))


def test_hostile_module_and_function_names_through_compile():
    Hostile = type(HOSTILE, (nn.Module,), {"forward": lambda self, x: torch.relu(x) * 2 + 1})
    x = torch.randn(3, 5)
    compiled = kiln.compile(Hostile(), (x,), backend="cpu")
    assert "system" not in compiled.executable.source
    torch.testing.assert_close(compiled(x), torch.relu(x) * 2 + 1)

    def fn(x):
        return torch.sigmoid(x) - x
    fn.__name__ = HOSTILE
    compiled = kiln.compile(fn, (x,), backend="cpu")
    assert "system" not in compiled.executable.source
    torch.testing.assert_close(compiled(x), torch.sigmoid(x) - x)


# ------------------------------------------------------------------ choices and options


def test_rule_uses_library_gemm_and_generated_epilogues():
    info = check_against_reference("""
graph @lin(%x: f32[4, 8]) params(%w: f32[16, 8], %b: f32[16]) {
  %0: f32[8, 16] = permute(%w) {dims=[1, 0]}
  %1: f32[4, 16] = matmul(%x, %0)
  %2: f32[4, 16] = add(%1, %b)
  %3: f32[4, 16] = sigmoid(%2)
  return %3
}""").info
    assert list(info["choices"].values()).count("library+epilogue") == 1
    if blas_symbols() is not None:  # the GEMM runs in the same native kernel as its epilogue
        assert info["kernels"] == 1 and info["library_calls"] == 0


def test_timed_selection_is_cached(tmp_path):
    text = """
graph @t(%x: f32[4, 8], %w: f32[8, 8]) {
  %0: f32[4, 8] = matmul(%x, %w)
  return %0
}"""
    opts = {"select": "time", "cache_dir": str(tmp_path)}
    first = get_backend("cpu").build(ir.parse(text), opts)
    choice = next(iter(first.info["choices"].values()))
    assert choice in ("library", "generated")
    assert (tmp_path / "selection.json").exists()
    second = get_backend("cpu").build(ir.parse(text), opts)
    assert next(iter(second.info["choices"].values())) == choice


def test_unknown_options_and_modes_are_rejected():
    with pytest.raises(kiln.KilnError, match="has no option"):
        get_backend("cpu").build(ir.parse("graph @e(%x: f32[2]) {\n  return %x\n}"), {"fast": True})
    with pytest.raises(kiln.KilnError, match="select='best'"):
        get_backend("cpu").build(ir.parse("graph @e(%x: f32[2]) {\n  return %x\n}"), {"select": "best"})


def test_unscheduled_and_single_thread_builds_agree():
    text = """
graph @s(%x: f32[64, 300]) {
  %0: f32[64, 300] = softmax(%x) {dim=-1}
  %1: f32[64, 300] = mul(%0, %x)
  return %1
}"""
    check_against_reference(text, schedule=False)
    check_against_reference(text, threads=1)
    check_against_reference(text, threads=2)


def test_schedules_are_checked_replayable_traces():
    from kiln.backends.cpu.codegen import sanitize_program
    from kiln.backends.cpu.schedules import default_schedule
    from kiln.loops import Schedule
    from kiln.passes.lower import lower_node

    graph = ir.parse("""
graph @mm(%x: f32[64, 128], %w: f32[128, 96]) {
  %0: f32[64, 96] = matmul(%x, %w)
  return %0
}""")
    exe = check_against_reference(str(graph), select="generated", threads=2)
    (trace,) = exe.info["schedules"].values()
    assert {"parallel", "fission", "interchange", "vectorize", "tile"} <= {s["primitive"] for s in trace}
    program, _ = sanitize_program(lower_node(graph.nodes[0]).program)
    replayed = Schedule.replay(program, trace)  # every step re-checked for legality
    assert str(replayed.program(name=program.name)) == str(default_schedule(program, "matmul", threads=2).program)


def test_outputs_that_are_inputs_views_constants_or_repeated():
    exe = get_backend("cpu").build(ir.parse("""
graph @edge(%x: f32[2, 3]) {
  %c: f32[3] = const [1.0, 2.0, 3.0]
  %0: f32[3, 2] = reshape(%x) {shape=[3, 2]}
  %1: f32[2, 3] = add(%x, %c)
  return %x, %0, %c, %1, %1
}"""))
    x = torch.randn(2, 3)
    same, view, const, added, again = exe([x])
    assert torch.equal(same, x) and torch.equal(view, x.reshape(3, 2)) and added is again
    torch.testing.assert_close(added, x + torch.tensor([1.0, 2.0, 3.0]))
    const.add_(100)  # the caller owns its outputs: the graph's constant is untouched
    torch.testing.assert_close(exe([x])[2], torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("dtype", ["f64", "i64"])
def test_other_dtypes(dtype):
    check_against_reference(f"""
graph @d(%x: {dtype}[3, 17], %w: {dtype}[17, 5]) {{
  %0: {dtype}[3, 5] = matmul(%x, %w)
  %1: {dtype}[3, 5] = mul(%0, %0)
  %2: {dtype}[3, 1] = sum(%1) {{dims=[-1], keepdim=true}}
  %3: {dtype}[3, 5] = sub(%1, %2)
  return %3
}}""")


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("provider", ["mkl", "openblas", "kiln"])
def test_each_gemm_provider_computes_every_gemm_layout(provider, pack, tmp_path):
    from dataclasses import replace

    from kiln.backends.cpu import microgemm, toolchain
    from kiln.backends.cpu.backend import build_executable
    from kiln.backends.cpu.gemm import GemmTuner, Operand, blas_providers
    from kiln.backends.cpu.library import rule_choice
    from kiln.runtime.cache import CompileCache

    cc = toolchain.find_compiler()
    micro = microgemm.library(CompileCache(tmp_path), cc)
    if provider != "kiln" and provider not in blas_providers():
        pytest.skip(f"{provider} is not loaded in this process")

    class Forced(GemmTuner):
        def choose(self, spec, packable=False):
            spec = replace(spec, provider=provider)
            if pack and packable:  # B read from a packed copy of the transposed weight
                b = spec.b if provider == "kiln" else Operand("N", spec.n)
                spec = replace(spec, b=b, packed_b=True)
            return spec

    graph = ir.parse("""
graph @layouts(%x: f32[3, 5, 7], %y: f32[3, 7, 4], %t: f32[3, 4, 7]) params(%w: f32[6, 7]) {
  %0: f32[7, 6] = permute(%w) {dims=[1, 0]}
  %1: f32[3, 5, 6] = matmul(%x, %0)
  %2: f32[3, 5, 6] = relu(%1)
  %3: f32[3, 5, 4] = matmul(%x, %y)
  %4: f32[3, 7, 4] = permute(%t) {dims=[0, 2, 1]}
  %5: f32[3, 5, 4] = matmul(%x, %4)
  %6: f32[3, 5, 4] = sub(%3, %5)
  return %2, %6
}""")
    fused = default_pipeline().run(graph).graph
    exe = build_executable(fused, rule_choice, CompileCache(tmp_path), cc, threads=2, schedule=True,
                           tuner=Forced(None, "test", 2, micro))
    call = "kiln_mgemm(" if provider == "kiln" else f"kiln_sgemm_{provider}("
    assert exe.source.count(call) >= 3
    args = random_inputs(graph, 3)
    reference = get_backend("reference").build(graph, {"float64": True})
    for got, expected in zip(exe(args), reference(args)):
        assert rel_err(got, expected) <= REL_TOL
    with torch.no_grad():
        args[-1].mul_(-3)  # an in-place weight update reaches the packed copy
    for got, expected in zip(exe(args), reference(args)):
        assert rel_err(got, expected) <= REL_TOL
    packing = "panels of" if provider == "kiln" else "packed copy"
    assert (packing in " ".join(str(s) for s in exe.plan.steps)) == pack


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (3, 17, 1000), (17, 1000, 3), (1000, 3, 17), (100, 300, 33),
                                     (7, 260, 32), (13, 5, 48), (151, 64, 40), (23, 9, 32),
                                     (300, 260, 33), (200, 64, 40), (2, 1000, 17), (4, 33, 1000), (3, 300, 65),
                                     (1, 260, 4096)])
def test_kiln_gemm_on_odd_shapes_and_layouts(m, k, n, packed, tmp_path):
    """kiln's own GEMM against float64, with A and B in both layouts and the edge tiles,
    several K slabs (K > 256) and M blocks (M > 96; M > 144 with AVX-512's 12-row
    micro-panels) exercised, with last micro-panels of 1, 3, 4, 5, 7 and 11 rows; with
    AVX-512, pairs of full panels (N = 32, 48) and a pair beside a partial panel (N = 33,
    40, 1000); tall narrow products (M >= 192, N <= 1024) split by rows between threads;
    products of at most 4 rows on the GEMV path, with groups of 1 to 4 panels and a
    partial last panel."""
    from kiln.backends.cpu import microgemm, toolchain
    from kiln.runtime.cache import CompileCache

    micro = microgemm.library(CompileCache(tmp_path), toolchain.find_compiler())
    assert micro is not None
    gen = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    for a in (torch.randn(m, k, generator=gen), torch.randn(k, m, generator=gen).T):
        for b in (torch.randn(k, n, generator=gen), torch.randn(n, k, generator=gen).T):
            expected = a.double() @ b.double()
            c = torch.full((m, n), float("nan"))
            if packed:
                panels = torch.full(microgemm.packed_shape(k, n), float("nan"))
                microgemm.pack_panels(b, panels)
                micro.gemm(m, n, k, a.data_ptr(), a.stride(0), a.stride(1), panels.data_ptr(), 0, 0, True,
                           c.data_ptr(), n)
            else:
                micro.gemm(m, n, k, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0),
                           b.stride(1), False, c.data_ptr(), n)
            assert rel_err(c, expected) <= REL_TOL


def test_gemm_tuner_times_each_shape_once(tmp_path):
    from kiln.backends.cpu.gemm import GemmSpec, GemmTuner, Operand, blas_providers

    spec = GemmSpec(ir.DType.float32, 64, 256, 128, Operand("N", 128), Operand("N", 256))
    first = GemmTuner(tmp_path / "gemm.json", "machine", 1)
    chosen = first.choose(spec)
    assert chosen.provider in blas_providers()
    if len(first.candidates(spec)) < 2:
        return
    assert first.timed == 1 and (tmp_path / "gemm.json").exists()
    again = GemmTuner(tmp_path / "gemm.json", "machine", 1)
    assert again.choose(spec) == chosen and again.timed == 0
    tiny = GemmSpec(ir.DType.float32, 1, 8, 8, Operand("N", 8), Operand("N", 8))
    assert again.choose(tiny).provider == "mkl" and again.timed == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_of_small_gemms_is_split_by_entry_across_threads(threads):
    """With several threads, the entries of a batch of small GEMMs (attention's score and
    value products) run in parallel, one thread each; one thread, one entry or big entries
    keep the plain loop.  Results match eager at odd sizes, with a fused epilogue, a
    broadcast operand and the kiln GEMM provider too."""
    from kiln.backends.cpu.gemm import PARALLEL_BATCH_MAX_FLOPS, GemmTuner, gemm_function, gemm_spec

    tuner = GemmTuner(None, "machine", threads)
    small = gemm_spec(torch.randn(6, 17, 9), torch.randn(6, 9, 33), ir.DType.float32)
    assert tuner.choose(small).parallel_batch == (threads > 1)
    assert ("omp parallel for" in gemm_function("g", tuner.choose(small))) == (threads > 1)
    big = 1 + int(PARALLEL_BATCH_MAX_FLOPS ** (1 / 3))
    large = gemm_spec(torch.randn(2, big, big), torch.randn(2, big, big), ir.DType.float32)
    assert not tuner.choose(large).parallel_batch
    single = gemm_spec(torch.randn(1, 17, 9), torch.randn(1, 9, 33), ir.DType.float32)
    assert not tuner.choose(single).parallel_batch

    def attention_like(q, k, v):
        return torch.relu(q @ k.transpose(-1, -2)) @ v + 1.0

    q, k, v = torch.randn(3, 5, 17, 9), torch.randn(3, 5, 13, 9), torch.randn(3, 5, 13, 7)
    compiled = kiln.compile(attention_like, (q, k, v), backend="cpu", threads=threads)
    torch.testing.assert_close(compiled(q, k, v), attention_like(q, k, v), rtol=1e-4, atol=1e-4)
    shared = torch.randn(9, 11)  # broadcast right operand
    f = kiln.compile(lambda a: torch.tanh(a @ shared), (q,), backend="cpu", threads=threads)
    torch.testing.assert_close(f(q), torch.tanh(q @ shared), rtol=1e-4, atol=1e-4)


def test_prepacked_conv_weights_follow_in_place_updates():
    exe = get_backend("cpu").build(ir.parse("""
graph @pc(%x: f32[1, 8, 9, 9]) params(%w: f32[8, 8, 3, 3]) {
  %0: f32[1, 8, 9, 9] = conv(%x, %w) {stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1}
  return %0
}"""))
    x, w = torch.randn(1, 8, 9, 9), torch.randn(8, 8, 3, 3)
    conv = torch.nn.functional.conv2d
    torch.testing.assert_close(exe([x, w])[0], conv(x, w, padding=1), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        w.mul_(-2)  # an optimizer-style in-place update
    torch.testing.assert_close(exe([x, w])[0], conv(x, w, padding=1), rtol=1e-4, atol=1e-4)
    other = torch.randn(8, 8, 3, 3)
    torch.testing.assert_close(exe([x, other])[0], conv(x, other, padding=1), rtol=1e-4, atol=1e-4)


def test_convolution_chains_stay_channels_last_and_kernels_absorb_views():
    """Kernels between channels-last convolutions write NHWC; kernels read the NCHW views
    (and a user permute) through absorbed index arithmetic; poisoned memory catches any
    read of an unwritten cell."""
    from kiln.backends.cpu.library import rule_choice
    from kiln.backends.cpu.packed_conv import packed_conv_available
    from kiln.backends.cpu.partition import build_graph_plan

    text = """
graph @chain(%x: f32[1, 3, 17, 17]) params(%w1: f32[8, 3, 3, 3], %w2: f32[8, 8, 3, 3], %s: f32[8, 1, 1]) {
  %0: f32[1, 8, 17, 17] = conv(%x, %w1) {stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1}
  %1: f32[1, 8, 17, 17] = mul(%0, %s)
  %2: f32[1, 8, 17, 17] = relu(%1)
  %3: f32[1, 8, 17, 17] = conv(%2, %w2) {stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1}
  %4: f32[1, 8, 17, 17] = add(%3, %2)
  %5: f32[1, 8, 8, 8] = max_pool2d(%4) {kernel=[2, 2], stride=[2, 2]}
  %6: f32[1, 8, 8, 8] = permute(%5) {dims=[0, 2, 3, 1]}
  %7: f32[1, 8, 8, 8] = softmax(%6) {dim=-1}
  return %7
}"""
    check_against_reference(text, poison=True)
    plan = build_graph_plan(default_pipeline().run(ir.parse(text)).graph, rule_choice)
    assert not [op for op in plan.ops if op.step == "copy"]
    if packed_conv_available(2):
        written = [pv.name for op in plan.ops if op.step == "kernel" for pv in op.outputs]
        assert any(name.endswith(".nhwc") for name in written)


@pytest.mark.parametrize("select", ["rule", "generated"])
def test_scatter_kernels_with_repeated_and_negative_indices(select):
    """index_put (set and accumulate, an index in a middle axis, broadcast values) and
    scatter_add: the library calls and the generated loops agree with the reference."""
    graph = ir.parse("""
graph @scatter(%x: f32[7, 5, 3], %v: f32[6, 3], %i: i64[6], %g: f32[4, 3], %j: i64[4, 3]) {
  %0: f32[7, 5, 3] = index_put(%x, %v, %i) {dims=[1], accumulate=true}
  %1: f32[7, 5, 3] = index_put(%x, %v, %i) {dims=[1]}
  %2: f32[7, 1, 3] = slice(%x) {dim=1, start=0, end=1, step=1}
  %3: f32[7, 3] = reshape(%2) {shape=[7, 3]}
  %4: f32[7, 3] = scatter_add(%3, %j, %g) {dim=0}
  return %0, %1, %4
}""")
    exe = get_backend("cpu").build(default_pipeline().run(graph).graph, {"select": select})
    ref = get_backend("reference").build(graph, {"float64": True})
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(7, 5, 3, generator=gen), torch.randn(6, 3, generator=gen),
            torch.tensor([0, 4, -1, 2, 4, 0]),  # repeats accumulate; -1 is the last row
            torch.randn(4, 3, generator=gen), torch.randint(0, 7, (4, 3), generator=gen)]
    got, want = exe(args), ref(args)
    for g, w in zip(got[::2], want[::2]):  # accumulating results are defined for repeats
        assert rel_err(g, w) <= REL_TOL
    unique = [1, 2, 3]  # non-accumulating index_put: where no position repeats
    assert rel_err(got[1][:, unique], want[1][:, unique]) <= REL_TOL
    labels = " ".join(str(s) for s in exe.plan.steps)
    assert ("torch index_put" in labels) == (select == "rule")
    assert ("torch.scatter_add" in labels) == (select == "rule")


def test_identical_kernels_share_one_function():
    """Two identical layers: their kernels are compiled once and both run (right results)."""
    exe = check_against_reference("""
graph @twice(%x: f32[5, 16]) params(%w1: f32[16, 16], %w2: f32[16, 16]) {
  %0: f32[5, 16] = matmul(%x, %w1)
  %1: f32[5, 16] = tanh(%0)
  %2: f32[5, 16] = matmul(%1, %w2)
  %3: f32[5, 16] = tanh(%2)
  return %3
}""")
    defined = [line for line in exe.source.splitlines() if line.startswith("void kiln_k")]
    assert exe.info["kernels"] == 2 and len(defined) == 1, defined


def test_measure_command_runs_and_profiles(capsys):
    """``python -m benchmarks.measure`` (timings) and ``--profile`` (time per kind)."""
    from benchmarks import measure

    measure.main(["test-mlp", "--runs", "2"])
    table = capsys.readouterr().out
    assert "| test-mlp |" in table and "per-call overhead" in table
    measure.main(["test-mlp", "--profile"])
    profile = capsys.readouterr().out
    assert "GEMM (+ fused epilogue)" in profile and "ms in plan calls" in profile
    with pytest.raises(SystemExit):
        measure.main(["no-such-model"])


def test_gemm_reading_a_select_view_of_a_kernel_result():
    """``Linear(LayerNorm(x)[:, 0])``: the GEMM reads a strided view of a norm kernel's result
    (once reported wrong on this backend, with a relative error of about 1)."""
    torch.manual_seed(0)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(48), nn.Linear(48, 10)

        def forward(self, x):
            return self.fc(self.norm(x)[:, 0])

    model, x = Head(), torch.randn(2, 5, 48)
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True)
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) <= REL_TOL


class _HalfOps(nn.Module):
    def forward(self, x, y):
        a = torch.nn.functional.gelu(x * y + 1.5) - x.exp() * 0.25
        return a, a.sum(-1), x.amax(0), torch.softmax(x, -1), torch.tanh(y).cumsum(-1), (x > y).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (3, 17), (17, 1000)])
def test_half_kernels_run_in_c_and_match_eager(dtype, shape):
    """float16/bfloat16 kernels are C (no fallback), compute in float and round every op as
    torch does: the results equal eager's up to the last bit of the half type, in elementwise
    ops, reductions (accumulated in float), softmax and scans."""
    gen = torch.Generator().manual_seed(len(shape))
    x, y = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    compiled = kiln.compile(_HalfOps(), (x, y), backend="cpu", strict=True)
    assert not compiled.executable.info["fallbacks"]
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for got, want in zip(compiled(x, y), _HalfOps()(x, y)):
        assert got.dtype == want.dtype
        scale = want.float().abs().clamp_min(1.0)
        assert ((got.float() - want.float()).abs() / scale).max() <= 2 * ulp


def test_loop_invariant_math_of_the_optimizer_update_is_computed_once():
    """AdamW's bias corrections (``pow(beta, step)``) do not depend on the element: the
    printer computes them once before the loop nest, not once per parameter element."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    step = kiln.compile_train(model, nn.functional.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              (torch.randn(3, 8), torch.randn(3, 4)), backend="cpu")
    step(torch.randn(3, 8), torch.randn(3, 4))
    lines = [line.strip() for line in step._executable.source.splitlines()
             if "pow(" in line and not line.startswith("double pow(")]  # not the declaration
    assert lines and all(line.startswith("const ") for line in lines), lines
