"""kiln's own 2-d float32 convolution kernels, chosen per shape against oneDNN by measurement.

Three kernel kinds, all writing channels-last (NHWC) results, which the cpu partition keeps
through convolution chains (:mod:`.partition`); their C is :mod:`.conv_source`:

* **Convolution as a GEMM on kiln's micro-kernel** (``kiln_conv_gemm_f32``), for ungrouped
  1x1 convolutions and patchify convolutions (stride = kernel, no padding, as in a ViT's
  patch embedding) -- and, correct for every ungrouped convolution, general ``k x k`` ones
  too (an implicit GEMM).  ``out[(n,oh,ow), co] = sum_(c,kh,kw) x[n,c,ih,iw] w[co,c,kh,kw]``:
  the weight, ``K x Cout`` with ``K = C*KH*KW``, is the B operand in 16-column panels (packed
  once, again only when the parameter changes); the A operand is never materialized.  For a
  1x1 stride-1 convolution of a contiguous channels-last input, A *is* the input (``M x C``,
  row stride ``C``), read in place with no packing at all: with AVX-512 by
  :mod:`.conv_1x1_source`'s kernel (one block of 6-12 rows x up to 64 channels in registers
  for the whole reduction, the epilogue applied to the registers before the only store,
  each thread a range of rows with all their channels, which the next layer's thread reads;
  MobileNet's 1x1 layers 13-23% faster than through the tiles below), with AVX2 by its
  6-row x 16-channel version (the convolutions of the MobileNet-style benchmark net 1.41 ->
  1.03 ms in all on a 2-vCPU AVX2 EPYC, against storing each tile and then passing over it
  for the epilogue); in plain C by a scalar loop;
  otherwise the packing of each block of A into micro-panels -- which every GEMM of
  :mod:`.microgemm` does (``256 x 96`` blocks of 6 rows, ``256 x 144`` blocks of 12 rows
  with AVX-512) -- reads the input windows directly (per-block tables of the
  ``k -> (c, kh, kw)`` offsets; zeros where padding is read), so there is no im2col copy.  The
  register micro-kernels (6x16; 12x32 over pairs of panels with AVX-512) are
  :mod:`.microgemm`'s (its C source is included); the epilogue (below) runs on each tile
  right after its last store, while the tile is in cache.
* **Depthwise convolution** (``groups = C_in = C_out``; ``kiln_conv_dw_f32``,
  :mod:`.conv_dw_source`): a direct loop on channels-last input, 8 output pixels x 16
  channels in eight 16-wide accumulators with AVX-512 (4 x 16 in eight 8-wide ones with
  AVX2), the taps walked with the weight reordered once to ``[KH][KW][C]`` so that every
  load is contiguous along the channels; the bias is the accumulators' start value.  Each
  output row is split into the pixels whose taps all lie inside the input row, computed
  without bounds checks or masks, and its borders.  Threads split the (image, output row)
  grid.
* **Direct convolution for few input channels** (at most :data:`DIRECT_MAX_CHANNELS`, a
  ``k x k`` window: a CNN's stem; ``kiln_conv_direct_f32``): each input value is broadcast
  against 16 output channels of the weight (reordered once to ``[C][KH][KW][Cout]``, padded
  to 16), for 8 output pixels of a row at once (eight 16-wide accumulators with AVX-512).
  The implicit GEMM's K (27 for a 3x3 stem) is too short to pay for packing A: on the
  Xeon below a MobileNet stem (3 -> 16, 3x3, stride 2, 224x224) takes 64 us against
  oneDNN's 108.  With AVX-512 and at least 64 output channels, blocks of 6 pixels x 64
  channels come first (24 accumulators; each input value broadcast once against four
  weight vectors): ResNet's 7x7 stem on the 2-vCPU EPYC 1.23 ms against 1.65 with the
  16-channel loop alone and 1.65 for oneDNN, which it now replaces there.  With AVX2, 6
  pixels x 16 channels in twelve accumulators: the MobileNet stem ~210 us on the AVX2 EPYC,
  about oneDNN's time (the chooser decides), ResNet's 7x7 stem 2.5 ms against oneDNN's 1.4.

Every kernel applies ``act(acc + bias + residual)`` to each output element before storing it
(:data:`ACTIVATIONS`: none, relu, relu6, hardswish; the residual optional, NHWC like the
result), after the last block of the reduction, on values still in registers or in cache.
All three kinds have one C entry, ``kiln_conv_k(void *const *p)``: ``p[0]`` an array of
sizes and strides (:meth:`KilnConv2d.native_geometry`), then the input, the packed weight
(:meth:`KilnConv2d.pack_weight_into`), the bias, the residual and the result -- the
signature of a generated kernel, so a native run of generated code launches it from its
kernel table (:mod:`.conv_plan`), with the batch norm folded into the packed weight and the
activation and residual add in the tile store.  Called from Python (:class:`KilnConv2d`),
each kernel object checks and plans every operand signature once; a small convolution then
costs about 8 us from Python to Python, kernel included.

:func:`native_conv` is what the cpu library table asks for a 2-d float32 convolution with a
parameter weight: a :class:`~kiln.backends.common.library.LibraryCall` of kiln's kernel when
one applies and :class:`~kiln.backends.cpu.standalone.KernelChooser` measures it faster than
the oneDNN call on random inputs of the node's shapes (once per shape and machine), else
``None`` (the caller keeps oneDNN).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable

import torch

from kiln.backends.common.library import LibraryCall
from kiln.ir import Node

from . import microgemm
from .conv_source import SOURCE
from .packed_conv import version_key
from .standalone import KernelChooser, load_library, threads

_L = ctypes.c_long
_P = ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is None:
        return None
    lib.kiln_conv_k.argtypes = [_P]
    lib.kiln_conv_k.restype = None
    return lib


def conv_entry() -> int | None:
    """The address of ``kiln_conv_k`` (the one C entry of every kind, see
    :mod:`.conv_source`), for a kernel table of generated code; ``None`` without a compiler."""
    lib = _library()
    return None if lib is None else ctypes.cast(lib.kiln_conv_k, _P).value


def _failures(lib: ctypes.CDLL) -> int:
    return _L.in_dll(lib, "kiln_conv_failures").value


def kind(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
         dilation: tuple[int, ...], groups: int) -> str | None:
    """Which kiln kernel a 2-d convolution is for: ``"depthwise"``, ``"gemm"`` (1x1 or
    patchify; :func:`conv2d` runs any ungrouped convolution as an implicit GEMM, but only
    these two are offered against oneDNN), ``"direct"`` (at most :data:`DIRECT_MAX_CHANNELS`
    input channels and a larger window: a stem) or ``None``."""
    c, cout, (kh, kw) = x_shape[1], w_shape[0], w_shape[2:]
    if groups > 1:
        return "depthwise" if groups == c == cout and w_shape[1] == 1 else None
    if c <= DIRECT_MAX_CHANNELS and (kh, kw) != (1, 1) and tuple(stride) != (kh, kw):
        return "direct"
    if (kh, kw) == (1, 1) and tuple(padding) == (0, 0):
        return "gemm"
    if tuple(stride) == (kh, kw) and tuple(padding) == (0, 0) and tuple(dilation) == (1, 1):
        return "gemm"
    return None


DIRECT_MAX_CHANNELS = 4
"""Input channels up to which an ungrouped k x k convolution is offered the direct kernel."""


def _out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


ACTIVATIONS = ("none", "relu", "relu6", "hardswish")
"""What a kernel applies to each output element before storing it (after bias and residual)."""

KINDS = ("gemm", "depthwise", "direct")


class KilnConv2d:
    """A 2-d float32 convolution on kiln's kernels (``"gemm"``, ``"depthwise"`` or
    ``"direct"``) with activation ``act`` (:data:`ACTIVATIONS`) applied in the tile store,
    the weight packed once and again only when the parameter's storage or version changes.
    Returns the NCHW result stored channels-last."""

    def __init__(self, kernel_kind: str, stride: tuple[int, ...], padding: tuple[int, ...],
                 dilation: tuple[int, ...], groups: int, act: str = "none"):
        if kernel_kind not in KINDS:
            raise ValueError(f"unknown kiln convolution kind {kernel_kind!r} (gemm, depthwise, direct)")
        if act not in ACTIVATIONS:
            raise ValueError(f"unknown kiln convolution activation {act!r} ({', '.join(ACTIVATIONS)})")
        lib = _library()
        if lib is None:
            raise RuntimeError("kiln convolutions need a C compiler with OpenMP (set $CC or install gcc)")
        self.kind, self.act = kernel_kind, act
        self.stride, self.padding, self.dilation, self.groups = tuple(stride), tuple(padding), tuple(dilation), groups
        self._lib = lib
        self._packed: tuple[tuple | None, torch.Tensor, torch.Tensor] | None = None
        self._plans: dict[tuple, tuple] = {}
        """Per operand signature (shapes, strides, dtypes, threads): what :meth:`_plan` found."""
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- weights
    def packed_weight_shape(self, w_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the packed form of a weight of shape ``w_shape`` (float32)."""
        cout, cin_g, kh, kw = w_shape
        if self.kind == "gemm":  # K x Cout in 16-column panels, k = (c, kh, kw)
            return tuple(microgemm.packed_shape(cin_g * kh * kw, cout))
        if self.kind == "direct":  # [C][KH][KW][Cout padded to 16]
            return (cin_g, kh, kw, -(-cout // 16) * 16)
        return (kh, kw, cout)  # depthwise: [KH][KW][C]

    def pack_weight_into(self, w: torch.Tensor, target: torch.Tensor) -> None:
        """Write the packed form of the weight ``w`` (float32, ``[Cout, Cin/groups, KH, KW]``)
        into ``target`` (of :meth:`packed_weight_shape`)."""
        w = w.detach()
        if self.kind == "gemm":
            microgemm.pack_panels(w.reshape(w.shape[0], -1).t(), target)
        elif self.kind == "direct":
            target.zero_()
            target[..., :w.shape[0]] = w.permute(1, 2, 3, 0)
        else:
            target.copy_(w[:, 0].permute(1, 2, 0))

    def _weight(self, w: torch.Tensor) -> torch.Tensor:
        key = version_key([w])  # None for an inference tensor: never reuse its packing
        packed = self._packed
        if packed is not None and key is not None and packed[0] == key:
            return packed[1]
        with self._lock:
            weight = torch.empty(self.packed_weight_shape(tuple(w.shape)), dtype=torch.float32)
            self.pack_weight_into(w.float(), weight)
            self._packed = (key, weight, w)  # the source kept: see version_key
        return weight

    # ---------------------------------------------------------------- calls
    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """``act(conv(x, w) + b + residual)``; ``residual`` has the result's (NCHW) shape."""
        t = threads()
        signature = (x.shape, x.stride(), x.dtype, w.shape, w.dtype, None if b is None else (b.shape, b.dtype),
                     None if residual is None else (residual.shape, residual.dtype), t)
        plan = self._plans.get(signature)
        if plan is None:
            plan = self._plans[signature] = self._plan(x, w, b, residual, t)
        geometry, out_shape, relayout, cast_bias = plan
        weight = self._weight(w)
        if b is not None and cast_bias:
            b = b.detach().contiguous().to(torch.float32)
        if relayout:
            x = x.contiguous(memory_format=torch.channels_last)
        if residual is not None:  # NHWC contiguous, like the result
            residual = residual.detach().float().permute(0, 2, 3, 1).contiguous()
        out = torch.empty(out_shape, dtype=torch.float32)
        pointers = (_P * 6)(ctypes.addressof(geometry), x.data_ptr(), weight.data_ptr(),
                            0 if b is None else b.data_ptr(), 0 if residual is None else residual.data_ptr(),
                            out.data_ptr())
        failures = _failures(self._lib)
        self._lib.kiln_conv_k(pointers)
        if _failures(self._lib) != failures:
            raise MemoryError("kiln conv2d could not allocate its packing buffers")
        return out.permute(0, 3, 1, 2)

    def native_geometry(self, x_shape: tuple[int, ...], x_strides: tuple[int, ...], w_shape: tuple[int, ...],
                        has_bias: bool, has_residual: bool, threads: int) -> list[int]:
        """The size array ``g`` of ``kiln_conv_k`` (:mod:`.conv_source`) for an input of
        ``x_shape`` stored with element strides ``x_strides`` (NCHW order), a weight of
        ``w_shape`` and ``threads`` threads.  A depthwise kernel reads its input
        channels-last only: any other layout is a ``ValueError``."""
        n, c, h, wd = x_shape
        cout, cin_g, kh, kw = w_shape
        if cin_g * self.groups != c:
            raise ValueError(f"weight {tuple(w_shape)} with groups={self.groups} does not match "
                             f"{c} input channels")
        (sh, sw), (ph, pw), (dh, dw) = self.stride, self.padding, self.dilation
        oh, ow = _out_size(h, kh, sh, ph, dh), _out_size(wd, kw, sw, pw, dw)
        if oh < 1 or ow < 1:
            raise ValueError(f"convolution output {oh}x{ow} is empty for input {tuple(x_shape)}")
        sizes = [n, c, h, wd, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw]
        if self.kind == "depthwise":
            if c > 1 and x_strides[1] != 1:
                raise ValueError(f"kiln's depthwise convolution reads its input channels-last; input "
                                 f"{tuple(x_shape)} has strides {tuple(x_strides)}")
            sizes += [x_strides[0], x_strides[2], x_strides[3]]
        else:
            sizes += [*x_strides, cout]
        flags = (1 if has_bias else 0) | (2 if has_residual else 0)
        return [KINDS.index(self.kind), ACTIVATIONS.index(self.act), flags, max(1, int(threads)), *sizes]

    def _plan(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None,
              t: int) -> tuple:
        """What a call with these operand shapes, strides and dtypes passes (checked once):
        the size array of the C entry, the result shape (NHWC), whether the input must be
        made channels-last first (depthwise) and whether the bias needs a contiguous copy."""
        if x.dtype != torch.float32 or w.dtype != torch.float32 or x.dim() != 4 or w.dim() != 4:
            raise TypeError(f"kiln conv2d takes 4-d float32 input and weight, got {x.dtype} "
                            f"{tuple(x.shape)} and {w.dtype} {tuple(w.shape)}")
        cout = w.shape[0]
        if b is not None and tuple(b.shape) != (cout,):
            raise ValueError(f"bias has shape {tuple(b.shape)}, expected ({cout},)")
        relayout = self.kind == "depthwise" and x.shape[1] > 1 and x.stride(1) != 1
        strides = x.contiguous(memory_format=torch.channels_last).stride() if relayout else x.stride()
        sizes = self.native_geometry(tuple(x.shape), tuple(strides), tuple(w.shape), b is not None,
                                     residual is not None, t)
        n, oh, ow = sizes[4], sizes[8], sizes[9]
        if residual is not None and tuple(residual.shape) != (n, cout, oh, ow):
            raise ValueError(f"residual has shape {tuple(residual.shape)}, expected {(n, cout, oh, ow)}")
        cast_bias = b is not None and (b.dtype != torch.float32 or not b.is_contiguous())
        return (_L * len(sizes))(*sizes), (n, oh, ow, cout), relayout, cast_bias


def conv2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, stride=(1, 1), padding=(0, 0),
           dilation=(1, 1), groups: int = 1, direct: bool = False) -> torch.Tensor:
    """A float32 2-d convolution on kiln's kernels (depthwise when ``groups`` equals the
    channels, else the implicit GEMM, or with ``direct`` the direct kernel, both of which
    need ``groups = 1``); NCHW in and out (the result stored channels-last)."""
    if groups == 1:
        kernel_kind = "direct" if direct else "gemm"
    elif x.dim() == 4 and groups == x.shape[1] == w.shape[0] and w.shape[1] == 1:
        kernel_kind = "depthwise"
    else:
        raise ValueError(f"kiln conv2d runs groups=1 or depthwise convolutions (groups = channels, one "
                         f"filter each); got groups={groups} for input {tuple(x.shape)}, weight {tuple(w.shape)}")
    return KilnConv2d(kernel_kind, _pair(stride), _pair(padding), _pair(dilation), groups)(x, w, b)


def _channels_last_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


_CHOOSER = KernelChooser("conv2d", source=SOURCE)


def native_conv(node: Node, library: Callable[..., torch.Tensor],
                input_strides: tuple[int, ...] | None = None) -> LibraryCall | None:
    """kiln's kernel for the 2-d float32 convolution ``node`` when one applies and measures
    faster than ``library`` (the oneDNN call) on random inputs of the node's shapes; else
    ``None``.  The input is timed channels-last where ``input_strides`` (those the compiled
    graph passes) are, and for a depthwise kernel (which reads only that layout: the plan
    copies any other into it); NCHW otherwise."""
    a = node.attrs
    x_type, w_type = node.inputs[0].type, node.inputs[1].type
    shapes = [tuple(v.shape) for v in node.inputs]
    if (any(not isinstance(d, int) for s in shapes for d in s) or x_type.dtype.name != "float32"
            or w_type.dtype.name != "float32" or len(shapes[0]) != 4):
        return None
    stride, padding, dilation, groups = tuple(a["stride"]), tuple(a["padding"]), tuple(a["dilation"]), a["groups"]
    kernel_kind = kind(shapes[0], shapes[1], stride, padding, dilation, groups)
    if kernel_kind is None or _library() is None:
        return None
    conv = KilnConv2d(kernel_kind, stride, padding, dilation, groups)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode(False):  # like parameters: tensors with version counters
        x = torch.randn(shapes[0], generator=gen)
        # the layout changes both sides' costs: a 1x1 GEMM reads a channels-last input in place
        channels_last = kernel_kind == "depthwise" or (
            input_strides is not None and tuple(input_strides) == _channels_last_strides(shapes[0]))
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        args = [x] + [torch.randn(s, generator=gen) for s in shapes[1:]]
    signature = (f"{kernel_kind} {shapes} stride={stride} padding={padding} dilation={dilation} groups={groups}"
                 + (" channels-last" if channels_last else ""))
    with torch.inference_mode():
        choice = _CHOOSER.choose(signature, lambda: conv(*args), lambda: library(*args))
    if choice != "kiln":
        return None
    return LibraryCall(conv, False, f"kiln {kernel_kind} convolution", channels_last=True)


__all__ = ["ACTIVATIONS", "KINDS", "SOURCE", "KilnConv2d", "conv2d", "conv_entry", "kind", "native_conv"]
