"""Symbolic graphs run by the reference and cpu backends, built once, at any size in range.

Every graph is written in text form with named sizes; each run at a set of sizes is compared
with the static graph of those sizes (``kiln.ir.sizes.specialize``), run by the reference
backend (and, for the attention block, built statically by the cpu backend too).  The cpu
build of a symbolic graph is compiled once: later sizes only bind a new plan (memory
offsets, views, library calls) and never compile again.
"""

from __future__ import annotations

import pytest
import torch

from kiln.backends import get_backend
from kiln.backends.common.build import BuildPipeline
from kiln.backends.common.memory_plan import BufferRequest, check_plan, plan_memory, plan_symbolic
from kiln.ir import parse
from kiln.ir.sizes import SizeError, concrete_type, specialize
from kiln.passes.manager import PassManager

ELEMENTWISE = """graph @ew(%x: f32[n, 5], %b: f32[5], %y: f32[n, 1]) sizes(n: [2, 128]) {
  %0: f32[n, 5] = add(%x, %b)
  %1: f32[n, 5] = mul(%0, %y)
  %2: f32[n, 5] = exp(%1)
  %3: f32[n, 1] = sum(%2) {dims=[1], keepdim=true}
  %4: f32[5] = sum(%1) {dims=[0]}
  %5: f32[n, 5] = softmax(%1) {dim=0}
  %6: f32[n, 5] = softmax(%1) {dim=-1}
  %7: f32[5] = mean(%1) {dims=[0]}
  %8: f32[n, 5] = layer_norm(%1, %b, %b) {normalized_rank=1}
  %9: f32[5, n] = permute(%8) {dims=[1, 0]}
  %10: f32[5, n] = tanh(%9)
  %11: f32[n] = amax(%1) {dims=[1]}
  %12: f32[5] = var(%x) {dims=[0]}
  return %3, %4, %5, %6, %7, %10, %11, %12
}"""

MLP = """graph @mlp(%x: f32[batch, 16]) params(%w1: f32[32, 16], %b1: f32[32], %w2: f32[8, 32], %b2: f32[8]) sizes(batch: [2, 64]) {
  %0: f32[16, 32] = permute(%w1) {dims=[1, 0]}
  %1: f32[batch, 32] = matmul(%x, %0)
  %2: f32[batch, 32] = add(%1, %b1)
  %3: f32[batch, 32] = gelu(%2)
  %4: f32[32, 8] = permute(%w2) {dims=[1, 0]}
  %5: f32[batch, 8] = matmul(%3, %4)
  %6: f32[batch, 8] = add(%5, %b2)
  %7: f32[batch, 8] = relu(%6)
  return %7
}"""

ATTENTION = """graph @attn(%x: f32[b, t, 8]) params(%qkv.weight: f32[24, 8], %qkv.bias: f32[24], %ln.weight: f32[8], %ln.bias: f32[8], %o.weight: f32[8, 8], %o.bias: f32[8]) sizes(b: [2, 8], t: [2, 300]) {
  %c: f32[] = const 0.5
  %0: f32[b, t, 8] = layer_norm(%x, %ln.weight, %ln.bias) {normalized_rank=1}
  %1: f32[8, 24] = permute(%qkv.weight) {dims=[1, 0]}
  %2: f32[b, t, 24] = matmul(%0, %1)
  %3: f32[b, t, 24] = add(%2, %qkv.bias)
  %4: f32[b, t, 8] = slice(%3) {dim=2, start=0, end=8}
  %5: f32[b, t, 8] = slice(%3) {dim=2, start=8, end=16}
  %6: f32[b, t, 8] = slice(%3) {dim=2, start=16, end=24}
  %7: f32[b, t, 2, 4] = reshape(%4) {shape=[size(b), size(t), 2, 4]}
  %8: f32[b, 2, t, 4] = permute(%7) {dims=[0, 2, 1, 3]}
  %9: f32[b, t, 2, 4] = reshape(%5) {shape=[size(b), size(t), 2, 4]}
  %10: f32[b, 2, t, 4] = permute(%9) {dims=[0, 2, 1, 3]}
  %11: f32[b, t, 2, 4] = reshape(%6) {shape=[size(b), size(t), 2, 4]}
  %12: f32[b, 2, t, 4] = permute(%11) {dims=[0, 2, 1, 3]}
  %13: f32[b, 2, 4, t] = permute(%10) {dims=[0, 1, 3, 2]}
  %14: f32[b, 2, t, t] = matmul(%8, %13)
  %15: f32[b, 2, t, t] = mul(%14, %c)
  %16: f32[b, 2, t, t] = softmax(%15) {dim=-1}
  %17: f32[b, 2, t, 4] = matmul(%16, %12)
  %18: f32[b, t, 2, 4] = permute(%17) {dims=[0, 2, 1, 3]}
  %19: f32[b, t, 8] = reshape(%18) {shape=[size(b), size(t), 8]}
  %20: f32[8, 8] = permute(%o.weight) {dims=[1, 0]}
  %21: f32[b, t, 8] = matmul(%19, %20)
  %22: f32[b, t, 8] = add(%21, %o.bias)
  %23: f32[b, t, 8] = gelu(%22)
  %24: f32[b, t, 8] = add(%23, %x)
  %25: f32[b, 2*t, 8] = cat(%24, %x) {dim=1}
  %26: f32[b, 8] = sum(%25) {dims=[1]}
  %27: f32[b, t] = mean(%24) {dims=[-1]}
  return %26, %27
}"""


@pytest.fixture(scope="module")
def opts(tmp_path_factory):
    """cpu build options: one compile cache for the file (kiln's GEMM library builds once),
    NaN-filled memory before every call (a read of unwritten memory fails)."""
    return {"cache_dir": str(tmp_path_factory.mktemp("kiln-dynamic-cache")), "poison": True}


def _args(graph, sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(concrete_type(v.type, sizes).shape, generator=gen)
            for v in (*graph.inputs, *graph.params)]


def _check(outs, refs, rtol=1e-4):
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12))
        assert err <= rtol, f"relative error {err:.2e} > {rtol}"


def _static_reference(graph, sizes, args):
    """The oracle: the static graph at ``sizes``, run by the reference backend."""
    return get_backend("reference").build(specialize(graph, sizes))(args)


@pytest.fixture
def compiles(monkeypatch):
    """How many translation units the compiled backends compile."""
    record = {"count": 0}
    original = BuildPipeline.compile

    def counting(self, text, folder):
        record["count"] += 1
        return original(self, text, folder)

    monkeypatch.setattr(BuildPipeline, "compile", counting)
    return record


# ------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("text,sizes", [
    (ELEMENTWISE, [{"n": 2}, {"n": 3}, {"n": 17}, {"n": 100}]),
    (ATTENTION, [{"b": 2, "t": 2}, {"b": 3, "t": 17}, {"b": 2, "t": 100}]),
], ids=["elementwise", "attention"])
def test_the_reference_backend_runs_a_symbolic_graph_at_each_size(text, sizes):
    graph = parse(text)
    exe = get_backend("reference").build(graph)
    for s in sizes:
        args = _args(graph, s)
        outs = exe(args)
        assert [tuple(o.shape) for o in outs] == [tuple(concrete_type(v.type, s).shape) for v in graph.outputs]
        _check(outs, _static_reference(graph, s, args), rtol=1e-6)


def test_the_reference_backend_refuses_sizes_out_of_range_or_inconsistent():
    graph = parse(MLP)
    exe = get_backend("reference").build(graph)
    params = _args(graph, {"batch": 2})[1:]
    with pytest.raises(SizeError, match=r"batch = 65 is outside its range \[2, 64\]"):
        exe([torch.randn(65, 16), *params])
    with pytest.raises(SizeError, match="compiled for a static 16"):
        exe([torch.randn(4, 15), *params])


# ------------------------------------------------------------------------------ cpu
def test_elementwise_broadcast_reductions_and_norms_build_once_and_run_at_every_size(opts, compiles):
    graph = parse(ELEMENTWISE)
    exe = get_backend("cpu").build(graph, opts)
    assert compiles["count"] == 1
    assert exe.info["kernels"] >= 10 and exe.info["library_calls"] == 0
    # var's rule needs a concrete count: that node alone runs its reference at each call's sizes
    assert list(exe.info["fallbacks"]) == ["%12 = var"], exe.info["fallbacks"]
    assert "kiln_k0_body(((const long *)args[" in exe.source  # sizes are kernel arguments
    for n in (2, 3, 17, 100, 3):
        args = _args(graph, {"n": n}, seed=n)
        _check(exe(args), _static_reference(graph, {"n": n}, args))
    assert compiles["count"] == 1
    assert sorted(exe.plan.instances) == [(2,), (3,), (17,), (100,)]


def test_an_mlp_with_a_batch_range_runs_native_gemms_with_m_read_at_run_time(opts, compiles):
    graph = PassManager("fuse").run(parse(MLP)).graph
    exe = get_backend("cpu").build(graph, opts)
    labels = [label for label in exe.info["choices"]]
    assert labels and all(exe.info["choices"][k] != "reference" for k in labels)
    assert not exe.info["fallbacks"] and exe.info["library_calls"] == 0  # both GEMMs are native
    assert "_gemm(args[0], args[1], args[2], (const long *)args[" in exe.source
    for batch in (2, 3, 17, 64):
        args = _args(graph, {"batch": batch}, seed=batch)
        _check(exe(args), _static_reference(graph, {"batch": batch}, args))
    assert compiles["count"] == 1


def test_an_attention_block_matches_its_static_build_at_odd_sizes(opts, compiles):
    graph = PassManager("fuse").run(parse(ATTENTION)).graph
    exe = get_backend("cpu").build(graph, opts)
    assert compiles["count"] == 1 and not exe.info["fallbacks"]
    assert exe.info["sizes"] == {"b": "[2, 8]", "t": "[2, 300]"}
    for b, t in ((2, 2), (3, 17), (2, 100), (8, 300)):
        s = {"b": b, "t": t}
        args = _args(graph, s, seed=t)
        _check(exe(args), _static_reference(graph, s, args))
    # the static build of the same graph at one size agrees too
    s = {"b": 3, "t": 17}
    args = _args(graph, s, seed=1)
    static = get_backend("cpu").build(specialize(graph, s), opts)
    _check(exe(args), static(args))
    assert compiles["count"] == 2  # the dynamic build once, the static one once


def test_the_arena_grows_to_the_largest_size_seen_and_is_reused_below_it(opts):
    graph = parse(ELEMENTWISE)
    exe = get_backend("cpu").build(graph, opts)
    small, large = {"n": 3}, {"n": 100}
    exe(_args(graph, small))
    exe(_args(graph, large))
    arena = exe.plan._local.ws.arena
    assert arena.numel() >= exe.plan.plan_for((100,)).arena_bytes > exe.plan.plan_for((3,)).arena_bytes
    for n in (3, 17, 50, 100):  # smaller sizes and new ones: no new arena
        args = _args(graph, {"n": n}, seed=n)
        _check(exe(args), _static_reference(graph, {"n": n}, args))
        assert exe.plan._local.ws.arena is arena


def test_the_cpu_backend_refuses_sizes_out_of_range_and_shapes_that_disagree(opts):
    graph = parse("""graph @two(%x: f32[n, 3], %y: f32[n, 3]) sizes(n: [2, 32]) {
  %0: f32[n, 3] = add(%x, %y)
  return %0
}""")
    exe = get_backend("cpu").build(graph, opts)
    _check(exe([torch.ones(5, 3), torch.ones(5, 3)]), [torch.full((5, 3), 2.0)])
    with pytest.raises(SizeError, match=r"n = 33 is outside its range \[2, 32\]"):
        exe([torch.ones(33, 3), torch.ones(33, 3)])
    with pytest.raises(SizeError, match="size n is 5 but"):
        exe([torch.ones(5, 3), torch.ones(6, 3)])
    with pytest.raises(SizeError, match="compiled for a static 3"):
        exe([torch.ones(5, 4), torch.ones(5, 4)])
    with pytest.raises(SizeError, match="rank-2"):
        exe([torch.ones(5), torch.ones(5, 3)])
    assert exe.plan.instances.keys() == {(5,)}


def test_other_backends_still_refuse_symbolic_graphs():
    pytest.importorskip("triton")
    with pytest.raises(Exception, match="static shapes only"):
        get_backend("triton").build(parse(MLP))


# ------------------------------------------------------------------------------ memory plan
def test_the_symbolic_memory_plan_never_overlaps_live_buffers_at_any_size():
    # byte sizes as functions of one size n: some grow, some are fixed
    coeffs = [(64, 0), (4, 0), (0, 4096), (16, 256), (128, 0), (8, 8), (0, 64)]
    lives = [(0, 2), (1, 3), (2, 4), (3, 6), (4, 5), (0, 6), (5, 6)]

    def nbytes(sizes):
        (n,) = sizes
        return [a * n + c for a, c in coeffs]

    sample = [BufferRequest(k, nb, f, last) for k, (nb, (f, last)) in enumerate(zip(nbytes((37,)), lives))]
    plan = plan_symbolic(sample, nbytes)
    for n in (2, 3, 17, 100, 4000):
        offsets, arena = plan.evaluate((n,))
        requests = [BufferRequest(k, nb, f, last) for k, (nb, (f, last)) in enumerate(zip(nbytes((n,)), lives))]
        planned = plan_memory(requests)
        check_plan(type(planned)(offsets, {}, arena, arena), requests)
        assert arena <= sum(-(-max(r.nbytes, 1) // 64) * 64 for r in requests)


def test_gemm_buckets_compile_a_variant_only_where_the_tuner_chose_differently(opts, compiles, monkeypatch):
    from kiln.backends.cpu.gemm import KILN_PROVIDER, GemmTuner

    # a deterministic stand-in for the timings: kiln's GEMM up to 32 rows, MKL above
    def choose(self, spec, packable=False):
        candidates = self.candidates(spec, packable)
        if KILN_PROVIDER not in candidates or "mkl" not in candidates:
            pytest.skip("needs kiln's GEMM and MKL")
        return candidates[KILN_PROVIDER if spec.m <= 32 else "mkl"]

    monkeypatch.setattr(GemmTuner, "choose", choose)
    graph = PassManager("fuse").run(parse(MLP)).graph
    exe = get_backend("cpu").build(graph, {**opts, "cache": False})
    variants = exe.info["variants"]
    assert [v["sizes"] for v in variants] == [{"batch": 8}, {"batch": 32}, {"batch": 64}]
    assert [v["gemm"] for v in variants] == [["kiln+packed"] * 2] * 2 + [["mkl"] * 2]
    assert variants[0]["cache_key"] == variants[1]["cache_key"] != variants[2]["cache_key"]
    assert compiles["count"] == 2  # one per distinct choice, not one per bucket
    for batch in (2, 17, 50, 64):
        args = _args(graph, {"batch": batch}, seed=batch)
        _check(exe(args), _static_reference(graph, {"batch": batch}, args))
    assert compiles["count"] == 2
    # the kiln variant's weight panels are made once for its two sizes (2, 17), not per size
    groups = exe.plan._local.ws.persistent
    assert sorted(len(g) for g in groups.values()) == [0, 2]


def test_symbolic_kernels_are_scheduled_under_the_recorded_ranges(monkeypatch):
    """The isl checks of a symbolic kernel assume the graph's ranges for its size parameters."""
    from kiln.backends.cpu import schedules

    seen = []
    original = schedules.strategy_schedule

    def spy(program, kind, **kwargs):
        seen.append(kwargs.get("ranges"))
        return original(program, kind, **kwargs)

    monkeypatch.setattr(schedules, "strategy_schedule", spy)
    get_backend("cpu").build(parse(ELEMENTWISE), {"cache": False})
    ranges = [r for r in seen if r]
    assert ranges and all(set(r.values()) == {(2, 128)} for r in ranges), seen
