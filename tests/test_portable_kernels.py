"""The AVX2 paths of kiln's hand-written C kernels (attention, convolutions, the GEMM
micro-kernel), run on a machine with AVX-512: each source built again with
``-march=x86-64-v3`` (AVX2 + FMA, no AVX-512), so the code a CPU without AVX-512 runs is
tested too; compared with PyTorch eager at odd sizes."""

from __future__ import annotations

import ctypes
import math
import subprocess

import pytest
import torch
import torch.nn.functional as F

from kiln.backends.cpu import attention as attention_module
from kiln.backends.cpu import microgemm
from kiln.backends.cpu.attention_source import SOURCE as ATTENTION_SOURCE
from kiln.backends.cpu.conv import KilnConv2d
from kiln.backends.cpu.conv_source import SOURCE as CONV_SOURCE
from kiln.backends.cpu.toolchain import c_compiler


def _has_avx2() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


pytestmark = pytest.mark.skipif(c_compiler() is None or not _has_avx2(),
                                reason="needs a C compiler and a CPU with AVX2")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    folder = tmp_path_factory.mktemp("avx2")

    def make(source: str, name: str) -> ctypes.CDLL:
        c, so = folder / f"{name}.c", folder / f"{name}.so"
        c.write_text(source)
        subprocess.run([c_compiler(), "-O2", "-march=x86-64-v3", "-fopenmp", "-fno-math-errno", "-std=gnu11",
                        "-shared", "-fPIC", str(c), "-o", str(so), "-lm"], check=True, capture_output=True)
        return ctypes.CDLL(str(so))
    return make


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape,causal", [((1, 3, 17, 70, 16), False), ((2, 2, 100, 100, 64), True),
                                          ((1, 1, 1, 3, 5), False)])
def test_portable_attention_kernel(build, shape, causal):
    lib = build(ATTENTION_SOURCE, "attention")
    lib.kiln_attention_has_bf16.restype = ctypes.c_int
    assert lib.kiln_attention_has_bf16() == 0  # the bf16 entry exists only with AVX-512
    fn = lib.kiln_attention_f32
    fn.argtypes, fn.restype = attention_module._ARGTYPES, ctypes.c_int
    b, h, L, S, E = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, E, generator=g) for n in (L, S, S))
    keep = torch.rand(b, 1, L, S, generator=g) < 0.7
    keep[..., 0] = True
    for mask in (None, keep):
        if causal and mask is not None:
            continue
        out = torch.empty(b, h, L, E)
        mt = keep.expand(b, h, L, S) if mask is not None else None
        ms = mt.stride() if mt is not None else (0, 0, 0, 0)
        assert fn(b, h, L, S, E, E, 1, q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(),
                  *v.stride()[:3], None if mt is None else mt.data_ptr(), 0 if mt is None else 1, *ms, int(causal),
                  1 / math.sqrt(E), out.data_ptr(), *out.stride()[:3], 2) == 0
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        assert _rel(out, want) <= 1e-4


@pytest.mark.parametrize("kind,x_shape,w_shape,stride,padding,groups", [
    ("gemm", (1, 17, 9, 11), (70, 17, 1, 1), 1, 0, 1),        # 1x1, A read in place
    ("gemm", (2, 3, 17, 19), (33, 3, 3, 3), 2, 1, 1),         # implicit GEMM, padded
    ("depthwise", (1, 24, 13, 17), (24, 1, 3, 3), 2, 1, 24),
    ("direct", (1, 3, 23, 29), (130, 3, 7, 7), 2, 3, 1),      # a stem: 16-channel blocks only here
])
def test_portable_convolution_kernels(build, kind, x_shape, w_shape, stride, padding, groups):
    lib = build(CONV_SOURCE, "conv")
    lib.kiln_conv_k.argtypes, lib.kiln_conv_k.restype = [ctypes.c_void_p], None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(x_shape, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(w_shape, generator=g), torch.randn(w_shape[0], generator=g)
    want = F.conv2d(x, w, b, stride, padding, 1, groups)
    residual = torch.randn(want.shape, generator=g)
    for act, fn in (("none", lambda t: t), ("relu", F.relu), ("hardswish", F.hardswish)):
        conv = KilnConv2d(kind, (stride, stride), (padding, padding), (1, 1), groups, act=act)
        conv._lib = lib
        assert _rel(conv(x, w, b, residual), fn(want + residual)) <= 1e-4


@pytest.mark.parametrize("m,n,k", [(1, 17, 3), (3, 1000, 17), (17, 33, 1000), (100, 70, 257)])
def test_portable_gemm_micro_kernel(build, m, n, k):
    lib = build(microgemm.SOURCE, "gemm")
    fn = lib.kiln_mgemm_f32
    fn.argtypes = [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                         ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
    fn.restype = ctypes.c_int
    g = torch.Generator().manual_seed(2)
    a, bm = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    c = torch.empty(m, n)
    # B unpacked (the kernel packs it) and transposed A
    at = a.t().contiguous().t()
    assert fn(m, n, k, at.data_ptr(), at.stride(0), at.stride(1), bm.data_ptr(), bm.stride(0), bm.stride(1), 0,
              c.data_ptr(), n) == 0
    assert _rel(c, a @ bm) <= 1e-4
