"""Random draws from kiln's counter-based generator: ``random_uniform``, the one op every
distribution is built from.

``random_uniform(seed) {shape, offset, dtype}`` is a floating-point tensor of ``shape`` whose
element ``k`` (row-major position) is ``floor(h / 2**(31 - b)) * 2**-b`` with
``h = mix(seed, offset + k)`` (:func:`kiln.ir.ops.random.mix`, the generator of
``dropout_mask``) and ``b`` the bits of the dtype's grid: 31 for float64, 24 for float32, 11
for float16, 8 for bfloat16.  The values lie on a grid of ``2**b`` points in ``[0, 1)``;
each point is exactly representable in the dtype, so the value never rounds up to 1 and
every step (integer division, conversion, multiplication by a power of two) is exact: the
numpy reference and generated code give the same bits.

The normal, exponential, Cauchy, log-normal and geometric distributions, Bernoulli draws,
random integers, multinomial sampling, randomized leaky ReLU and channel/alpha dropout are
transformations of these uniforms by ordinary ops, emitted by the ATen rules of
:mod:`kiln.frontends.torch.aten_random`.  The op carries the ``random`` trait (CSE never merges two
of them, fusion keeps them out of kernels, constant folding and DCE leave them alone) and is
not differentiable.
"""

from __future__ import annotations

import math

import numpy as np

from ..registry import Attr, defop
from ..types import DType, TensorType
from ._infer import fmt_shape
from .compute import const, convert, defcompute, floordiv
from .random import int64_const, mix, mix_at
from .vjp import defvjp, nondifferentiable

UNIFORM_BITS = {DType.float64: 31, DType.float32: 24, DType.float16: 11, DType.bfloat16: 8}
"""Bits of the grid ``random_uniform`` draws on, per dtype (at most the generator's 31)."""


def _uniform_infer(types, *, shape, offset=0, dtype):
    (seed,) = types
    if seed.dtype != DType.int64 or seed.rank != 0:
        raise TypeError(f"the seed must be an int64 scalar (i64[]), got {seed}")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {fmt_shape(shape)} has a negative size")
    if dtype not in UNIFORM_BITS:
        raise TypeError(f"random_uniform draws floating-point values, not {dtype.name} "
                        f"(float64, float32, float16 or bfloat16)")
    if offset < 0:
        raise ValueError(f"offset {offset} must be non-negative")
    return TensorType(tuple(shape), dtype)


@defop("random_uniform", infer=_uniform_infer, num_inputs=1, traits=("random",),
       attrs={"shape": Attr("ints"), "offset": Attr("int", 0), "dtype": Attr("dtype")})
def random_uniform(seed, *, shape, offset=0, dtype):
    """Uniform values in ``[0, 1)`` on the dtype's grid, element ``k`` from ``(seed, offset + k)``."""
    bits = UNIFORM_BITS[dtype]
    counter = np.arange(math.prod(shape), dtype=np.int64) + np.int64(offset)
    values = mix(np.asarray(seed, dtype=np.int64), counter) >> np.int64(31 - bits)
    grid = values.astype(np.float64) * (2.0 ** -bits)
    return grid.astype(dtype.numpy).reshape(tuple(shape))


defvjp("random_uniform")(nondifferentiable)


@defcompute("random_uniform")
def _random_uniform_compute(ctx, seed, *, shape, offset=0, dtype):
    i64 = DType.int64
    bits = UNIFORM_BITS[dtype]
    work = DType.float64 if dtype == DType.float64 else DType.float32

    def element(i):
        h = mix_at(seed, i, shape, offset)
        if bits < 31:
            h = floordiv(h, int64_const(2 ** (31 - bits)))
        return convert(h, i64, work) * const(2.0 ** -bits, work)

    return ctx.tensor(ctx.out_shape, dtype, element)
