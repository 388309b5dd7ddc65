"""kiln's bfloat16 GEMM (kiln/backends/cpu/microgemm_bf16.py, ``kiln_mgemm_bf16``): the kernel at
odd sizes against float32 products of the same bf16 operands, the pair-panel layout, and
models in bf16 (``amp="bf16"`` and ``model.to(torch.bfloat16)``) whose matmuls run on it.

The kernel needs AVX-512 BF16 (``vdpbf16ps``) or AVX2 + FMA (bf16 storage, float32 arithmetic);
elsewhere bf16 matmuls are library calls, which the model tests check instead (they run
everywhere)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.backends.cpu import toolchain
from kiln.backends.cpu.microgemm import library
from kiln.backends.cpu.microgemm_bf16 import pack_pairs, packed_shape_bf16
from kiln.backends.cpu.packing import write_pairs
from kiln.runtime.cache import CompileCache


@pytest.fixture(scope="module")
def micro():
    lib = library(CompileCache(None, enabled=False), toolchain.cpu_compiler().cc)
    if lib is None:
        pytest.skip("no C compiler: kiln's GEMM library did not build")
    return lib


def _native(micro) -> bool:
    return micro.bf16 is not None


def _close_bf16(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``out`` (bf16) against the float32 ``ref``: within a few bf16 roundings of the largest
    value (a wrong element, a dropped k or panel is off by far more)."""
    scale = max(ref.abs().max().item(), 1e-6)
    err = (out.float() - ref).abs().max().item() / scale
    assert err <= 1.2e-2, f"{what}: max error {err:.3g} of the largest |value|"


SIZES = [(1, 1, 1), (3, 17, 5), (17, 1000, 3), (1, 1000, 1000), (13, 33, 257), (25, 48, 513), (100, 31, 600),
         (197, 40, 300), (200, 17, 600),  # the split by rows (M >= 192, N <= 1024), one and three K blocks
         (4, 70, 33), (2, 65, 768), (5, 19, 7),  # the few-rows path (M <= 4) and just past it
         (1000, 17, 3), (3, 1, 1000)]


@pytest.mark.parametrize("m,n,k", SIZES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_bf16_kernel_at_odd_sizes_matches_float32_products(micro, m, n, k, packed, transposed):
    if not _native(micro):
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2: kiln's bf16 GEMM is not offered")
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, k, generator=g).bfloat16().T if transposed else torch.randn(k, n, generator=g).bfloat16()
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    if packed:
        bp = torch.empty(packed_shape_bf16(k, n), dtype=torch.bfloat16)
        pack_pairs(b, bp)
        rc = micro.bf16.gemm(m, n, k, a.data_ptr(), a.stride(0), a.stride(1), bp.data_ptr(), 0, 0, True,
                             c.data_ptr(), n)
    else:
        rc = micro.bf16.gemm(m, n, k, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0),
                             b.stride(1), False, c.data_ptr(), n)
    assert rc == 0
    assert not c.isnan().any(), "some results were never written"
    _close_bf16(c, a.float() @ b.float(), f"{m}x{k} @ {k}x{n}")


@pytest.mark.parametrize("m,k", [(1, 9), (1, 600), (7, 9), (13, 600)])  # few rows / tiles, one / three K blocks
def test_results_round_to_nearest_even_like_torch(micro, m, k):
    """Integer sums are exact in float32 in any order, so C must equal torch's rounding of
    the exact product bit for bit; 256 + odd sums fall halfway between two bf16 values and
    must go to the even one (as vcvtneps2bf16 and torch do), in every K block layout."""
    if not _native(micro):
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2")
    g = torch.Generator().manual_seed(k + m)
    a = torch.randint(-2, 3, (m, k), generator=g).bfloat16()
    b = torch.randint(-3, 4, (k, 35), generator=g).float()
    b[0] *= 128  # sums near 256: ties between bf16 neighbours
    b = b.bfloat16()
    a[:, 0] = 2
    c = torch.empty(m, 35, dtype=torch.bfloat16)
    assert micro.bf16.gemm(m, 35, k, a.data_ptr(), k, 1, b.data_ptr(), 35, 1, False, c.data_ptr(), 35) == 0
    exact = a.float() @ b.float()
    assert torch.equal(c, exact.bfloat16()), f"first difference: {(c.float() - exact.bfloat16().float()).abs().max()}"


@pytest.mark.parametrize("m,k", [(7, 300), (3, 301), (1, 5)])  # the tiles, the few-rows path (odd K)
def test_a_strided_left_operand_and_a_wider_result_row(micro, m, k):
    """A read through strides (a transposed view) and C rows longer than N (``ldc``)."""
    if not _native(micro):
        pytest.skip("this CPU has neither AVX-512 BF16 nor AVX2")
    a = torch.randn(k, m).bfloat16().T  # m x k, column-major
    b = torch.randn(k, 40).bfloat16()
    c = torch.zeros(m, 64, dtype=torch.bfloat16)
    assert micro.bf16.gemm(m, 40, k, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0),
                           b.stride(1), False, c.data_ptr(), 64) == 0
    _close_bf16(c[:, :40], a.float() @ b.float(), "strided A")
    assert (c[:, 40:] == 0).all(), "columns past N were written"


@pytest.mark.parametrize("k,n", [(1, 1), (5, 17), (32, 16), (7, 33)])
def test_pair_panels_hold_each_value_at_its_place(k, n):
    b = torch.arange(k * n, dtype=torch.float32).reshape(k, n) + 1
    out = torch.full(packed_shape_bf16(k, n), -1.0, dtype=torch.bfloat16)
    write_pairs(b, out)
    expect = torch.zeros(out.shape)
    for kk in range(k):
        for nn in range(n):
            expect[nn // 16, kk // 2, 2 * (nn % 16) + kk % 2] = b[kk, nn]
    assert torch.equal(out.float(), expect.bfloat16().float())


class _Mlp(torch.nn.Module):
    def __init__(self, d: int = 96, hidden: int = 200):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d, bias=False)
        self.scale = torch.nn.Parameter(torch.randn(d, d) * 0.1)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        return self.down(h) + x @ self.scale  # a transposed weight, and a plain one


def _providers(compiled) -> list[str]:
    return compiled.executable.info["gemm_providers"]


def test_amp_bf16_matmuls_run_on_kilns_kernel_and_match_eager(micro):
    torch.manual_seed(0)
    model = _Mlp().eval()
    x = torch.randn(37, 96)
    with torch.no_grad():
        ref = model(x)
    compiled = kiln.compile(model, (x,), amp="bf16", cache=False)
    with torch.no_grad():
        out = compiled(x)
    assert out.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() / scale < 3e-2
    if _native(micro):
        assert _providers(compiled) == ["kiln+packed"] * 3
        assert compiled.executable.info["library_calls"] == 0
    else:
        assert not _providers(compiled)


@pytest.mark.parametrize("inference", [False, True])
def test_packed_bf16_weights_follow_in_place_updates(micro, inference):
    """The weights' bf16 copies and their pair panels are made again when a parameter changes,
    also when the first call runs in inference mode."""
    torch.manual_seed(1)
    model = _Mlp(32, 48).eval()
    x = torch.randn(5, 32)
    compiled = kiln.compile(model, (x,), amp="bf16", cache=False)
    mode = torch.inference_mode if inference else torch.no_grad
    for step in range(3):
        with mode():
            out = compiled(x)
        with torch.no_grad():
            ref = model(x)
        assert (out - ref).abs().max().item() / ref.abs().max().item() < 3e-2, f"step {step}"
        with torch.no_grad():
            model.up.weight.mul_(-1.5)
            model.scale.add_(0.25)


def test_a_bf16_model_with_batched_products(micro):
    """``model.to(torch.bfloat16)``: the weights are bf16 parameters; batched products of
    activations read a B that changes every call (packed in scratch by the kernel)."""
    torch.manual_seed(2)

    class Gram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 40)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            g = h @ h.transpose(-1, -2) * 0.1  # [b, s, s]
            return g @ h  # [b, s, 40]

    model = Gram().eval().to(torch.bfloat16)
    x = torch.randn(3, 19, 64).bfloat16()
    with torch.no_grad():
        ref = model.float()(x.float())
        model.to(torch.bfloat16)
    compiled = kiln.compile(model, (x,), cache=False)
    with torch.no_grad():
        out = compiled(x)
    assert out.dtype == torch.bfloat16
    _close_bf16(out, ref, "bf16 batched products")
    if _native(micro):
        assert sorted(_providers(compiled)) == ["kiln", "kiln", "kiln+packed"]


def test_float16_models_still_compile_and_match(micro):
    torch.manual_seed(3)
    model = _Mlp(16, 24).eval().to(torch.float16)
    x = torch.randn(4, 16).half()
    compiled = kiln.compile(model, (x,), cache=False)
    with torch.no_grad():
        out, ref = compiled(x), model.float()(x.float())
    assert (out.float() - ref).abs().max().item() / ref.abs().max().item() < 1e-2


# ------------------------------------------------------------------ half convolutions in float32

from kiln.backends.cpu.library import WidenedConv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_widened_half_convolution_matches_torchs(dtype):
    """Strides, padding, dilation and groups reach the float32 call in their order; the result
    is the half type, within a rounding or two of torch's own half convolution."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 17, 13, generator=g).to(dtype)
    w = torch.randn(8, 3, 3, 5, generator=g).to(dtype)
    b = torch.randn(8, generator=g).to(dtype)
    attrs = ((2, 1), (1, 2), (2, 1), 2)
    out = WidenedConv(torch.nn.functional.conv2d, attrs, persistent_weight=False)(x, w, b)
    ref = torch.nn.functional.conv2d(x.float(), w.float(), b.float(), *attrs)
    assert out.dtype == dtype and out.shape == ref.shape
    _close_bf16(out, ref, "widened conv")


def test_a_widened_parameter_weight_is_kept_until_it_changes():
    w = torch.randn(4, 3, 3, 3).bfloat16()
    x = torch.randn(1, 3, 8, 8).bfloat16()
    conv = WidenedConv(torch.nn.functional.conv2d, ((1, 1), (1, 1), (1, 1), 1), persistent_weight=True)
    first = conv(x, w)
    assert conv.weight(w) is conv.weight(w), "the widened copy is made again without a change"
    with torch.no_grad():
        w.mul_(2)
    second = conv(x, w)
    _close_bf16(second, 2 * first.float(), "after an in-place update")


class _Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 16, 4, stride=4)
        self.conv = torch.nn.Conv2d(16, 8, 3, padding=1, groups=2)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.conv(self.patch(x)))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("forced", ["1", "0"])  # widened, torch's half convolution
def test_amp_bf16_convolutions_match_eager_either_way(monkeypatch, forced):
    monkeypatch.setenv("KILN_NATIVE_KERNELS", forced)
    torch.manual_seed(4)
    model = _Cnn().eval()
    x = torch.randn(2, 3, 20, 20)
    with torch.no_grad():
        ref = model(x)
        compiled = kiln.compile(model, (x,), amp="bf16", backend="cpu", cache=False)
        out = compiled(x)
    assert (out - ref).abs().max().item() / ref.abs().max().item() < 3e-2
    labels = [step for step in map(str, compiled.executable.plan.steps) if "conv" in step]
    widened = [label for label in labels if "widened" in label]
    assert len(widened) == (2 if forced == "1" else 0), labels
