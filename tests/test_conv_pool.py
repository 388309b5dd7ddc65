"""Convolution (1/2/3-d, transposed, unbatched, padding modes), pooling (max/avg/adaptive in
1/2/3-d) and interpolation (every ``F.interpolate`` mode) against PyTorch eager.

Forward results go through ``kiln.compile(..., strict=True)`` on the ``reference`` and
``cpu`` backends; gradients through ``torch.compile(backend="kiln", options={"strict":
True})`` with ``loss = (out * R).sum()``.  Both are judged by :mod:`kiln.zoo.compare`:
kiln's float32 result against eager float64.  Shapes are odd and windows overlap unevenly
on purpose.  Finite-difference checks of the gradient rules live in ``test_grad_rules.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.ir import get_op
from kiln.zoo.compare import compare_all, flatten_outputs, weighted_loss, weights_for


class Fn(nn.Module):
    """A function of the input as a module (with optional submodules holding parameters)."""

    def __init__(self, fn, **mods: nn.Module):
        super().__init__()
        self.fn = fn
        self.mods = nn.ModuleDict(mods)

    def forward(self, x):
        return self.fn(x, self.mods)


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _failures(comparisons):
    return [f"{c.name}: error {c.error:.2e} (eager float32 {c.eager_error:.2e})"
            for c in comparisons if not c.ok]


def check_forward(model: nn.Module, x: torch.Tensor, backends=("reference", "cpu")):
    model = model.eval()
    with torch.no_grad():
        eager = model(x)
        ref64 = copy.deepcopy(model).double()(x.double())
    for backend in backends:
        compiled = kiln.compile(model, (x,), strict=True, backend=backend)
        with torch.no_grad():
            got = compiled(x)
        assert got.shape == eager.shape, backend
        bad = _failures(compare_all({"out": got}, {"out": eager}, {"out": ref64}))
        assert not bad, f"{backend}: {bad}"


def _grads(model, x, weights):
    x = x.clone().requires_grad_()
    out = model(x)
    outs = flatten_outputs(out)
    weighted_loss(outs, weights).backward()
    grads = {"input": x.grad, **{n: p.grad for n, p in model.named_parameters()}}
    return {**{k: v.detach() for k, v in outs.items()}, **grads}


def check_grads(model: nn.Module, x: torch.Tensor):
    torch._dynamo.reset()
    model = model.eval()
    with torch.no_grad():
        weights = weights_for(flatten_outputs(model(x)))
    eager = _grads(copy.deepcopy(model), x, weights)
    ref64 = _grads(copy.deepcopy(model).double(), x.double(),
                   {k: w.double() for k, w in weights.items()})
    compiled = torch.compile(copy.deepcopy(model), backend="kiln", options={"strict": True})
    try:
        got = _grads(compiled, x, weights)
    finally:
        torch._dynamo.reset()
    got = {k.replace("_orig_mod.", ""): v for k, v in got.items()}
    bad = _failures(compare_all(got, eager, ref64))
    assert not bad, bad


# ---------------------------------------------------------------------- convolution
CONV = {
    "conv_transpose1d": (lambda: Fn(lambda x, m: m.c(x), c=nn.ConvTranspose1d(3, 4, 3, 3, 1, 2)), (2, 3, 7)),
    "conv_transpose2d": (lambda: Fn(lambda x, m: m.c(x), c=nn.ConvTranspose2d(
        4, 6, (3, 2), (2, 1), (1, 0), (1, 0), groups=2, dilation=(1, 2))), (2, 4, 5, 6)),
    "conv_transpose3d": (lambda: Fn(lambda x, m: m.c(x), c=nn.ConvTranspose3d(
        2, 3, 3, 2, 1, (1, 0, 1), bias=False)), (1, 2, 3, 4, 5)),
    "conv_transpose2d_unbatched": (lambda: Fn(lambda x, m: m.c(x), c=nn.ConvTranspose2d(3, 2, 3, 2)), (3, 5, 4)),
    "conv3d": (lambda: Fn(lambda x, m: m.c(x), c=nn.Conv3d(
        4, 6, (3, 2, 3), (2, 1, 1), 1, dilation=(1, 2, 1), groups=2)), (2, 4, 5, 7, 6)),
    "conv1d_unbatched": (lambda: Fn(lambda x, m: m.c(x), c=nn.Conv1d(3, 5, 3, padding=2)), (3, 9)),
    "conv2d_unbatched": (lambda: Fn(lambda x, m: m.c(x), c=nn.Conv2d(3, 4, 3, 2)), (3, 7, 6)),
    "conv2d_same_even_kernel": (lambda: Fn(lambda x, m: m.c(x), c=nn.Conv2d(
        2, 3, (4, 3), padding="same", dilation=(1, 2))), (1, 2, 7, 6)),
    "conv3d_valid": (lambda: Fn(lambda x, m: m.c(x), c=nn.Conv3d(2, 2, 2, padding="valid")), (1, 2, 3, 4, 5)),
}


@pytest.mark.parametrize("name", list(CONV))
def test_convolution_forward(name, one_torch_thread):
    make, shape = CONV[name]
    torch.manual_seed(0)
    check_forward(make(), _inputs(shape))


@pytest.mark.parametrize("name", ["conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                                  "conv3d", "conv2d_same_even_kernel"])
def test_convolution_gradients(name, one_torch_thread):
    make, shape = CONV[name]
    torch.manual_seed(0)
    check_grads(make(), _inputs(shape))


def test_transposed_and_3d_convolutions_run_as_library_calls(one_torch_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose3d(2, 3, 3, 2), nn.ReLU(), nn.Conv3d(3, 2, 3),
                          Fn(lambda x, m: m.c(x.flatten(2)), c=nn.ConvTranspose1d(2, 2, 3, 2, 1, 1, groups=2)))
    x = torch.randn(1, 2, 3, 4, 5)
    compiled = kiln.compile(model.eval(), (x,), strict=True, backend="cpu")
    info = compiled.executable.info
    assert info["library_calls"] == 3 and not info["fallbacks"], info["choices"]
    assert set(info["choices"].values()) <= {"library", "library+epilogue", "view"}, info["choices"]
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_library_transposed_convolution_matches_the_reference():
    from kiln.backends.cpu.library import library_call
    from kiln.ir import DType, Graph, TensorType

    g = Graph("deconv")
    x = g.add_input("x", TensorType((2, 4, 3, 5), DType.float32))
    w = g.add_input("w", TensorType((4, 3, 3, 2), DType.float32))
    attrs = {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2), "groups": 2, "output_padding": (1, 0)}
    node = g.op("conv_transpose", x, w, **attrs).producer
    call = library_call(node)
    assert "conv_transpose2d" in call.label
    xs, ws = _inputs((2, 4, 3, 5)), _inputs((4, 3, 3, 2), seed=1)
    want = get_op("conv_transpose").reference(xs.numpy(), ws.numpy(), **attrs)
    torch.testing.assert_close(call.function(xs, ws), torch.from_numpy(want), rtol=1e-5, atol=1e-5)


def test_generated_code_runs_transposed_convolution_too(one_torch_thread):
    torch.manual_seed(0)
    model = Fn(lambda x, m: m.c(x), c=nn.ConvTranspose2d(4, 6, 3, 2, 1, 1, groups=2))
    x = torch.randn(1, 4, 5, 4)
    compiled = kiln.compile(model.eval(), (x,), strict=True, backend="cpu", select="generated")
    assert compiled.executable.info["library_calls"] == 0
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- pooling
POOL = {
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, 2, 1, ceil_mode=True), (2, 3, 10)),
    "max_pool1d_dilated_unbatched": (lambda x: F.max_pool1d(x, 2, 1, 0, 2), (3, 9)),
    "max_pool3d": (lambda x: F.max_pool3d(x, (2, 3, 2), (1, 2, 2), (1, 1, 0), (1, 1, 2), ceil_mode=True),
                   (2, 3, 5, 7, 8)),
    "max_pool3d_unbatched": (lambda x: F.max_pool3d(x, 2), (2, 5, 4, 6)),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 10)),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), (1, 2, 6, 7, 5)),
    "avg_pool3d_divisor": (lambda x: F.avg_pool3d(x, (2, 3, 2), (2, 1, 2), divisor_override=5), (1, 2, 5, 5, 6)),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 4), (2, 3, 11)),
    "adaptive_avg_pool3d": (lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)), (1, 2, 5, 7, 9)),
    "adaptive_avg_pool3d_unbatched": (lambda x: F.adaptive_avg_pool3d(x, 1), (2, 3, 4, 5)),
    "adaptive_max_pool1d": (lambda x: F.adaptive_max_pool1d(x, 4), (2, 3, 12)),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, (3, 1)), (2, 3, 9, 7)),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, (1, 2, 3)), (1, 2, 5, 4, 9)),
}


@pytest.mark.parametrize("name", list(POOL))
def test_pooling_forward(name, one_torch_thread):
    fn, shape = POOL[name]
    check_forward(Fn(lambda x, m: fn(x)), _inputs(shape))


CHANNELS_LAST_POOLS = {
    "max": lambda y: F.max_pool2d(y, 3, 2, 1),
    "max_ceil": lambda y: F.max_pool2d(y, 2, 2, ceil_mode=True),
    "avg": lambda y: F.avg_pool2d(y, 3, 2, 1, count_include_pad=False),
}


@pytest.mark.parametrize("channels", [1, 3, 17, 64])
@pytest.mark.parametrize("pool", list(CHANNELS_LAST_POOLS))
def test_pooling_between_channels_last_convolutions_runs_along_the_channels(pool, channels, one_torch_thread):
    """conv -> pool -> conv on the cpu backend: the pooling reads and writes channels-last
    (the convolutions' layout).  Its kernel writes the result in place with permuted axes and
    its default schedule moves the channel loop innermost, below the window loops
    (interchange, fission, interchange, vectorize); results match eager at odd sizes."""
    fn = CHANNELS_LAST_POOLS[pool]
    model = Fn(lambda x, m: m.b(fn(m.a(x))), a=nn.Conv2d(3, channels, 3, padding=1), b=nn.Conv2d(channels, 5, 1))
    x = _inputs((2, 3, 9, 11))
    check_forward(model, x, backends=("cpu",))
    compiled = kiln.compile(model.eval(), (x,), backend="cpu", strict=True)
    pools = [trace for label, trace in compiled.executable.info["schedules"].items() if "pool" in label]
    assert len(pools) == 1, compiled.executable.info["schedules"]
    moved = [step["primitive"] for step in pools[0]][:4] == ["interchange", "interchange", "fission", "interchange"]
    assert moved == (channels > 1)  # one channel: no channel loop to move


@pytest.mark.parametrize("name", ["max_pool1d", "max_pool3d", "avg_pool3d_divisor", "adaptive_max_pool3d"])
def test_pooling_gradients(name, one_torch_thread):
    fn, shape = POOL[name]
    check_grads(Fn(lambda x, m: fn(x)), _inputs(shape))


def test_max_pool3d_gradient_goes_to_the_first_maximum_as_in_torch():
    x = torch.zeros(1, 1, 3, 3, 3)  # every window is a tie
    x[0, 0, 2, 2, 2] = 1.0
    model = Fn(lambda x, m: F.max_pool3d(x, 2, 1))
    compiled = torch.compile(model, backend="kiln", options={"strict": True})
    try:
        got = x.clone().requires_grad_()
        compiled(got).sum().backward()
    finally:
        torch._dynamo.reset()
    want = x.clone().requires_grad_()
    model(want).sum().backward()
    torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_uneven_adaptive_max_pooling_matches_eager():
    # Windows of torch's formula (start = floor(i * in / out), end = ceil((i + 1) * in / out))
    # overlap and differ in size when the output does not divide the input.
    x = torch.randn(1, 2, 7, 9)
    fn = Fn(lambda x, m: F.adaptive_max_pool2d(x, (3, 4)))
    for backend in ("reference", "cpu"):
        compiled = kiln.compile(fn, (x,), backend=backend, strict=True)
        torch.testing.assert_close(compiled(x), F.adaptive_max_pool2d(x, (3, 4)), rtol=0, atol=0)


# -------------------------------------------------------------------- interpolation
INTERP = {
    "nearest1d_scale": (lambda x: F.interpolate(x, scale_factor=1.7), (2, 3, 5)),
    "nearest2d_size": (lambda x: F.interpolate(x, size=(7, 3)), (1, 2, 5, 4)),
    "nearest3d_scale": (lambda x: F.interpolate(x, scale_factor=(2, 1.5, 0.6)), (1, 2, 3, 4, 10)),
    "nearest_exact1d": (lambda x: F.interpolate(x, size=7, mode="nearest-exact"), (2, 3, 5)),
    "nearest_exact2d_scale": (lambda x: F.interpolate(x, scale_factor=1.3, mode="nearest-exact"), (1, 2, 5, 4)),
    "nearest_exact3d": (lambda x: F.interpolate(x, size=(5, 3, 7), mode="nearest-exact"), (1, 2, 3, 4, 5)),
    "linear": (lambda x: F.interpolate(x, size=9, mode="linear"), (2, 3, 5)),
    "linear_corners_scale": (lambda x: F.interpolate(x, scale_factor=2.5, mode="linear", align_corners=True),
                             (2, 3, 5)),
    "bilinear_scale": (lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear"), (1, 2, 5, 4)),
    "bilinear_corners_down": (lambda x: F.interpolate(x, size=(3, 6), mode="bilinear", align_corners=True),
                              (1, 2, 7, 4)),
    "bicubic": (lambda x: F.interpolate(x, size=(9, 5), mode="bicubic"), (1, 2, 5, 4)),
    "bicubic_corners": (lambda x: F.interpolate(x, size=(3, 8), mode="bicubic", align_corners=True), (1, 2, 7, 4)),
    "bicubic_scale_unbatched": (lambda x: F.interpolate(x[None], scale_factor=1.6, mode="bicubic")[0],
                                (2, 5, 4)),
    "trilinear": (lambda x: F.interpolate(x, size=(5, 3, 7), mode="trilinear"), (1, 2, 3, 4, 5)),
    "trilinear_corners_scale": (lambda x: F.interpolate(x, scale_factor=(1.5, 2, 0.7), mode="trilinear",
                                                        align_corners=True), (1, 2, 3, 4, 10)),
    "area1d": (lambda x: F.interpolate(x, size=4, mode="area"), (2, 3, 11)),
    "area2d": (lambda x: F.interpolate(x, size=(3, 5), mode="area"), (1, 2, 7, 9)),
    "area3d": (lambda x: F.interpolate(x, size=(2, 3, 4), mode="area"), (1, 2, 5, 7, 9)),
    "upsample": (lambda x: F.upsample(x, scale_factor=2, mode="bilinear"), (1, 2, 3, 4)),
}


@pytest.mark.parametrize("name", list(INTERP))
def test_interpolation_forward(name, one_torch_thread):
    fn, shape = INTERP[name]
    check_forward(Fn(lambda x, m: fn(x)), _inputs(shape))


@pytest.mark.parametrize("name", ["nearest1d_scale", "nearest_exact3d", "linear_corners_scale",
                                  "bicubic", "trilinear", "area3d"])
def test_interpolation_gradients(name, one_torch_thread):
    fn, shape = INTERP[name]
    check_grads(Fn(lambda x, m: fn(x)), _inputs(shape))


def test_nearest_on_integers_matches_torch_exactly():
    x = torch.randint(0, 100, (1, 2, 3, 4, 5), dtype=torch.uint8)
    model = Fn(lambda x, m: F.interpolate(x, scale_factor=(1.5, 2, 0.6)))
    for backend in ("reference", "cpu"):
        got = kiln.compile(model, (x,), strict=True, backend=backend)(x)
        assert torch.equal(got, model(x)), backend


def test_resampling_inference_rejects_bad_attributes():
    from kiln.ir import Graph, KilnError, TensorType
    from kiln.ir.types import DType

    g = Graph("bad")
    x = g.add_input("x", TensorType((1, 2, 3, 4), DType.float32))
    with pytest.raises(KilnError, match=r"upsample_trilinear3d.*input must be 4-d \(C, D, H, W\) or 5-d"):
        g.op("upsample_trilinear3d", g.add_input("y", TensorType((2, 3, 4), DType.float32)),
             output_size=(2, 3, 4))
    with pytest.raises(KilnError, match=r"scales \[2.0\] must be empty or have 2 entries"):
        g.op("upsample_bicubic2d", x, output_size=(6, 8), scales=(2.0,))
    with pytest.raises(KilnError, match=r"kernel \[2, 2\] must have 3 entries \(depth, height, width\)"):
        g.op("max_pool3d", x, kernel=(2, 2), stride=())
    assert get_op("max_pool3d").attrs["padding"].default == (0, 0, 0)


# -------------------------------------------------------------------------- models
class UNet(nn.Module):
    """Two levels: conv blocks with eval-mode BatchNorm, max pooling down, a transposed
    convolution up, a skip connection concatenated, a bilinear resize at the head."""

    def __init__(self):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())

        self.down1, self.down2 = block(3, 4), block(4, 8)
        self.up = nn.ConvTranspose2d(8, 4, 2, 2)
        self.dec = block(8, 4)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(F.max_pool2d(a, 2))
        u = self.dec(torch.cat([self.up(b), a], 1))
        return F.interpolate(self.head(u), size=(13, 11), mode="bilinear")


class CNN3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 6, (2, 3, 3), stride=(1, 2, 1))
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = F.max_pool3d(torch.relu(self.c1(x)), 2, ceil_mode=True)
        x = F.avg_pool3d(torch.relu(self.c2(x)), (1, 2, 2), ceil_mode=True)
        return self.fc(F.adaptive_avg_pool3d(x, 1).flatten(1))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4 * 3 * 2)
        self.up1 = nn.ConvTranspose2d(4, 3, 3, 2, 1, output_padding=1)
        self.up2 = nn.ConvTranspose2d(3, 2, 4, 2, 1, groups=1)

    def forward(self, z):
        x = self.fc(z).reshape(-1, 4, 3, 2)
        x = torch.relu(self.up1(x))
        x = F.interpolate(x, scale_factor=1.5, mode="nearest")
        x = torch.tanh(self.up2(x))
        return F.interpolate(x, size=(17, 9), mode="bicubic", align_corners=True)


MODELS = {"unet": (UNet, (1, 3, 8, 12)), "cnn3d": (CNN3d, (2, 2, 7, 9, 8)), "decoder": (Decoder, (2, 5))}


def _model(name):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model = make()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model, _inputs(shape)


@pytest.mark.parametrize("name", list(MODELS))
def test_models_forward(name, one_torch_thread):
    model, x = _model(name)
    check_forward(model, x)


@pytest.mark.parametrize("name", list(MODELS))
def test_models_gradients(name, one_torch_thread):
    model, x = _model(name)
    check_grads(model, x)


@pytest.mark.parametrize("fn, shape, kw", [
    (torch.nn.functional.max_pool2d, (2, 3, 8, 9), dict(kernel_size=2)),
    (torch.nn.functional.max_pool2d, (1, 2, 7, 7), dict(kernel_size=3, ceil_mode=True)),
    (torch.nn.functional.max_pool3d, (2, 2, 6, 5, 7), dict(kernel_size=2)),
    (torch.nn.functional.max_pool2d, (1, 1, 6, 6), dict(kernel_size=(1, 2), stride=(1, 2))),
])
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool_gradient_of_tiling_windows_on_the_cpu_backend(fn, shape, kw, ties):
    """stride = kernel, no padding: the backward is one select per input element (each
    position belongs to one window); ties go to the window's first maximum, as in torch."""
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen)
    x = (x.round() if ties else x).requires_grad_(True)

    class Pool(torch.nn.Module):
        def forward(self, x):
            return fn(x, **kw)

    compiled = kiln.compile(Pool(), (x,), backend="cpu", strict=True)
    weight = torch.randn(Pool()(x).shape, generator=gen)
    got, = torch.autograd.grad((compiled(x) * weight).sum(), x)
    want, = torch.autograd.grad((Pool()(x) * weight).sum(), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
