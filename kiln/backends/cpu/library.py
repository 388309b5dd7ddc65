"""Library implementations of the cpu backend: ATen kernels on zero-copy tensors.

:data:`LIBRARY` is keyed by op name: the ops this backend can run as a library call (an op's
declaration never names a backend).  Each entry turns a graph node into a :class:`LibraryCall`:

===============================  ==================================================  ===========
op                               call                                                writes into
===============================  ==================================================  ===========
``matmul``                       ``torch.matmul(a, b, out=o)`` (MKL GEMM; transposed   yes
                                 operands are read in place, no copy)
``conv``                         oneDNN with a prepacked weight (2-d and 3-d          no
                                 float32, :class:`~.packed_conv.PackedConv`), else
                                 ``torch.nn.functional.conv{1,2,3}d`` (bf16/f16:
                                 computed in float32 where that measures faster,
                                 :class:`WidenedConv`)
``conv_transpose``               ``torch.nn.functional.conv_transpose{1,2,3}d``       no
``scaled_dot_product_attention`` ``torch.nn.functional.scaled_dot_product_attention``  no
``embedding``                    ``torch.index_select(w, 0, idx, out=o)``              yes
``index_put``                    ``aten.index_put`` (integer indices; the gradient     no
                                 of embeddings and gathers); accumulating through
                                 one index into the first axis: ``index_add_``
``scatter_add``                  ``torch.scatter_add``                                 no
``argsort``                      ``torch.argsort(stable=True)`` for rows of at least   no
                                 :data:`LIBRARY_SORT_MIN` elements (the generated
                                 kernel ranks in ``O(n^2)`` per row)
``argtopk``                      ``torch.topk``, ties then chosen and ordered as the   no
                                 stable sort's (:func:`stable_topk`), for rows of at
                                 least :data:`LIBRARY_SORT_MIN` elements
===============================  ==================================================  ===========

"Writes into" calls fill an output buffer the memory plan owns; the others return a new
tensor.  Weights are not prepacked: parameters are read live at every call (kiln's
contract), and MKL consumes the transposed weight views that ``nn.Linear`` produces
without copying them.

Also here: :func:`reference_call`, which runs any node with its numpy reference
implementation on the host -- how this backend runs nodes nothing else can run -- and
:data:`SELECTION`, the implementation rule over this table (:mod:`kiln.backends.common.select`):
:func:`rule_choice` and :func:`generated_choice`.  :class:`LibraryCall` and the torch views
(:data:`kiln.backends.common.library.VIEWS`) are device-neutral and live in
:mod:`kiln.backends.common.library`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from kiln.backends.common.library import LibraryCall
from kiln.backends.common.select import Selection
from kiln.ir import Node
from kiln.ir.types import DType, normalize_dim
from kiln.runtime.tensors import from_numpy, to_numpy

from .attention import attention_call
from .conv import native_conv
from .conv_plan import KilnConvCall
from .packed_conv import PackedConv, packed_conv_available, version_key
from .standalone import KernelChooser, random_operands


def _matmul(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        # torch computes vector-matrix products as matrix products and would resize a
        # vector ``out`` to their rank (a deprecated resize, with a warning): give it the
        # matrix view of the same memory instead.
        if a.dim() == 1 and b.dim() >= 2:
            torch.matmul(a.unsqueeze(0), b, out=out.unsqueeze(-2))
        elif b.dim() == 1 and a.dim() >= 2:
            torch.matmul(a, b.unsqueeze(-1), out=out.unsqueeze(-1))
        else:
            torch.matmul(a, b, out=out)
    return LibraryCall(matmul, True, "torch.matmul")


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def conv_call(node: Node, persistent: Sequence[bool] = (), post: str = "none",
              strides: Sequence[tuple[int, ...] | None] | None = None) -> LibraryCall:
    """The library call of a ``conv`` node; ``post`` (one of
    :data:`~kiln.backends.cpu.packed_conv.POST_OPS`) is applied to its result inside the
    call when the call is a :class:`~kiln.backends.cpu.packed_conv.PackedConv` (the caller
    checks ``call.function``).  ``strides[0]``, where given, are the input's element strides
    in the compiled graph: kiln's kernels and oneDNN are timed on that layout."""
    a = node.attrs
    spatial = len(a["stride"])
    conv = _CONV.get(spatial)
    if conv is None:
        raise KeyError(f"no library convolution for {spatial} spatial dims")
    stride, padding, dilation, groups = tuple(a["stride"]), tuple(a["padding"]), tuple(a["dilation"]), a["groups"]
    # Only a parameter may be packed once and reused: any other weight operand (an activation
    # or a gradient, as in the weight gradient of a convolution) is a new tensor at each call,
    # possibly at the address and version counter of the last one.
    if (node.inputs[0].dtype.name == "float32" and packed_conv_available(spatial) and len(persistent) > 1
            and persistent[1] and node.inputs[0].type.is_static):
        packed = PackedConv(tuple(node.inputs[0].shape), stride, padding, dilation, groups, post)
        # kiln's own depthwise / 1x1 / patchify kernels where they measure faster (.conv)
        x_strides = strides[0] if strides else None
        native = native_conv(node, packed, x_strides) if spatial == 2 and post == "none" else None
        if native is not None:  # also a foreign kernel of native runs (.conv_plan)
            return replace(native, native=KilnConvCall(native.function, tuple(node.inputs[1].shape),
                                                       len(node.inputs) > 2))
        return LibraryCall(packed, False, "oneDNN convolution, prepacked weight" + ("" if post == "none" else f"+{post}"),
                           channels_last=True)

    def convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return conv(x, w, b, stride, padding, dilation, groups)
    library = LibraryCall(convolution, False, f"torch.nn.functional.conv{spatial}d")
    if node.inputs[0].dtype.name in _HALF and node.inputs[1].dtype == node.inputs[0].dtype:
        widened = WidenedConv(conv, (stride, padding, dilation, groups), len(persistent) > 1 and persistent[1])
        return _widened_if_faster(node, widened, library)
    return library


_HALF = ("bfloat16", "float16")
_WIDEN_CHOOSER = KernelChooser("half-conv-in-float32")


class WidenedConv:
    """A bfloat16/float16 convolution computed in float32: operands widened, oneDNN's float32
    convolution, the result rounded once to the half type (as torch's half convolution
    accumulates in float32 and rounds once).  Where the CPU has no half arithmetic, torch's
    half convolutions are emulated: ViT-Tiny's 16x16 patch embedding took 19.3 ms in bf16 on
    an AVX2 EPYC, against ~1 ms widened.  A parameter's widened weight is kept and made again
    only when the parameter's address or version counter changes."""

    def __init__(self, conv: Callable[..., torch.Tensor], attrs: tuple, persistent_weight: bool):
        self.conv, self.attrs, self.persistent_weight = conv, attrs, persistent_weight
        self._widened: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` in float32: the kept copy while ``w`` is the same version of the same parameter."""
        key = version_key([w]) if self.persistent_weight else None  # None: never reused
        kept = self._widened
        if kept is not None and key is not None and kept[0] == key:
            return kept[1]
        widened = w.float()
        if key is not None:
            self._widened = (key, widened, w)  # the source kept: see version_key
        return widened

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = self.conv(x.float(), self.weight(w), None if b is None else b.float(), *self.attrs)
        return out.to(x.dtype)


def _widened_if_faster(node: Node, widened: WidenedConv, library: LibraryCall) -> LibraryCall:
    """``widened`` as a library call where it measures faster than torch's half convolution
    (``library``) on random operands of the node's shapes (static shapes only), else ``library``."""
    shapes = [tuple(v.shape) for v in node.inputs]
    if any(not isinstance(d, int) for shape in shapes for d in shape):
        return library
    with torch.inference_mode(False):  # like parameters: a weight with a version counter
        args = random_operands(node, [None] * len(shapes))
    a = node.attrs
    signature = (f"{node.inputs[0].dtype.name} {shapes} stride={a['stride']} padding={a['padding']} dilation={a['dilation']} "
                 f"groups={a['groups']}")
    with torch.inference_mode():
        choice = _WIDEN_CHOOSER.choose(signature, lambda: widened(*args), lambda: library.function(*args))
    if choice != "kiln":
        return library
    return LibraryCall(widened, False, f"{library.label}, in float32 (half operands widened)")


_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _conv_transpose(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    a = node.attrs
    spatial = len(a["stride"])
    conv = _CONV_TRANSPOSE.get(spatial)
    if conv is None:
        raise KeyError(f"no library transposed convolution for {spatial} spatial dims")
    stride, padding, dilation, groups = tuple(a["stride"]), tuple(a["padding"]), tuple(a["dilation"]), a["groups"]
    extra = tuple(a["output_padding"]) or (0,) * spatial

    def convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return conv(x, w, b, stride, padding, extra, groups, dilation)
    return LibraryCall(convolution, False, f"torch.nn.functional.conv_transpose{spatial}d")


def _sdpa(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    is_causal, scale = node.attrs["is_causal"], node.attrs["scale"]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return LibraryCall(attention, False, "torch.nn.functional.scaled_dot_product_attention")


def _embedding(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    width = node.outputs[0].shape[-1]

    def embedding(weight: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(weight, 0, indices.reshape(-1), out=out.view(-1, width))
    return LibraryCall(embedding, True, "torch.index_select")


def _index_put(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    rank = node.inputs[0].type.rank
    starts = [normalize_dim(d, rank) for d in node.attrs["dims"]]
    accumulate = node.attrs["accumulate"]

    if accumulate and starts == [0] and rank >= 1:
        def index_add(x: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            # one index into the first axis (an embedding's gradient): index_add_ is vectorized
            # and parallel, aten's accumulating index_put is not (0.53 -> 0.23 ms for 512 rows
            # of 256 into 5000)
            flat = index.reshape(-1)
            flat = torch.where(flat < 0, flat + x.shape[0], flat)
            rows = values.to(x.dtype).expand(*index.shape, *x.shape[1:]).reshape(flat.numel(), *x.shape[1:])
            return x.clone().index_add_(0, flat, rows)
        return LibraryCall(index_add, False, "torch index_add_")

    def index_put(x: torch.Tensor, values: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:
        key: list[torch.Tensor | None] = [None] * rank
        for start, index in zip(starts, indices):
            key[start] = index
        while key and key[-1] is None:
            key.pop()
        return torch.ops.aten.index_put(x, key, values.to(x.dtype), accumulate)
    return LibraryCall(index_put, False, "torch index_put")


def _scatter_add(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    dim = node.attrs["dim"]

    def scatter_add(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return torch.scatter_add(x, dim, index, src)
    return LibraryCall(scatter_add, False, "torch.scatter_add")


LIBRARY_SORT_MIN = 32
"""The row length from which an ``argsort`` runs as a library sort (``O(n log n)``) and an
``argtopk`` as a library selection: below it the generated ranking kernel (``O(n^2)``, no
call overhead) is as fast."""


def _argsort(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    dim, descending = node.attrs["dim"], node.attrs["descending"]

    def argsort(x: torch.Tensor) -> torch.Tensor:  # NaN above every number, ties in input order: as kiln's
        return torch.argsort(x, dim=dim, descending=descending, stable=True)
    return LibraryCall(argsort, False, "torch.argsort (stable)")


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a == b`` with NaN equal to NaN (ties of the stable order)."""
    same = a == b
    return same | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else same


def _first_k_with_ties(rows: torch.Tensor, t: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
    """Positions (in input order) of the first ``k`` elements of each row of ``rows [R, n]``
    in the stable order, given each row's ``k``-th value ``t [R, 1]``: every element strictly
    beyond ``t``, then the first elements equal to ``t`` until there are ``k``."""
    n = rows.shape[-1]
    equal = _same(rows, t)
    if rows.is_floating_point():  # NaN is the largest value
        nan, t_nan = torch.isnan(rows), torch.isnan(t)
        beyond = ((rows > t) | (nan & ~t_nan)) if largest else ((rows < t) | (~nan & t_nan))
    else:
        beyond = (rows > t) if largest else (rows < t)
    needed = k - beyond.sum(-1, keepdim=True)
    chosen = beyond | (equal & (torch.cumsum(equal, -1) <= needed))
    # a distinct positive key per chosen position, decreasing along the row; 0 elsewhere
    key = torch.where(chosen, torch.arange(n, 0, -1), 0)
    return torch.topk(key, k, dim=-1).indices


def stable_topk(x: torch.Tensor, k: int, dim: int, largest: bool) -> torch.Tensor:
    """The first ``k`` positions of the stable order of ``x`` along ``dim`` (descending when
    ``largest``; ties in input order, NaN above every number): ``argsort(x, stable=True)``
    sliced to ``k``, by a partial selection.

    ``torch.topk`` picks ``k`` elements but leaves the choice among ties (and their order)
    unspecified.  It is asked for ``k + 1``: where a row's ``k``-th and ``(k+1)``-th values
    differ, every element equal to the ``k``-th value is among the ``k`` picked, so the
    picked set is the stable order's.  Only the rows where they tie are selected again, by
    :func:`_first_k_with_ties` (full-row passes).  The ``k`` positions are then ordered by a
    stable sort of their values, in input order."""
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    n = x.shape[dim]
    lead = x.movedim(dim, -1).shape[:-1]
    if k == 0 or n == 0:
        return torch.empty((*lead, k), dtype=torch.int64).movedim(-1, dim)
    rows = x.movedim(dim, -1).reshape(-1, n)
    values, picked = torch.topk(rows, min(k + 1, n), dim=-1, largest=largest, sorted=True)
    positions = picked[:, :k]
    if k < n:
        tied = torch.nonzero(_same(values[:, k - 1], values[:, k])).squeeze(1)
        if tied.numel():
            positions = positions.clone()
            positions[tied] = _first_k_with_ties(rows[tied], values[tied, k - 1:k], k, largest)
    positions = torch.sort(positions, dim=-1).values  # input order, for the stable sort
    order = torch.argsort(torch.gather(rows, -1, positions), dim=-1, descending=largest, stable=True)
    result = torch.gather(positions, -1, order).reshape(*lead, k)
    return result if dim == x.dim() - 1 else result.movedim(-1, dim).contiguous()


def _argtopk(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    k, largest = node.attrs["k"], node.attrs["largest"]
    dim = normalize_dim(node.attrs["dim"], node.inputs[0].type.rank)

    def argtopk(x: torch.Tensor) -> torch.Tensor:
        return stable_topk(x, k, dim, largest)
    return LibraryCall(argtopk, False, "torch.topk (stable ties)")


def _collective(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    from kiln.ir.ops.collectives import torch_collective  # torch.distributed on the default group
    return LibraryCall(torch_collective(node.op_name, dict(node.attrs)), False, f"torch.distributed {node.op_name}")


LIBRARY: dict[str, Callable[[Node, Sequence[bool]], LibraryCall]] = {
    "matmul": _matmul,
    "conv": conv_call,
    "conv_transpose": _conv_transpose,
    "scaled_dot_product_attention": attention_call,  # kiln's fused kernel or _sdpa, by measurement
    "embedding": _embedding,
    "index_put": _index_put,
    "scatter_add": _scatter_add,
    "argsort": _argsort,
    "argtopk": _argtopk,
    **{name: _collective for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")},
}
"""Op name -> builder of the library call for a node of that op, given which operands
are persistent (see :func:`library_call`)."""


def library_name(node: Node) -> str | None:
    """The key of ``node``'s library call in :data:`LIBRARY` (its op name), or ``None`` when
    this backend has none for the node."""
    name = node.op_name
    if name not in LIBRARY:
        return None
    if node.op_name in ("conv", "conv_transpose") and len(node.attrs["stride"]) not in _CONV:
        return None
    if node.op_name == "embedding" and node.outputs[0].type.rank < 1:
        return None
    if node.op_name == "index_put" and any(v.dtype == DType.bool for v in node.inputs[2:]):
        return None  # bool masks: the reference (kiln's mask semantics span several axes)
    if node.op_name == "scatter_add" and node.inputs[0].type.rank == 0:
        return None
    if node.op_name in ("argsort", "argtopk"):
        x = node.inputs[0].type
        if x.rank == 0 or (x.dtype == DType.bool and node.op_name == "argsort"):
            return None
        n = x.shape[normalize_dim(node.attrs["dim"], x.rank)]
        if isinstance(n, int) and n < LIBRARY_SORT_MIN:
            return None
    return name


STRIDED = frozenset({"scaled_dot_product_attention", "conv"})
"""Ops whose library-call builder also takes the operands' element strides (``strides=``):
it times its candidates on operands laid out as the compiled graph will pass them (the
attention of a transformer reads views of one projection, a convolution inside a conv chain
reads a channels-last input: their costs differ from those of contiguous tensors)."""


def library_call(node: Node, persistent: Sequence[bool] = (),
                 strides: Sequence[tuple[int, ...] | None] | None = None) -> LibraryCall:
    """The library call of ``node`` (see :func:`library_name`).  ``persistent[i]`` says that
    operand ``i`` is the same tensor at every call (a parameter of the compiled graph), so a
    call may keep a prepared copy of it between calls; other operands are new each call.
    ``strides[i]``, where known, are operand ``i``'s element strides (see :data:`STRIDED`)."""
    name = library_name(node)
    if name is None:
        raise KeyError(f"op '{node.op_name}' has no library implementation in the cpu backend")
    if name in STRIDED and strides is not None:
        return LIBRARY[name](node, persistent, strides=strides)
    return LIBRARY[name](node, persistent)


# ------------------------------------------------------------------------------ reference
def reference_call(node: Node) -> LibraryCall:
    """Run ``node`` with its op's numpy reference on zero-copy numpy views of the tensors;
    results are converted to the node's result dtypes.  Slow, but runs every op."""
    reference = node.op.reference
    if reference is None:
        raise KeyError(f"op '{node.op_name}' has no reference implementation")
    attrs = dict(node.attrs)
    dtypes = [v.dtype.numpy for v in node.outputs]
    shapes = [tuple(v.shape) for v in node.outputs]

    def run_reference(*tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        result = reference(*(to_numpy(t) for t in tensors), **attrs)
        results = result if isinstance(result, tuple) else (result,)
        out = tuple(from_numpy(np.ascontiguousarray(np.asarray(r).astype(dt, copy=False)).reshape(shape))
                    for r, dt, shape in zip(results, dtypes, shapes))
        return out[0] if len(out) == 1 else out
    return LibraryCall(run_reference, False, f"reference:{node.op_name}")


def has_library(node: Node) -> bool:
    """Whether this backend has a library call for ``node``."""
    return library_name(node) is not None


SELECTION = Selection(has_library, host_reference=True)
"""The cpu backend's implementations: its library table, generated kernels, and the numpy
reference on the host for every node with one."""
rule_choice = SELECTION.rule
generated_choice = SELECTION.generated


__all__ = ["LIBRARY", "SELECTION", "library_call", "library_name", "generated_choice", "has_library",
           "reference_call", "rule_choice", "stable_topk"]
