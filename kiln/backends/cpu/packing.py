"""Weight packing of the cpu GEMMs: the layouts a :class:`kiln.runtime.call_plan.PackStep`
writes for this backend.

A ``pack`` operation of the partition (:mod:`.partition`) keeps a prepared copy of a
weight that a GEMM kernel reads as its B operand; :func:`pack_step` binds it:

* for kiln's own GEMM (:mod:`.microgemm`) the copy is ``K x N`` in 16-column panels,
  ``(ceil(N/16), K, 16)`` zero-padded (:func:`write_panels`); for its bf16 GEMM in pair
  panels, ``(ceil(N/16), ceil(K/2), 32)`` (:func:`write_pairs`);
* for the BLAS providers it is a contiguous copy of the transposed weight, which they read
  untransposed (:func:`copy_into`);
* a ``pack`` with a call (kiln's convolutions run as foreign kernels, :mod:`.conv_plan`)
  writes its outputs from all its inputs -- the weight packed with a batch norm folded into
  it, and the bias -- as a :class:`kiln.runtime.call_plan.PrepareStep`.
"""

from __future__ import annotations

import torch

from kiln.backends.common.partition import PlanOp
from kiln.ir.types import DType
from kiln.runtime.call_plan import PackStep, PrepareStep


def write_panels(b: torch.Tensor, out: torch.Tensor) -> None:
    """``b`` (``K x N``) into ``out`` (``(P, K, W)``) as ``W``-column panels, zero-padded."""
    k, n = b.shape
    width = out.shape[2]
    full = n // width
    if full:
        out[:full].copy_(b[:, : full * width].reshape(k, full, width).permute(1, 0, 2))
    rest = n - full * width
    if rest:
        out[full, :, :rest].copy_(b[:, full * width:])
        out[full, :, rest:].zero_()


PAIR_WIDTH = 32
"""The last size of a bf16 pair panel (:mod:`.microgemm`): 16 columns of two ``k`` each."""


def write_pairs(b: torch.Tensor, out: torch.Tensor) -> None:
    """``b`` (``K x N``, any floating dtype) into ``out`` (``(P, ceil(K/2), 32)``, bf16) as
    pair panels, ``out[p, k // 2, 2 * j + k % 2] = b[k, 16 * p + j]``, zero past K and N."""
    k, n = b.shape
    panels, pairs, width = out.shape
    cols = width // 2
    padded = torch.zeros(pairs * 2, panels * cols, dtype=out.dtype)
    padded[:k, :n] = b
    out.view(panels, pairs, cols, 2).copy_(padded.view(pairs, 2, panels, cols).permute(2, 0, 3, 1))


def copy_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)``: a plain copy."""
    dst.copy_(src)


def pack_step(op: PlanOp) -> PackStep | PrepareStep:
    """The runtime step of the ``pack`` operation ``op``: its call's writes when it has one
    (see the module docstring), panels when its output's shape is the panel shape, else a
    plain copy of the weight view it reads."""
    if op.call is not None:
        sources = tuple(pv.slot for pv in op.inputs)
        return PrepareStep(((sources, tuple(pv.slot for pv in op.outputs), op.call.function, op.label),))
    source, target = op.inputs[0], op.outputs[0]
    view = (tuple(source.meta.shape), tuple(source.meta.stride()), source.meta.storage_offset())
    if target.type.shape == source.type.shape:
        write = copy_into
    elif target.type.shape[-1] == PAIR_WIDTH and target.type.dtype == DType.bfloat16:
        write = write_pairs
    else:
        write = write_panels
    return PackStep(source.root().slot, view, target.slot, write, op.label)


__all__ = ["PAIR_WIDTH", "copy_into", "pack_step", "write_pairs", "write_panels"]
