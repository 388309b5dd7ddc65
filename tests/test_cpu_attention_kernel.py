"""kiln's fused CPU attention kernel (kiln/backends/cpu/attention.py) against the op's numpy
reference and PyTorch eager: causal, bool and float masks (broadcast), GQA, fully masked
rows, strided views, odd sizes (1, 3, 17, 1000); bad input; the library call's choice and
its use inside a compiled graph."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.backends.cpu import attention as attention_module
from kiln.backends.cpu.attention import KEY_BLOCK, QUERY_TILE, attention, attention_call, kernel
from kiln.backends.cpu.standalone import ENV_VAR, KernelChooser
from kiln.ir import Graph, get_op
from kiln.ir.types import DType, TensorType

pytestmark = pytest.mark.skipif(kernel() is None, reason="needs a C compiler with OpenMP")

REFERENCE = get_op("scaled_dot_product_attention").reference


def _rel(got: torch.Tensor, want) -> float:
    want = torch.as_tensor(np.asarray(want)).double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _check(q, k, v, mask=None, causal=False, scale=None):
    got = attention(q, k, v, mask, is_causal=causal, scale=scale)
    ref = REFERENCE(q.numpy(), k.numpy(), v.numpy(), None if mask is None else mask.numpy(),
                    is_causal=causal, scale=scale)
    assert got.shape == tuple(ref.shape)
    assert _rel(got, ref) <= 1e-4
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    if mask is None or not mask.dtype == torch.bool or mask.any(-1).all():  # eager gives NaN rows otherwise
        assert _rel(got, eager) <= 1e-4
    return got


def _qkv(b, h, L, S, E, Ev, seed=0, hk=None):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, L, E, generator=g), torch.randn(b, hk or h, S, E, generator=g),
            torch.randn(b, hk or h, S, Ev, generator=g))


@pytest.mark.parametrize("L,S", [(1, 1), (3, 3), (17, 17), (3, 17), (17, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_sizes(L, S, causal):
    _check(*_qkv(2, 3, L, S, 5, 17), causal=causal)


def test_large_sequence_crosses_tiles_and_blocks():
    # 1000 queries and keys: many query tiles and key blocks, a ragged last of each
    assert 1000 % QUERY_TILE and 1000 % KEY_BLOCK
    q, k, v = _qkv(1, 1, 1000, 1000, 8, 16, seed=1)
    _check(q, k, v)
    _check(q, k, v, causal=True)


def test_head_size_64_scale_and_batch_axes():
    q, k, v = _qkv(2, 4, 33, 70, 64, 64, seed=2)
    _check(q, k, v, scale=0.3)
    _check(q[0], k[0], v[0])            # 3-d: one batch axis
    _check(q[0, 0], k[0, 0], v[0, 0])   # 2-d: no batch axis


def test_bool_and_float_masks_broadcast():
    q, k, v = _qkv(2, 3, 17, 70, 16, 16, seed=3)
    keep = torch.rand(2, 1, 17, 70, generator=torch.Generator().manual_seed(4)) < 0.7
    _check(q, k, v, keep)
    _check(q, k, v, torch.randn(1, 3, 17, 70))
    _check(q, k, v, torch.randn(1, 70))               # one additive bias per key
    padding = torch.zeros(2, 1, 1, 70)
    padding[1, ..., 50:] = -math.inf
    _check(q, k, v, padding)


def test_fully_masked_rows_give_zeros():
    q, k, v = _qkv(1, 2, 17, 70, 8, 8, seed=5)
    keep = torch.rand(1, 2, 17, 70, generator=torch.Generator().manual_seed(6)) < 0.5
    keep[0, 1, 3] = False
    keep[0, 0, 16] = False
    got = _check(q, k, v, keep)
    assert torch.equal(got[0, 1, 3], torch.zeros(8)) and torch.equal(got[0, 0, 16], torch.zeros(8))
    assert torch.isfinite(got).all()
    minus_inf = torch.zeros(1, 2, 17, 70)
    minus_inf[0, 0, 5] = -math.inf
    got = _check(q, k, v, minus_inf)
    assert torch.equal(got[0, 0, 5], torch.zeros(8))


def test_grouped_query_attention():
    q, k, v = _qkv(2, 6, 17, 33, 8, 8, seed=7, hk=2)
    got = attention(q, k, v, is_causal=True)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    assert _rel(got, want) <= 1e-4
    # one shared key/value head (multi-query) is plain broadcasting
    _check(*_qkv(2, 6, 17, 33, 8, 8, seed=8, hk=1))


@pytest.mark.parametrize("causal", [False, True])
def test_key_and_value_batch_axes_broadcast_against_each_other(causal):
    """k and v may differ in batch axes where they broadcast (Falcon's graph passes keys
    expanded to the heads and one shared value head), as the op's type rule allows."""
    q, k, v = _qkv(2, 4, 9, 13, 8, 8, seed=10)
    _check(q, k, v[:, :1], causal=causal)
    _check(q, k[:1, :1], v[:1], causal=causal)


def test_strided_views_of_a_projection():
    # GPT-2 style: heads are a permuted view of [B, S, H, E]; the head axis is not unit-stride
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(2, 19, 3, 4, 16, generator=g).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    assert not q.is_contiguous()
    _check(q, k, v, causal=True)
    _check(q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2))  # v with a non-unit last stride


def test_bad_input_is_refused_clearly():
    q, k, v = _qkv(1, 1, 3, 3, 4, 4)
    with pytest.raises(TypeError, match="float32"):
        attention(q.double(), k, v)
    with pytest.raises(ValueError, match="embedding size"):
        attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="keys"):
        attention(q, k, v[..., :2, :])
    with pytest.raises(ValueError, match="not both"):
        attention(q, k, v, torch.ones(3, 3, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="broadcast"):
        attention(q, k, v, torch.ones(5, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        attention(q, k, v, torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="do not broadcast"):
        attention(*_qkv(1, 2, 3, 3, 4, 4, hk=2)[:2], _qkv(1, 3, 3, 3, 4, 4)[2])
    with pytest.raises(ValueError, match="at least 2-d"):
        attention(q, k, torch.ones(3))


def _sdpa_node(shape=(1, 2, 9, 8), dtype=DType.float32, causal=True):
    g = Graph("attn")
    ins = [g.add_input(n, TensorType(shape, dtype)) for n in "qkv"]
    return g.add_node("scaled_dot_product_attention", ins, {"is_causal": causal})


def test_library_call_follows_the_choice(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    assert attention_call(_sdpa_node()).label.startswith("kiln fused attention")
    monkeypatch.setenv(ENV_VAR, "0")
    assert attention_call(_sdpa_node()).label == "torch.nn.functional.scaled_dot_product_attention"
    monkeypatch.setenv(ENV_VAR, "1")  # not float32: always torch's
    assert attention_call(_sdpa_node(dtype=DType.float64)).label.startswith("torch")


def test_choice_is_measured_once_and_remembered(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    calls = {"kiln": 0, "library": 0}

    def counted(name):
        def run():
            calls[name] += 1
        return run

    chooser = KernelChooser("test-family", rounds=2)
    first = chooser.choose("shape-a", counted("kiln"), counted("library"))
    assert first in ("kiln", "library") and calls == {"kiln": 3, "library": 3}  # warm-up + 2 rounds
    assert chooser.choose("shape-a", counted("kiln"), counted("library")) == first
    assert calls == {"kiln": 3, "library": 3}  # remembered: not timed again
    assert (tmp_path / "kernels.json").exists()


class Attend(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(32, 96)

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal).sum(1)


@pytest.mark.parametrize("causal,masked", [(True, False), (False, True)])
def test_compiled_graph_runs_kiln_attention(monkeypatch, causal, masked):
    monkeypatch.setenv(ENV_VAR, "1")
    calls = []
    original = attention_module.attention
    monkeypatch.setattr(attention_module, "attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    model = Attend(causal).eval()
    x = torch.randn(2, 17, 32)
    args = (x,)
    if masked:
        mask = torch.rand(2, 1, 17, 17) < 0.8
        mask[..., 0] = True
        args = (x, mask)
    with torch.no_grad():
        want = model(*args)
        for backend in ("cpu", "reference"):
            got = kiln.compile(model, args, backend=backend)(*args)
            assert _rel(got, want) <= 1e-4, backend
    assert calls, "the cpu executable did not call kiln's attention kernel"


def test_choice_is_timed_on_the_layout_the_graph_passes(monkeypatch):
    # a transformer's q, k, v are views of one projection: the two kernels are timed on
    # operands with those strides, and the layout is part of the remembered choice's key
    seen = []

    def record(signature, kiln_run, library_run):
        seen.append(signature)
        kiln_run()
        library_run()
        return "kiln"

    monkeypatch.setattr(attention_module._CHOOSER, "choose", record)
    node = _sdpa_node(shape=(1, 3, 17, 8), causal=False)
    strides = [(3 * 17 * 3 * 8, 8, 3 * 3 * 8, 1)] * 3  # [B, L, 3, H, E] permuted to [B, H, L, E]
    made = []
    original = attention_module.random_operands
    monkeypatch.setattr(attention_module, "random_operands",
                        lambda n, s: made.append(original(n, s)) or made[-1])
    assert attention_call(node, strides=strides).label.startswith("kiln fused attention")
    assert [t.stride() for t in made[0]] == strides
    assert "strides=" in seen[0]
    attention_call(node)
    assert "strides=" not in seen[1] and all(t.is_contiguous() for t in made[1])


class Projected(nn.Module):
    """ViT-style attention: q, k, v are strided views of one projection."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(48, 144)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 3, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def test_compiled_graph_passes_the_views_strides_to_the_choice(monkeypatch):
    signatures = []
    original = attention_module._CHOOSER.choose
    monkeypatch.setattr(attention_module._CHOOSER, "choose",
                        lambda sig, k, l: signatures.append(sig) or original(sig, k, l))
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(0)
    model = Projected().eval()
    x = torch.randn(2, 19, 48)
    with torch.no_grad():
        got = kiln.compile(model, (x,), backend="cpu")(x)
        assert _rel(got, model(x)) <= 1e-4
    # q of [2, 19, 3, 3, 16] permuted: head stride 16, row stride 144, batch stride 19 * 144
    assert signatures and f"{(19 * 144, 16, 144, 1)}" in signatures[0]


@pytest.mark.parametrize("L,S,E", [(1000, 1000, 64), (3, 17, 64), (200, 70, 80)])
def test_shared_packing_buffer_grows_and_shrinks_between_calls(L, S, E):
    # the packed keys and values live in a buffer kept between calls: a larger call after a
    # smaller one (and back) must not read stale or short memory
    _check(*_qkv(1, 2, 17, 17, 8, 8, seed=10))
    _check(*_qkv(2, 3, L, S, E, E, seed=11), causal=L == S)
    _check(*_qkv(1, 1, 5, 9, 8, 24, seed=12))


def test_choice_times_a_broadcast_mask_through_its_zero_strides(monkeypatch):
    monkeypatch.setattr(attention_module._CHOOSER, "choose", lambda sig, k, l: (k(), l(), "kiln")[-1])
    g = Graph("masked")
    ins = [g.add_input(n, TensorType((1, 3, 17, 8), DType.float32)) for n in "qkv"]
    ins.append(g.add_input("mask", TensorType((1, 3, 17, 17), DType.float32)))
    node = g.add_node("scaled_dot_product_attention", ins, {"is_causal": False})
    strides = [None, None, None, (0, 0, 0, 1)]  # one additive bias per key, expanded
    made = attention_module.random_operands(node, strides)
    assert made[3].stride() == (0, 0, 0, 1) and made[0].is_contiguous()
    assert attention_call(node, strides=strides).label.startswith("kiln fused attention")


needs_bf16 = pytest.mark.skipif(kernel(torch.bfloat16) is None, reason="kiln's bf16 attention needs AVX-512")


def _check_bf16(q, k, v, mask=None, causal=False, scale=None):
    """bfloat16 attention: the float32 attention of the same (bf16) values, rounded once."""
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = attention(q, k, v, mask, is_causal=causal, scale=scale)
    assert got.dtype == torch.bfloat16
    want = attention(q.float(), k.float(), v.float(), mask, is_causal=causal, scale=scale)
    # within one bf16 rounding of the float32 result (relative 2^-8)
    assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()
    return got


@needs_bf16
@pytest.mark.parametrize("L,S", [(1, 1), (3, 17), (17, 3), (100, 130)])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_odd_sizes(L, S, causal):
    _check_bf16(*_qkv(2, 3, L, S, 5, 17, seed=13), causal=causal)
    _check_bf16(*_qkv(1, 8, L, S, 64, 64, seed=14), causal=causal)  # heads enough to pack per thread


@needs_bf16
def test_bf16_masks_gqa_views_and_fully_masked_rows():
    q, k, v = _qkv(1, 2, 17, 70, 8, 8, seed=15)
    keep = torch.rand(1, 2, 17, 70, generator=torch.Generator().manual_seed(16)) < 0.5
    keep[0, 1, 3] = False
    got = _check_bf16(q, k, v, keep)
    assert torch.equal(got[0, 1, 3].float(), torch.zeros(8))
    _check_bf16(q, k, v, torch.randn(1, 70))
    q, k, v = _qkv(2, 6, 17, 33, 8, 8, seed=17, hk=2)
    got = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    want = F.scaled_dot_product_attention(q.bfloat16().float(), k.bfloat16().float().repeat_interleave(3, 1),
                                          v.bfloat16().float().repeat_interleave(3, 1), is_causal=True)
    assert _rel(got.float(), want) <= 2.0 ** -7
    qkv = torch.randn(2, 19, 3, 4, 16, generator=torch.Generator().manual_seed(18)).bfloat16().permute(2, 0, 3, 1, 4)
    _check_bf16(qkv[0], qkv[1], qkv[2], causal=True)
    with pytest.raises(TypeError, match="one dtype"):
        attention(q.bfloat16(), k, v)


@needs_bf16
def test_bf16_nodes_get_kiln_attention_and_an_amp_graph_runs_it(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    assert attention_call(_sdpa_node(dtype=DType.bfloat16)).label.startswith("kiln fused attention")
    calls = []
    original = attention_module.attention
    monkeypatch.setattr(attention_module, "attention",
                        lambda q, *a, **k: calls.append(q.dtype) or original(q, *a, **k))
    torch.manual_seed(0)
    model = Attend(True).eval()
    x = torch.randn(2, 17, 32)
    with torch.no_grad():
        got = kiln.compile(model, (x,), backend="cpu", amp="bf16")(x)
        assert _rel(got.float(), model(x)) <= 2e-2
    assert torch.bfloat16 in calls
