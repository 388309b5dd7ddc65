"""Fused attention on the CPU: a tiled, online-softmax (flash-style) C kernel with OpenMP.

``out = softmax(q @ k^T * scale + mask) @ v`` without ever holding the ``L x S`` score
matrix: each task takes one (batch, head, tile of :data:`QUERY_TILE` query rows) and walks
the keys in blocks of :data:`KEY_BLOCK`, updating the running maximum, the running sum and
the output accumulator of every query row (the accumulator is rescaled only when the
maximum grows).  Two kernels behind one entry (:mod:`.attention_source` holds their C):

* **AVX-512** (``ka_attention_512``): keys and values are packed -- K transposed and scaled
  by ``scale * log2(e)`` in blocks of 64 keys, V's rows contiguous (a view's own strides can
  map a block's rows onto a few cache sets) -- into buffers kept between calls: with at
  least two heads per thread, each task is a head whose keys and values its thread packs
  into its own buffer (they stay in its cache; in GPT-2, in order, 0.54 against SDPA's
  0.63 ms per call under AMP); with fewer heads (ViT's 3), every head is packed once into a
  buffer the threads share and a task is one (head, query tile).  A panel of 6 query rows and a
  block of keys is a 6 x 64 register tile of scores (Q broadcast in place from its strided
  rows; only the vectors of keys the block has), stored once; each row is then masked,
  its maximum taken and ``2^(s - m)`` computed with ``vscalefps`` (the scores are in base-2
  units, so this is the softmax's ``exp``); the P @ V product broadcasts P from memory into
  a 6 x 64 output tile that is loaded, rescaled and stored once per block.  Tasks are
  (batch, head, query tile), a head's tiles taken by the threads together, the last first.
  It also takes **bfloat16** q, k, v (:data:`DTYPES`: converted to float32 as they are
  packed, a query tile at a time, the result rounded to bfloat16 once), so attention under
  ``amp="bf16"`` runs on it: GPT-2's masked 12 x 128 x 64 heads 0.43 against SDPA's 0.67 ms.
  Against torch's SDPA (2 threads, AMD EPYC, interleaved): GPT-2's causal 12 x 1024 x 64
  heads 1.6x faster; at the shapes of the suite's transformers (128-196 tokens) 0.8-1.4x,
  by shape and minute, and the whole models within 3% of their time with SDPA.
* **Portable** (AVX2, or scalar): per block the keys are copied transposed into a
  per-thread scratch (``E x 64``, so the score row of a query is a sum of scaled rows of
  it), 6 x 16 tiles of 8-wide vectors.

* **Causal** attention (``is_causal``: key ``j`` is seen by query ``i`` when ``j <= i``, the
  top-left aligned triangle, as in the op's reference) stops each tile at its last row's key.
* **Masks**: a bool mask keeps keys where true; a floating mask is added to the scores;
  either broadcasts to ``[*batch, L, S]`` (read through strides, never expanded).
* **GQA**: when the key/value heads ``Hk`` divide the query heads ``H``, query head ``h``
  reads key head ``h // (H / Hk)`` (:func:`attention`); the graph op's broadcast heads
  (``Hk = 1``) are the special case of one group.
* **A row with every key masked out gives zeros** (not NaN), as the op's reference says.
* ``exp`` is a Cody-Waite range reduction with a degree-6 polynomial (cephes' ``expf``,
  relative error ~2e-7) in the portable kernel; ``2^x`` a degree-6 polynomial of the
  fraction times ``vscalefps`` in the AVX-512 one.

:func:`attention_call` is the cpu backend's library call for ``scaled_dot_product_attention``:
per shape and layout signature, :class:`kiln.backends.cpu.standalone.KernelChooser` times
this kernel against ``torch.nn.functional.scaled_dot_product_attention`` once and keeps the
faster.  Both are timed on operands with the strides the compiled graph passes (the cpu
partition knows them from its plan; a transformer's q, k and v are views of one projection),
not on contiguous copies.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kiln.backends.common.library import LibraryCall
from kiln.ir import Node
from kiln.runtime.tensors import torch_dtype

from .attention_source import KEY_BLOCK, QUERY_TILE, SOURCE
from .standalone import KernelChooser, load_library, pointer, random_operands, threads




_ARGTYPES = ([ctypes.c_long] * 7 + [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p] + [ctypes.c_long] * 3
             + [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_long] * 4
             + [ctypes.c_int, ctypes.c_float, ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_int])


@functools.lru_cache(maxsize=None)
def kernel(dtype: torch.dtype = torch.float32) -> ctypes._CFuncPtr | None:
    """The loaded kernel for ``dtype`` (``kiln_attention_f32``, or ``kiln_attention_bf16``
    on CPUs with AVX-512), or ``None`` without a working C compiler or such a kernel."""
    lib = load_library(SOURCE)
    if lib is None or dtype not in DTYPES:
        return None
    if dtype == torch.bfloat16:
        lib.kiln_attention_has_bf16.restype = ctypes.c_int
        if not lib.kiln_attention_has_bf16():
            return None
    fn = getattr(lib, DTYPES[dtype])
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn


DTYPES = {torch.float32: "kiln_attention_f32", torch.bfloat16: "kiln_attention_bf16"}
"""The element types kiln's kernel takes (q, k, v and the result alike), and their entries.
bfloat16 is converted to float32 as the keys, values and each query tile are packed, and
the result rounded to bfloat16 as it is stored; only the AVX-512 kernel has it."""


def _as4(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """``t`` ([*b, R, C], batch broadcast to ``batch``) as a 4-d ``[B, H, R, C]`` view."""
    t = t.expand(*batch, *t.shape[-2:]) if tuple(t.shape[:-2]) != batch else t
    if len(batch) == 0:
        return t[None, None]
    if len(batch) == 1:
        return t[None]
    if len(batch) == 2:
        return t
    return t.reshape(-1, *t.shape[-3:])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
              is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Fused float32 (or bfloat16, see :data:`DTYPES`) attention with kiln's kernel (see the
    module docstring).

    ``q [*batch, L, E]``, ``k [*batch_k, S, E]``, ``v [*batch_k, S, Ev]``; the batch axes
    broadcast, or (GQA) the key/value heads (axis -3) divide the query heads.  ``mask``
    (bool: keep where true; float: added) broadcasts to ``[*batch, L, S]``."""
    dtype = q.dtype if isinstance(q, torch.Tensor) else None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or dtype not in DTYPES:
            raise TypeError(f"kiln attention takes float32 (or bfloat16) q, k and v of one dtype; {name} is "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be at least 2-d ([..., length, embedding]), got {tuple(t.shape)}")
    L, E = q.shape[-2:]
    S, Ek = k.shape[-2:]
    if Ek != E:
        raise ValueError(f"q has embedding size {E} but k has {Ek}")
    if v.shape[-2] != S:
        raise ValueError(f"k has {S} keys but v has {v.shape[-2]} values")
    if is_causal and mask is not None:
        raise ValueError("give either a mask or is_causal=True, not both")
    group = 1
    qbatch, kbatch, vbatch = tuple(q.shape[:-2]), tuple(k.shape[:-2]), tuple(v.shape[:-2])
    if vbatch != kbatch:  # k and v broadcast against each other first (a shared value head)
        try:
            kbatch = tuple(torch.broadcast_shapes(kbatch, vbatch))
        except RuntimeError:
            raise ValueError(f"batch axes of k {kbatch} and v {vbatch} do not broadcast") from None
        k, v = k.expand(*kbatch, *k.shape[-2:]), v.expand(*kbatch, *v.shape[-2:])
    if (len(qbatch) >= 1 and len(kbatch) == len(qbatch) and kbatch[-1] not in (1, qbatch[-1])
            and qbatch[-1] % kbatch[-1] == 0 and qbatch[:-1] == kbatch[:-1]):
        group = qbatch[-1] // kbatch[-1]  # grouped-query attention
        batch = qbatch
        kbatch_b = kbatch
    else:
        try:
            batch = tuple(torch.broadcast_shapes(qbatch, kbatch))
        except RuntimeError:
            raise ValueError(f"batch axes of q {qbatch} and k {kbatch} neither broadcast nor group") from None
        kbatch_b = batch
    Ev = v.shape[-1]
    q4 = _as4(q, batch)
    k4, v4 = _as4(k, kbatch_b), _as4(v, kbatch_b)
    q4, k4, v4 = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (q4, k4, v4))
    B, H = q4.shape[:2]
    out = torch.empty((B, H, L, Ev), dtype=q.dtype)
    mkind, mt = 0, None
    if mask is not None:
        if mask.dtype == torch.bool:
            mkind, mt = 1, mask
        elif mask.dtype.is_floating_point:
            mkind, mt = 2, mask.to(torch.float32)
        else:
            raise TypeError(f"mask must be bool (keep where true) or floating (added), got {mask.dtype}")
        try:
            mt = _as4(mt.expand(*batch, L, S), batch)
        except RuntimeError:
            raise ValueError(f"mask {tuple(mask.shape)} does not broadcast to the scores {(*batch, L, S)}") from None
    fn = kernel(dtype)
    if fn is None:
        raise RuntimeError("kiln attention needs a C compiler with OpenMP (set $CC or install gcc)"
                           + (", and for bfloat16 a CPU with AVX-512" if dtype == torch.bfloat16 else ""))
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    ms = mt.stride() if mt is not None else (0, 0, 0, 0)
    failed = fn(B, H, L, S, E, Ev, group, pointer(q4), *q4.stride()[:3], pointer(k4), *k4.stride()[:3],
                pointer(v4), *v4.stride()[:3], pointer(mt), mkind, *ms, int(bool(is_causal)), scale,
                pointer(out), *out.stride()[:3], threads())
    if failed:
        raise MemoryError("kiln attention could not allocate its per-thread scratch")
    return out.reshape(*batch, L, Ev)


_CHOOSER = KernelChooser("attention", source=SOURCE)


def attention_call(node: Node, persistent: Sequence[bool] = (),
                   strides: Sequence[tuple[int, ...] | None] | None = None) -> LibraryCall:
    """The library call of a ``scaled_dot_product_attention`` node: kiln's kernel where it
    applies (float32 or bfloat16, see :data:`DTYPES`; static shapes) and measures faster than
    torch's, else torch's SDPA.
    Both are timed on operands with ``strides`` where given (those the compiled graph
    passes), else contiguous ones."""
    is_causal, scale = node.attrs["is_causal"], node.attrs["scale"]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return attention(q, k, v, mask, is_causal=is_causal, scale=scale)

    torch_call = LibraryCall(sdpa, False, "torch.nn.functional.scaled_dot_product_attention")
    dtype = torch_dtype(node.inputs[0].dtype)
    if (any(v.dtype != node.inputs[0].dtype for v in node.inputs[1:3]) or kernel(dtype) is None
            or any(not isinstance(d, int) for v in node.inputs for d in v.shape)):
        return torch_call
    strides = list(strides) if strides is not None else [None] * len(node.inputs)
    signature = (f"{[tuple(v.shape) for v in node.inputs]} {[v.dtype.name for v in node.inputs]} causal={is_causal}"
                 + (f" strides={strides}" if any(s is not None for s in strides) else ""))
    args = random_operands(node, strides)
    with torch.inference_mode():
        choice = _CHOOSER.choose(signature, lambda: fused(*args), lambda: sdpa(*args))
    if choice == "kiln":
        return LibraryCall(fused, False, "kiln fused attention (flash-style, OpenMP)")
    return torch_call


__all__ = ["DTYPES", "KEY_BLOCK", "QUERY_TILE", "SOURCE", "attention", "attention_call", "kernel"]
