"""The CUDA printer and the nvcc toolchain of the cuda backend: every construct of kernel form
printed and compiled with nvcc (compile only: no GPU here), the whole translation unit of
every test model compiled, the unit linked and loaded, and its error reporting."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kiln
from kiln.backends.base import BackendError
from kiln.backends.cuda import backend as cuda_backend
from kiln.backends.cuda import toolchain
from kiln.backends.cuda.codegen import cuda_kernel, cuda_prelude
from kiln.backends.cuda.host import kernel_sources
from kiln.ir.errors import VerificationError
from kiln.ir.loops import parse_program
from kiln.passes.pipeline import resolve_passes
from kiln.runtime.call_plan import NativeRunStep

from models import MODELS

NVCC = toolchain.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not installed")
TEST_MODELS = ("mlp", "cnn", "resnet18", "gpt2", "bert")

REDUCE = """program reduce() {
  buffer x: f32[4, 256]
  buffer y: f32[4]
  buffer flags: bool[4]
  buffer big: f64[4]
  buffer idx: i64[4]
  buffer part: f32[8] shared
  buffer acc: f32[] register
  buffer lanes: f32[4] register
  for b in [0, 4) @mapped("blockIdx.x") {
    for t in [0, 256) @mapped("threadIdx.x") {
      S0: acc[] = x[b, t]
      S1: lanes[0] = shfl_xor(acc[], 16, 32)
      S2: lanes[1] = shfl_down(acc[], 8, 16)
      S3: lanes[2] = shfl_up(acc[], 1, 8)
      S4: lanes[3] = shfl_idx(acc[], 0, 32)
      S5: acc[] += lanes[0] + lanes[1] + lanes[2] + lanes[3]
      if (floormod(t, 32) == 0) {
        S6: part[floordiv(t, 32)] = acc[]
      }
      barrier
      for s in [0, 3) {
        if (t < 4) {
          S7: part[t] max= part[t + 4]
        }
        barrier warp
      }
      if (t == 0) {
        S8: y[b] = max(part[0], -inf:f32)
        S9: flags[b] = part[0] != part[0]
        S10: big[b] = select(flags[b], nan:f64, f64(part[1]))
        S11: idx[b] = floordiv(b - 2, 3) + floormod(b - 2, 3)
      }
    }
  }
}"""

COPIES = """program copies() {
  buffer x: f32[16, 64]
  buffer h: f16[16, 64]
  buffer out: bf16[16, 64]
  buffer sx: f32[2, 64] shared
  buffer sh: f16[2, 64] shared
  buffer r: f32[8] register
  buffer rh: f16[8] register
  for by in [0, 8) @mapped("blockIdx.y") {
    for bx in [0, 2) @mapped("blockIdx.x") {
      for ty in [0, 2) @mapped("threadIdx.y") {
        for tx in [0, 8) @mapped("threadIdx.x") {
          S0: r[0] = vec4(x[by * 2 + ty, tx * 8])
          S1: r[4] = vec2(x[by * 2 + ty, tx * 8 + 2])
          S2: rh[0] = vec8(h[by * 2 + ty, tx * 8])
          S3: sx[ty, tx * 8] = async_vec4(x[by * 2 + ty, tx * 8])
          S4: sx[ty, tx * 8 + 4] = async_vec1(x[by * 2 + ty, tx * 8 + 4])
          S5: sh[ty, tx * 8] = async_vec2(h[by * 2 + ty, tx * 8])
          S6: sh[ty, tx * 8] = async_vec8(h[by * 2 + ty, tx * 8])
          S9: sx[ty, tx * 8 + 2] = async_vec2(x[by * 2 + ty, tx * 8 + 2])
          S7: sh[ty, tx * 8] = vec1(h[by * 2 + ty, tx * 8])
          commit_copies
          wait_copies 0
          barrier
          S8: out[by * 2 + ty, tx * 8 + bx] = bf16(f32(sh[ty, tx * 8]) * r[1] + f32(rh[2]))
        }
      }
    }
  }
}"""

WIDE = """program wide() {
  buffer x: f32[65536, 65536]
  buffer y: f32[65536]
  for b in [0, 256) @mapped("blockIdx.x") {
    for t in [0, 256) @mapped("threadIdx.x") {
      S0: y[b * 256 + t] = x[b * 256 + t, 65535]
    }
  }
}"""


@pytest.fixture(scope="module")
def printed():
    return {name: cuda_kernel(f"kiln_test_{name}", parse_program(text), comment=f"test {name}")
            for name, text in (("reduce", REDUCE), ("copies", COPIES), ("wide", WIDE))}


def test_printer_spells_each_construct(printed):
    r, c, w = printed["reduce"].text, printed["copies"].text, printed["wide"].text
    assert 'extern "C" __global__ void __launch_bounds__(256) kiln_test_reduce(' in r
    assert "const float *__restrict__ b0" in r and "float *__restrict__ b1" in r and "bool *__restrict__ b2" in r
    assert "__shared__ __align__(16) float b5[8];" in r and "float b6[1] = {};" in r
    assert "const int v0 = blockIdx.x;" in r and "const int v1 = threadIdx.x;" in r
    for call in ("__shfl_xor_sync(0xffffffffu, b6[0], (int)(16), 32)", "__shfl_down_sync(0xffffffffu, b6[0], (int)(8), 16)",
                 "__shfl_up_sync(0xffffffffu, b6[0], (int)(1), 8)", "__shfl_sync(0xffffffffu, b6[0], (int)(0), 32)"):
        assert call in r
    assert "__syncthreads();" in r and "__syncwarp();" in r
    assert "b5[v1 / 32] = b6[0];" in r  # floordiv of a non-negative index: plain division
    assert "kiln_floordiv(v0 - 2, 3)" in r  # maybe negative: the exact helper
    assert "-__int_as_float(0x7F800000)" in r and "__longlong_as_double(0x7FF8000000000000LL)" in r
    assert printed["reduce"].grid == (4, 1, 1) and printed["reduce"].block == (256, 1, 1)
    assert printed["copies"].grid == (2, 8, 1) and printed["copies"].block == (8, 2, 1)
    assert "const int v0 = blockIdx.y;" in c and "const int v3 = threadIdx.x;" in c
    assert "*reinterpret_cast<float4 *>(&b5[0]) = *reinterpret_cast<const float4 *>(&b0[" in c
    assert "*reinterpret_cast<float2 *>(&b5[4]) = *reinterpret_cast<const float2 *>(&b0[" in c
    assert "*reinterpret_cast<uint4 *>(&b6[0]) = *reinterpret_cast<const uint4 *>(&b1[" in c
    for size in ("cg.shared.global [%0], [%1], 16;", "ca.shared.global [%0], [%1], 4;",
                 "ca.shared.global [%0], [%1], 8;"):
        assert "cp.async." + size in c
    assert "*reinterpret_cast<unsigned short *>(&b4[" in c  # one f16: 2 bytes
    assert 'asm volatile("cp.async.commit_group;\\n" ::);' in c and 'cp.async.wait_group 0;' in c
    assert "__float2bfloat16_rn(" in c and "__half2float(b4[" in c and "__half2float(b6[2])" in c
    assert "long v0 = blockIdx.x" in w  # 2**32 cells: 64-bit indices
    assert "b0[(v0 * 256 + v1) * 65536 + 65535]" in w


@needs_nvcc
def test_printed_kernels_compile_with_nvcc(printed, tmp_path):
    unit = cuda_prelude(True) + "\n".join(k.text for k in printed.values()) + "\n"
    obj = toolchain.NvccCompiler(NVCC).check(unit, tmp_path)
    assert obj.exists() and obj.stat().st_size > 0


def test_kernels_that_do_not_verify_are_refused():
    local = REDUCE.replace("buffer part: f32[8] shared", "buffer part: f32[8] local")
    with pytest.raises(VerificationError, match="part"):
        cuda_kernel("kiln_bad", parse_program(local))
    with pytest.raises(ValueError, match="not a C identifier"):
        cuda_kernel("bad name", parse_program(REDUCE))


# ------------------------------------------------------------------ whole units
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The folder test_cuda_backend.py builds the test models in (one per session): units
    built there are compile-cache hits here."""
    return str(tmp_path_factory.getbasetemp() / "kiln-cuda-cache")


@pytest.fixture(scope="module")
def units(cache_dir):
    out = {}
    for name in TEST_MODELS:
        build, inputs = MODELS[name]
        args, kwargs = inputs()
        compiled = kiln.compile(build(), args, backend="cuda", emulate=True, example_kwargs=kwargs,
                                cache_dir=cache_dir)
        out[name] = compiled.executable
    return out


@needs_nvcc
def test_every_test_model_unit_compiles_with_nvcc(units, tmp_path):
    compiler = toolchain.NvccCompiler(NVCC)

    def check(item):
        name, exe = item
        folder = tmp_path / name
        return name, compiler.check(exe.cuda_source, folder)

    with ThreadPoolExecutor(2) as pool:
        done = dict(pool.map(check, units.items()))
    assert set(done) == set(TEST_MODELS)
    for name, exe in units.items():
        assert exe.info["gpu_kernels"] == len(kernel_sources(exe.cuda_source)) > 0, name


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a machine without a GPU")
def test_the_gpu_build_builds_loads_and_reports_cuda_errors(cache_dir, monkeypatch):
    build, inputs = MODELS["mlp"]
    model = build()
    (x,), _ = inputs()
    graph = resolve_passes("default")(kiln.capture(model, (x,)))
    backend = cuda_backend.CudaBackend()
    opts = backend.resolve_options({"cache_dir": cache_dir})  # no check_options: it wants a GPU
    pipeline = backend.pipeline(opts)
    exe = pipeline.run(graph, backend.chooser(opts, pipeline))
    assert isinstance(exe, cuda_backend.CudaExecutable) and not exe.emulated
    assert exe.cuda_source == exe.source and exe.info["fallbacks"] == {}
    assert set(exe.sources) == set(re.findall(r"^  (kiln_k\d+_\d+)<<<", exe.source, re.M))
    for symbol in ("kiln_run", "kiln_set_stream", "kiln_error", "kiln_k0"):
        assert hasattr(exe.library, symbol), symbol
    with pytest.raises(BackendError, match="move the model and inputs to CUDA"):
        exe([x, *(p.detach() for p in model.parameters())])

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    step = next(s for s in exe.plan.steps if isinstance(s, NativeRunStep))
    slots = [torch.zeros(1)] * exe.plan.num_slots  # never read: the CUDA runtime fails first
    call = step.bind(set(), slots)
    with pytest.raises(BackendError, match=r"kiln backend 'cuda': kiln_k\d+_0: .*\(cuda"):
        call(slots)
    assert exe.library.kiln_error() is None  # reading the error cleared it


def test_toolchain_identity_and_a_missing_nvcc(monkeypatch):
    compiler = toolchain.NvccCompiler(NVCC or "nvcc", "sm_80")
    if NVCC is not None:
        assert "arch=sm_80" in compiler.identity() and "release" in compiler.identity()
    assert compiler.artifact == "cuda_so" and compiler.source_suffix == "cu"
    monkeypatch.setattr(toolchain, "find_tool", lambda env, candidates: None)
    with pytest.raises(BackendError, match="emulate=True"):
        toolchain.require_nvcc()
    if not torch.cuda.is_available():
        assert toolchain.device_arch() == toolchain.DEFAULT_ARCH
