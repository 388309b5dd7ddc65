"""The triton backend's kernel generators, one kernel kind at a time, in Triton's interpreter
(against the reference backend, at ragged sizes), plus the GPU-only paths checked without a
GPU: bf16 sources generate, parse and compile for an sm_90 target."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch

import kiln.backends.triton  # noqa: F401  (registers "triton")
import kiln.ir as ir
import kiln.loops as kl
from kiln.backends import get_backend
from kiln.backends.triton.analysis import interval, phases, vector_nest
from kiln.backends.triton.configs import ConfigTuner, space
from kiln.backends.triton.generate import kernel_source, program_source
from kiln.backends.triton.source import module_text
from kiln.backends.triton.toolchain import TritonToolchain, import_kernels, interpreted_library
from kiln.ir.loops.expr import Binary, Const, Var
from kiln.passes.pipeline import default_pipeline
from kiln.runtime import logs

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kiln-triton-cache"))


def operands(graph: ir.Graph, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = []
    for v in (*graph.inputs, *graph.params):
        shape = tuple(v.shape)
        if v.dtype.is_floating:
            out.append(torch.from_numpy(rng.standard_normal(shape).astype(v.dtype.numpy)))
        elif v.dtype == ir.DType.bool:
            out.append(torch.from_numpy(rng.random(shape) > 0.3))
        else:
            out.append(torch.from_numpy(rng.integers(0, 4, shape).astype(v.dtype.numpy)))
    return out


def check(text: str, *, fuse: bool = True, inputs: list[torch.Tensor] | None = None, **options):
    """Build ``text`` with the triton backend (interpreter) and compare with the reference;
    returns the executable and its kernel kinds."""
    graph = ir.parse(text)
    if fuse:
        graph = default_pipeline()(graph).graph
    args = inputs if inputs is not None else operands(graph)
    exe = get_backend("triton").build(graph, {"poison": True, **options})
    want = get_backend("reference").build(graph)(args)
    got = exe(args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, equal_nan=True)
    kinds = sorted(entry["kind"] for entry in exe.library.KERNELS.values()) if exe.library is not None else []
    return exe, kinds


# ------------------------------------------------------------------ pointwise
def test_pointwise_ragged_tail_with_xblock_128():
    exe, kinds = check("""graph @g(%x: f32[1000], %y: f32[1000]) {
  %0: f32[1000] = mul(%x, %y)
  %1: f32[1000] = tanh(%0)
  return %1
}""", config={"XBLOCK": 128})
    assert kinds == ["pointwise"] and exe.info["kernels"] == 1
    assert "xmask = xindex < 1000" in exe.source and "@triton.jit" in exe.source


def test_pointwise_broadcast_and_permute_index_arithmetic():
    exe, kinds = check("""graph @g(%x: f32[5, 7, 3], %b: f32[7, 1]) {
  %0: f32[3, 7, 5] = permute(%x) {dims=[2, 1, 0]}
  %1: f32[3, 7, 5] = add(%0, %b)
  %2: f32[105] = reshape(%1) {shape=[105]}
  %3: f32[105] = exp(%2)
  return %3
}""", config={"XBLOCK": 32})
    assert kinds == ["pointwise"]
    assert "//" in exe.source and "%" in exe.source  # flat index -> coordinates


def test_embedding_gather_is_pointwise():
    _, kinds = check("""graph @g(%w: f32[10, 6], %i: i64[3, 4]) {
  %0: f32[3, 4, 6] = embedding(%w, %i)
  return %0
}""")
    assert kinds == ["pointwise"]


# ------------------------------------------------------------------ reductions and normalizations
@pytest.mark.parametrize("row", [1, 33, 1000])
@pytest.mark.parametrize("rblock", [0, 16])
def test_row_reductions_persistent_and_looped(row, rblock):
    _, kinds = check(f"""graph @g(%x: f32[3, {row}]) {{
  %0: f32[3] = sum(%x) {{dims=[-1]}}
  %1: f32[3] = amax(%x) {{dims=[-1]}}
  return %0, %1
}}""", config={"RBLOCK": rblock, "XBLOCK": 2})
    assert set(kinds) <= {"reduction", "pointwise"}


def test_softmax_with_prologue_and_epilogue_looped():
    exe, kinds = check("""graph @g(%x: f32[5, 1000], %y: f32[5, 1000]) {
  %0: f32[5, 1000] = add(%x, %y)
  %1: f32[5, 1000] = softmax(%0) {dim=-1}
  %2: f32[5, 1000] = mul(%1, %1)
  return %2
}""", config={"RBLOCK": 128})
    assert kinds == ["reduction"] and exe.info["kernels"] == 1
    assert "for _roffset" in exe.source and "if R0_BLOCK >= 1000" in exe.source


@pytest.mark.parametrize("rblock", [0, 8])
def test_layer_norm_and_rms_norm_rows_of_33(rblock):
    _, kinds = check("""graph @g(%x: f32[4, 33], %r: f32[4, 33], %w: f32[33], %b: f32[33]) {
  %0: f32[4, 33] = add(%x, %r)
  %1: f32[4, 33] = layer_norm(%0, %w, %b) {normalized_rank=1}
  %2: f32[4, 33] = relu(%1)
  %3: f32[4, 33] = rms_norm(%2, %w) {normalized_rank=1}
  return %3
}""", config={"RBLOCK": rblock, "XBLOCK": 2})
    assert set(kinds) == {"reduction"}


def test_full_reduction_and_lane_dependent_bounds():
    check("""graph @g(%x: f32[30, 41]) {
  %0: f32[] = sum(%x) {dims=[0, 1]}
  return %0
}""", config={"RBLOCK": 128})
    _, kinds = check("""graph @g(%x: f32[1, 2, 10, 10]) {
  %0: f32[1, 2, 3, 3] = adaptive_avg_pool2d(%x) {output_size=[3, 3]}
  return %0
}""")
    assert kinds == ["reduction"]


def test_convolution_as_a_generated_reduction():
    _, kinds = check("""graph @g(%x: f32[1, 3, 9, 9], %w: f32[4, 3, 3, 3], %b: f32[4]) {
  %0: f32[1, 4, 5, 5] = conv(%x, %w, %b) {stride=[2, 2], padding=[1, 1], dilation=[1, 1], groups=1}
  %1: f32[1, 4, 5, 5] = relu(%0)
  return %1
}""", select="generated")
    assert kinds == ["reduction"]


# ------------------------------------------------------------------ matmul
def test_matmul_k70_block_k_32_with_fused_epilogue():
    exe, kinds = check("""graph @g(%a: f32[33, 70], %w: f32[20, 70], %c: f32[20]) {
  %t: f32[70, 20] = permute(%w) {dims=[1, 0]}
  %0: f32[33, 20] = matmul(%a, %t)
  %1: f32[33, 20] = add(%0, %c)
  %2: f32[33, 20] = gelu(%1)
  return %2
}""", config={"BLOCK_K": 32, "BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2})
    assert kinds == ["matmul"] and exe.info["kernels"] == 1
    assert "tl.dot(a, b, acc" in exe.source and "if EVEN_K and EVEN_MN" in exe.source


def test_batched_matmul_and_flattened_rows():
    _, kinds = check("""graph @g(%a: f32[3, 17, 40], %b: f32[3, 40, 18], %c: f32[2, 9, 40], %d: f32[40, 5]) {
  %0: f32[3, 17, 18] = matmul(%a, %b)
  %1: f32[2, 9, 5] = matmul(%c, %d)
  return %0, %1
}""", config={"BLOCK_K": 16, "BLOCK_M": 16, "BLOCK_N": 16})
    assert kinds == ["matmul", "matmul"]


# ------------------------------------------------------------------ attention
def _attention_inputs(q, k, v, mask=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(*q, generator=g), torch.randn(*k, generator=g), torch.randn(*v, generator=g)]
    if mask is not None:
        out.append(mask)
    return out


def test_attention_causal_ragged_against_torch():
    inputs = _attention_inputs((2, 3, 33, 16), (2, 3, 40, 16), (2, 3, 40, 24))
    exe, kinds = check("""graph @g(%q: f32[2, 3, 33, 16], %k: f32[2, 3, 40, 16], %v: f32[2, 3, 40, 24]) {
  %0: f32[2, 3, 33, 24] = scaled_dot_product_attention(%q, %k, %v) {is_causal=true}
  return %0
}""", inputs=inputs, config={"BLOCK_M": 16, "BLOCK_N": 16})
    assert kinds == ["attention"]
    want = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=True)
    torch.testing.assert_close(exe(inputs)[0], want, rtol=1e-4, atol=1e-5)


def test_attention_bool_mask_fully_masked_row_gives_zeros():
    mask = torch.rand(2, 1, 20, 24, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[0, 0, 5] = False  # every key masked out for query 5 of batch 0
    inputs = _attention_inputs((2, 4, 20, 16), (2, 4, 24, 16), (2, 4, 24, 16), mask)
    exe, _ = check("""graph @g(%q: f32[2, 4, 20, 16], %k: f32[2, 4, 24, 16], %v: f32[2, 4, 24, 16], %m: bool[2, 1, 20, 24]) {
  %0: f32[2, 4, 20, 16] = scaled_dot_product_attention(%q, %k, %v, %m)
  return %0
}""", inputs=inputs, config={"BLOCK_M": 16, "BLOCK_N": 16})
    out = exe(inputs)[0]
    assert torch.equal(out[0, :, 5], torch.zeros_like(out[0, :, 5])) and not out.isnan().any()


def test_attention_float_mask_and_scale():
    check("""graph @g(%q: f32[3, 20, 8], %k: f32[3, 20, 8], %v: f32[3, 20, 8], %m: f32[20, 20]) {
  %0: f32[3, 20, 8] = scaled_dot_product_attention(%q, %k, %v, %m) {scale=0.3}
  return %0
}""")


# ------------------------------------------------------------------ general fallback
def test_general_kernel_runs_sequential_loops():
    program = kl.parse("""program scan() {
  buffer x: f32[300]
  buffer y: f32[300]
  buffer s: f32[] local
  S0: s[] = 0.0:f32
  for i in [0, 300) {
    S1: s[] += x[i]
    S2: y[i] = s[]
  }
}""")
    source = program_source(program, ["x", "y"], interpret=True, symbol="kiln_k0")
    assert source.kind == "general" and source.scratch == [((), "float32")]
    module = _import(module_text([source], interpret=True))
    x, y = torch.randn(300), torch.empty(300)
    entry = module.KERNELS["kiln_k0"]
    with interpreted_library():
        entry["launch"]([x, y, torch.empty(())], entry["interpret"])
    torch.testing.assert_close(y, torch.cumsum(x, 0), rtol=1e-4, atol=1e-4)


def test_attention_through_the_general_generator_matches():
    text = """graph @g(%q: f32[1, 2, 9, 8], %k: f32[1, 2, 11, 8], %v: f32[1, 2, 11, 8]) {
  %0: f32[1, 2, 9, 8] = scaled_dot_product_attention(%q, %k, %v) {is_causal=true}
  return %0
}"""
    graph = ir.parse(text)
    source = kernel_source(graph.nodes[0], interpret=True, templates=False, symbol="kiln_k0")
    assert source.kind == "general" and source.scratch  # the scores live in scratch memory
    module = _import(module_text([source], interpret=True))
    args = operands(graph)
    out = torch.empty(1, 2, 9, 8)
    scratch = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in source.scratch]
    with interpreted_library():
        module.KERNELS["kiln_k0"]["launch"]([*args, out, *scratch], source.interpret_config)
    want = get_backend("reference").build(graph)(args)[0]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def _import(text: str):
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="kiln-triton-test-"))
    return import_kernels(TritonToolchain(True).build(text, folder), True)


def test_nodes_without_a_kernel_run_their_reference_and_failed_kernels_fall_back(monkeypatch):
    exe, kinds = check("""graph @g(%a: f32[4, 4], %b: f32[4, 4]) {
  %0: f32[4, 4] = inv(%a)
  %1: f32[4, 4] = add(%0, %b)
  return %1
}""")
    assert exe.info["choices"]["%0 = inv"] == "reference" and kinds == ["pointwise"]
    from kiln.backends.triton import backend

    def broken(*args, **kwargs):
        raise ValueError("no kernel today")
    monkeypatch.setattr(backend.TritonBuild, "kernel_source", broken)
    exe, _ = check("""graph @g(%x: f32[8]) {
  %0: f32[8] = exp(%x)
  return %0
}""", cache=False)
    assert exe.info["kernels"] == 0 and "no kernel today" in next(iter(exe.info["fallbacks"].values()))


# ------------------------------------------------------------------ analysis, configurations, logs
def test_analysis_band_registers_and_vector_nests():
    program = kl.parse("""program ln() {
  buffer x: f32[4, 8]
  buffer y: f32[4, 8]
  buffer s: f32[4] local
  for i in [0, 4) {
    S0: s[i] = 0.0:f32
    for r in [0, 8) {
      S1: s[i] += x[i, r]
    }
    for j in [0, 8) {
      S2: y[i, j] = x[i, j] - s[i]
    }
  }
}""")
    (phase,), scratch = phases(program)
    assert phase.band_vars == ["i"] and set(phase.registers) == {"s"} and not scratch
    reduction, store = phase.body[1], phase.body[2]
    assert vector_nest(reduction, {"i"}, phase.registers) is not None
    assert vector_nest(store, {"i"}, phase.registers) is not None
    assert interval(Binary("floordiv", Var("i") * 2 + 3, Const(2)), {"i": (0, 4)}) == (1, 5)
    assert interval(Binary("floormod", Var("i"), Const(3)), {"i": (0, 4)}) == (0, 2)


def test_config_tuner_times_once_and_remembers(tmp_path):
    configs = space("pointwise", {})
    times = {c["XBLOCK"]: t for c, t in zip(configs, [3.0, 1.0, 2.0, 4.0])}
    calls = []

    def measure(cfg):
        calls.append(cfg["XBLOCK"])
        return times[cfg["XBLOCK"]]
    tuner = ConfigTuner(tmp_path / "triton_configs.json", "test-gpu", tune=True)
    cfg, t, how = tuner.choose("kernel text", configs, measure)
    assert cfg["XBLOCK"] == 512 and t == 1.0 and len(calls) == len(configs)
    again = ConfigTuner(tmp_path / "triton_configs.json", "test-gpu", tune=True)
    cfg2, t2, how2 = again.choose("kernel text", configs, measure)
    assert cfg2 == cfg and t2 is None and how2 == "timed earlier" and len(calls) == len(configs)
    assert ConfigTuner(None, "x", tune=False).choose("k", configs, measure)[0] == configs[0]


def test_kiln_logs_kernels_prints_backend_name_choice_and_source(monkeypatch, capsys):
    monkeypatch.setenv("KILN_LOGS", "kernels")
    assert logs.enabled("kernels") and not logs.enabled("graphs")
    check("""graph @g(%x: f32[16], %y: f32[16]) {
  %0: f32[16] = add(%x, %y)
  return %0
}""", cache=False)
    err = capsys.readouterr().err
    assert "[kiln.kernels] triton kernel kiln_k0 (pointwise: %0 = add)" in err
    assert "choice triton, config XBLOCK=4096" in err and "@triton.jit" in err
    monkeypatch.setenv("KILN_LOGS", "")
    logs.kernel_log(backend="cuda", name="k", source="text", choice="cuda")
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ the GPU paths, without a GPU
BF16 = """graph @g(%a: bf16[33, 70], %b: bf16[70, 20], %c: bf16[20], %x: bf16[5, 33], %w: bf16[33]) {
  %0: bf16[33, 20] = matmul(%a, %b)
  %1: bf16[33, 20] = add(%0, %c)
  %2: bf16[5, 33] = layer_norm(%x, %w, %w) {normalized_rank=1}
  return %1, %2
}"""


def test_bf16_sources_generate_parse_and_compile_for_sm90(tmp_path):
    from kiln.backends.triton.offline import compile_module

    graph = default_pipeline()(ir.parse(BF16)).graph
    sources = [kernel_source(n, interpret=False, symbol=f"kiln_k{i}", comment=n.op_name)
               for i, n in enumerate(graph.nodes)]
    assert sorted(s.kind for s in sources) == ["matmul", "reduction"]
    text = module_text(sources, interpret=False)
    ast.parse(text)
    assert "tl.bfloat16" in text and "out_dtype=tl.float32" in text and "libdevice" in text
    compiled = compile_module(TritonToolchain(False).build(text, tmp_path))
    assert len(compiled) == 2 and all("cubin" in stages for stages in compiled.values())


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="bf16 arithmetic is not in Triton's interpreter: this runs on a CUDA GPU")
def test_bf16_kernels_on_the_gpu():
    graph = default_pipeline()(ir.parse(BF16)).graph
    args = [t.cuda() for t in operands(graph)]
    got = get_backend("triton").build(graph, {"interpret": False})(args)
    want = get_backend("reference").build(graph)([t.cpu() for t in args])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu().float(), w.float(), rtol=2e-2, atol=2e-2)
