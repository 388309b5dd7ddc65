"""The ATen ops the model zoo stopped at, against eager, and clear errors at the edges.

* ``as_strided`` / ``as_strided_copy`` / ``as_strided_scatter`` (the adaptive average pool
  of a transposed input under ``torch.compile``, Swin and UperNet): views recognised as
  reshape/permute/slice/expand, other layouts gathered, overlapping or outside reads refused;
* ``_transformer_encoder_layer_fwd`` / ``_native_multi_head_attention`` (``nn``'s inference
  fast path) against the slow path, for every norm_first x activation x mask combination;
* max pooling with ``return_indices``, ``max_unpool2d/3d`` and adaptive max pooling whose
  output size does not divide the input;
* errors: a callable object compiles; data-dependent shapes name the op's own reason.

Forward results run through ``kiln.compile(..., strict=True)`` on both backends; gradients
through ``torch.compile(backend="kiln", options={"strict": True})`` with
``loss = (out * R).sum()``, judged by :mod:`kiln.zoo.compare` (float64 reference).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontends.torch import aten_transformer
from kiln.frontends.torch.aten import ATEN_TABLE, AtenRule
from kiln.frontends.torch.aten_support import bad_value
from kiln.zoo.compare import compare_all, flatten_outputs, weighted_loss, weights_for

BACKENDS = ("reference", "cpu")


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_torch_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _double(xs):
    return tuple(x.double() if x.is_floating_point() else x for x in xs)


def assert_matches(actual, fn, inputs, fn64=None):
    """kiln's outputs against eager float32 and float64 by the zoo's comparison rule."""
    eager = flatten_outputs(fn(*inputs))
    ref = flatten_outputs((fn64 or fn)(*_double(inputs)))
    got = flatten_outputs(actual)
    results = compare_all(got, eager, ref)
    assert results and all(c.ok for c in results), [c for c in results if not c.ok]


def assert_grads_match(fn, inputs, reference=None):
    """Gradients of ``(fn(*inputs) * R).sum()`` through torch.compile(backend="kiln")
    against eager float32 and float64 (of ``reference``, ``fn`` by default)."""
    def grads(f, xs):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
        outs = flatten_outputs(f(*xs))
        weighted_loss(outs, weights_for(outs)).backward()
        return {f"d{i}": x.grad for i, x in enumerate(xs) if x.grad is not None}

    compiled = torch.compile(fn, backend="kiln", options={"strict": True})
    got = grads(compiled, inputs)
    eager = grads(reference or fn, inputs)
    ref = grads(reference or fn, _double(inputs))
    assert set(got) == set(ref) and ref
    results = compare_all(got, eager, ref)
    assert all(c.ok for c in results), [c for c in results if not c.ok]


def op_names(fn, inputs) -> list[str]:
    return [n.op.name for n in kiln.capture(fn, inputs).nodes]


# ------------------------------------------------------------------ as_strided
def test_adaptive_avg_pool_of_transposed_input_under_torch_compile():
    """The zoo's repro: make_fx decomposes adaptive_avg_pool1d into mean + as_strided (the
    channels-last restride of the 1x1 result)."""
    def fn(x):
        return F.adaptive_avg_pool1d(x.transpose(1, 2), 1)

    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        out = torch.compile(fn, backend="kiln", options={"strict": True})(x)
    assert_matches(out, fn, (x,))
    torch._dynamo.reset()
    assert_grads_match(fn, (x,))


def _strided_cases(x, y):
    """``x``: contiguous (4, 6); ``y``: contiguous (3, 5, 2)."""
    t = x.t()  # a transposed (non-contiguous) layout
    return (
        torch.as_strided(x, (6, 4), (1, 6)),                 # transpose: permute
        torch.as_strided(x, (2, 3), (6, 1), 7),              # a window: slice + reshape
        torch.as_strided(x, (2, 3), (6, 1), 15),             # reaching the end: pad + slice
        torch.as_strided(x, (3, 4, 2), (0, 6, 1), 2),        # stride 0: expand
        torch.as_strided(x, (5, 4), (2, 1), 2),              # overlapping windows: gather
        torch.as_strided(t, (3, 2), (1, 6), 1),              # of a transposed input
        torch.as_strided(y, (2, 5), (10, 2), 1),             # strided slice of a 3-d input
        torch.as_strided_scatter(x, y[0, :4, :], (4, 2), (6, 2), 1),
        torch.as_strided_scatter(x, y.reshape(-1)[:24].reshape(6, 4), (6, 4), (1, 6)),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_as_strided_layouts_match_eager(backend):
    x, y = torch.randn(4, 6), torch.randn(3, 5, 2)
    compiled = kiln.compile(_strided_cases, (x, y), strict=True, backend=backend)
    for got, want in zip(compiled(x, y), _strided_cases(x, y)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_as_strided_views_need_no_gather():
    x = torch.randn(4, 6)
    assert "index" not in op_names(lambda x: torch.as_strided(x, (6, 4), (1, 6)), (x,))
    assert "index" not in op_names(lambda x: torch.as_strided(x, (2, 3), (6, 1), 15), (x,))
    assert "index" not in op_names(lambda x: torch.as_strided(x, (3, 4, 2), (0, 6, 1), 2), (x,))
    assert "index" not in op_names(lambda x: torch.as_strided(x, (5, 4), (4, 1), 2), (x,))
    assert "index" in op_names(lambda x: torch.as_strided(x, (5, 4), (2, 1), 2), (x,))


def _scatter_by_copy(x, y):
    """The two as_strided_scatter cases as a write into a view of a copy: eager's gradient
    of ``as_strided_scatter`` itself passes the whole cotangent to ``x``, also where ``src``
    overwrites it (torch 2.13), while the write's gradient is zero there."""
    a, b = x.clone(), x.clone()
    a.as_strided((4, 2), (6, 2), 1).copy_(y[0, :4, :])
    b.as_strided((6, 4), (1, 6)).copy_(y.reshape(-1)[:24].reshape(6, 4))
    return a, b


def test_as_strided_gradients_match_eager():
    inputs = (torch.randn(4, 6), torch.randn(3, 5, 2))
    assert_grads_match(lambda x, y: _strided_cases(x, y)[:-2], inputs)
    torch._dynamo.reset()
    assert_grads_match(lambda x, y: _strided_cases(x, y)[-2:], inputs, reference=_scatter_by_copy)


def test_as_strided_refuses_what_cannot_be_mapped():
    x = torch.randn(4, 6)
    with pytest.raises(kiln.UnsupportedOpError, match="overlapping layout"):
        kiln.capture(lambda x: torch.as_strided(x[:1].expand(4, 6), (2, 2), (1, 1)), (x,))
    with pytest.raises(kiln.UnsupportedOpError, match="holds no element of its input"):
        kiln.capture(lambda x: torch.as_strided(x[:, :3], (2, 4), (6, 1)), (x,))
    with pytest.raises(kiln.UnsupportedOpError, match="overlaps itself"):
        kiln.capture(lambda x: torch.as_strided_scatter(x, torch.ones(3, 2), (3, 2), (1, 1)), (x,))


# ------------------------------------------------------- transformer fast path
@pytest.fixture
def lowered(monkeypatch):
    """Names of the fast-path ATen ops kiln lowered (proves the fast path was taken)."""
    seen: list[str] = []
    for op in (aten_transformer._MHA, aten_transformer._ENCODER):
        rule = ATEN_TABLE[op]

        def lower(*args, _rule=rule, _op=op, **kwargs):
            seen.append(str(_op))
            return _rule.lower(*args, **kwargs)

        monkeypatch.setitem(ATEN_TABLE, op, AtenRule(lower, rule.check))
    return seen


B, L, E, H = 2, 6, 16, 4


def _masks():
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, 4:] = True
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    dead = torch.zeros(B, L, dtype=torch.bool)
    dead[1] = True  # every key of batch 1 masked out: NaN rows, in both paths

    def as_float(m):
        return torch.zeros(m.shape).masked_fill(m, -math.inf)

    return [(None, None), (None, pad), (causal, None), (as_float(causal), None),
            (None, as_float(pad)), (causal, pad)], dead


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_fast_path_matches_slow_path(norm_first, activation, lowered):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, activation=activation,
                                             norm_first=norm_first, batch_first=True).eval()
    layer64 = copy.deepcopy(layer).double()
    masks, dead = _masks()

    def run(model):
        def fn(x):
            return tuple(model(x, src_mask=m, src_key_padding_mask=p) for m, p in masks)
        return fn

    def run64(x):
        return tuple(layer64(x, src_mask=None if m is None else m.double() if m.is_floating_point() else m,
                             src_key_padding_mask=None if p is None else p.double() if p.is_floating_point() else p)
                     for m, p in masks)

    x = torch.randn(B, L, E)
    with torch.no_grad():
        out = torch.compile(run(layer), backend="kiln", options={"strict": True})(x)
    assert lowered.count(str(aten_transformer._ENCODER)) == len(masks)
    assert_matches(out, run(layer), (x,), run64)  # eager with gradients on: the slow path

    # Every key of batch 1 masked out: the fast path gives NaN rows (the slow path does not)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lambda x: layer(x, src_key_padding_mask=dead), backend="kiln",
                            options={"strict": True})(x)
        want = layer(x, src_key_padding_mask=dead)
    assert torch.isnan(want[1]).all() and torch.isnan(got[1]).all()
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)


def test_encoder_layer_batch_first_false_runs_the_slow_path():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=False).eval()
    x = torch.randn(L, B, E)
    with torch.no_grad():
        out = torch.compile(layer, backend="kiln", options={"strict": True})(x)
    assert_matches(out, layer, (x,), copy.deepcopy(layer).double())


def _mha_inputs():
    torch.manual_seed(1)
    return (torch.randn(B, L, E), torch.randn(B, L, E), torch.randn(3 * E, E) * 0.3,
            torch.randn(3 * E) * 0.1, torch.randn(E, E) * 0.3, torch.randn(E) * 0.1)


def _mha_masks(dtype):
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 3:] = True
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    full = causal.view(1, 1, L, L).expand(B, H, L, L) | pad.view(B, 1, 1, L)
    masks = [(None, None), (causal, 0), (pad, 1), (full, 2)]
    if dtype is not None:  # float masks: 0 keeps, -inf drops (as nn passes them)
        masks = [(None if m is None else torch.zeros(m.shape, dtype=dtype).masked_fill(m, -math.inf), t)
                 for m, t in masks]
    return masks


def _fast_mha(q, kv, w, b, wo, bo):
    outs = []
    for dtype in (None, q.dtype):
        for mask, kind in _mha_masks(dtype):
            for average in (True, False):
                outs += torch._native_multi_head_attention(q, kv, kv, E, H, w, b, wo, bo, mask,
                                                           True, average, kind)
    return tuple(outs)


def _slow_mha(q, kv, w, b, wo, bo):
    """The same through the slow path (F.multi_head_attention_forward, sequence first)."""
    outs = []
    for dtype in (None, q.dtype):
        for mask, kind in _mha_masks(dtype):
            attn = pad = None
            if kind == 1:
                pad = mask
            elif kind == 0:
                attn = mask
            elif kind == 2:
                attn = mask.reshape(B * H, L, L)
            for average in (True, False):
                o, p = F.multi_head_attention_forward(
                    q.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1), E, H, w, b, None,
                    None, False, 0.0, wo, bo, training=False, key_padding_mask=pad,
                    need_weights=True, attn_mask=attn, average_attn_weights=average)
                outs += [o.transpose(0, 1), p]
    return tuple(outs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_native_multi_head_attention_matches_slow_path(backend, lowered):
    inputs = _mha_inputs()
    compiled = kiln.compile(_fast_mha, inputs, strict=True, backend=backend, capture_cache=False)
    assert lowered
    assert_matches(compiled(*inputs), _slow_mha, inputs)
    assert_matches(compiled(*inputs), _fast_mha, inputs)  # and against the fast path itself


def test_native_multi_head_attention_gradients_match_slow_path():
    """PyTorch does not differentiate the fast path; kiln's lowering is differentiable and
    its gradients are the slow path's."""
    def fast(q, kv, w, b, wo, bo):
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[0, 4:] = True
        return torch._native_multi_head_attention(q, kv, kv, E, H, w, b, wo, bo, mask, True, True, 1)

    def slow(q, kv, w, b, wo, bo):
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[0, 4:] = True
        o, p = F.multi_head_attention_forward(
            q.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1), E, H, w, b, None, None,
            False, 0.0, wo, bo, training=False, key_padding_mask=mask, need_weights=True)
        return o.transpose(0, 1), p

    inputs = _mha_inputs()
    compiled = torch.compile(fast, backend="kiln", options={"strict": True})
    xs = [x.clone().requires_grad_() for x in inputs]
    outs = flatten_outputs(compiled(*xs))
    weighted_loss(outs, weights_for(outs)).backward()
    got = {f"d{i}": x.grad for i, x in enumerate(xs)}

    def grads(xs):
        xs = [x.clone().requires_grad_() for x in xs]
        outs = flatten_outputs(slow(*xs))
        weighted_loss(outs, weights_for(outs)).backward()
        return {f"d{i}": x.grad for i, x in enumerate(xs)}

    results = compare_all(got, grads(inputs), grads(_double(inputs)))
    assert all(c.ok for c in results), [c for c in results if not c.ok]


def test_native_multi_head_attention_refuses_a_mask_of_the_wrong_shape():
    q, _, w, b, wo, bo = _mha_inputs()
    mask = torch.zeros(B, L + 1, dtype=torch.bool)
    with pytest.raises(kiln.UnsupportedOpError, match=r"mask_type=1 does not fit scores"):
        kiln.capture(lambda q: torch._native_multi_head_attention(
            q, q, q, E, H, w, b, wo, bo, mask, False, True, 1)[0], (q,))


# ------------------------------------------------------------------ max pooling
class SegNetBlock(torch.nn.Module):
    """Conv, max pool with indices, max unpool to the input size, conv (SegNet's decoder)."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2, return_indices=True)
        self.unpool = torch.nn.MaxUnpool2d(2)
        self.dec = torch.nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        y, where = self.pool(self.enc(x))
        return self.dec(self.unpool(y, where, output_size=x.shape[-2:])), where


def _pool_cases(x2, x3):
    """``x2``: (2, 3, 9, 11); ``x3``: (1, 2, 5, 7, 9)."""
    v2, i2 = F.max_pool2d(x2, 3, 2, 1, ceil_mode=True, return_indices=True)
    v1, i1 = F.max_pool1d(x2[:, :, 0], 3, 2, 1, return_indices=True)
    v3, i3 = F.max_pool3d(x3, (2, 3, 2), (1, 2, 2), (1, 1, 0), return_indices=True)
    p2, w2 = F.max_pool2d(x2[..., :10], 2, return_indices=True)
    p3, w3 = F.max_pool3d(x3[..., :6, :8], 2, return_indices=True)
    a2, j2 = F.adaptive_max_pool2d(x2, (4, 5), return_indices=True)  # 9 -> 4, 11 -> 5: uneven
    a1, j1 = F.adaptive_max_pool1d(x2[:, 0], 4, return_indices=True)
    a3, j3 = F.adaptive_max_pool3d(x3, (2, 3, 4), return_indices=True)
    d2, k2 = F.adaptive_max_pool2d(x2[..., :10], (3, 5), return_indices=True)  # even windows
    return (v2, i2, v1, i1, v3, i3,
            F.max_unpool2d(p2, w2, 2, output_size=(9, 10)), F.max_unpool3d(p3, w3, 2),
            a2, j2, a1, j1, a3, j3, d2, k2, F.adaptive_max_pool2d(x2[0], (2, 3)))


def _pool_inputs():
    torch.manual_seed(2)
    return torch.randn(2, 3, 9, 11), torch.randn(1, 2, 5, 7, 9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pooling_with_indices_and_unpooling_match_eager(backend):
    inputs = _pool_inputs()
    compiled = kiln.compile(_pool_cases, inputs, strict=True, backend=backend)
    for got, want in zip(compiled(*inputs), _pool_cases(*inputs)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_pooling_with_indices_gradients_match_eager():
    assert_grads_match(_pool_cases, _pool_inputs())


def test_segnet_block_under_torch_compile():
    torch.manual_seed(3)
    model = SegNetBlock()
    x = torch.randn(2, 3, 8, 10)
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        out, where = kiln.compile(model, (x,), strict=True)(x)
    torch.testing.assert_close(where, model(x)[1], rtol=0, atol=0)
    assert_matches(out, lambda x: model(x)[0], (x,), lambda x: model64(x)[0])
    compiled = torch.compile(model, backend="kiln", options={"strict": True})
    outs = {"out": compiled(x)[0]}
    weighted_loss(outs, weights_for(outs)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    def grads(m, x):
        m.zero_grad()
        o = {"out": m(x)[0]}
        weighted_loss(o, weights_for(o)).backward()
        return {n: p.grad for n, p in m.named_parameters()}

    results = compare_all(got, grads(model, x), grads(model64, x.double()))
    assert all(c.ok for c in results), [c for c in results if not c.ok]


# ------------------------------------------------------------------------ errors
class Affine:
    """A callable object that is not an nn.Module."""

    def __init__(self):
        self.scale = torch.tensor(3.0)

    def __call__(self, x):
        return x * self.scale + 1


def test_callable_object_compiles():
    x = torch.randn(5)
    torch.testing.assert_close(kiln.compile(Affine(), (x,), strict=True)(x), Affine()(x))


@pytest.mark.parametrize("fn, says", [
    (lambda x: x[x > 0], "reading x[mask] with a bool mask"),
    (lambda x: torch.nonzero(x), "nonzero has a data-dependent result shape"),
    (lambda x: torch.masked_select(x, x > 0), "masked_select"),
])
def test_data_dependent_ops_give_their_own_reason(fn, says):
    with pytest.raises(kiln.UnsupportedOpError) as info:
        kiln.compile(fn, (torch.randn(4, 3),), strict=True)
    assert says in str(info.value)
    assert "dynamic_shapes" not in str(info.value)


def test_unbacked_sizes_are_refused_and_dynamic_ones_accepted():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        unbacked = torch.empty(env.create_unbacked_symint(), 3)
    assert "data-dependent shape" in bad_value(unbacked)
    assert "dynamic_shapes" not in bad_value(unbacked)

    x = torch.randn(4, 3)
    program = torch.export.export(_Twice(), (x,), dynamic_shapes=({0: torch.export.Dim("n")},))
    mul = next(n for n in program.graph.nodes if n.op == "call_function")
    assert bad_value(mul.meta["val"]) is None  # a backed dynamic size is captured symbolically


class _Twice(torch.nn.Module):
    def forward(self, x):
        return x * 2
