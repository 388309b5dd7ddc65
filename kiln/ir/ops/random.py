"""Random ops: a counter-based generator that the numpy reference and generated code share.

``dropout_mask(seed) {shape, p, offset}`` is a bool tensor of ``shape`` whose elements are
``True`` (keep) with probability ``1 - p``.  Element ``k`` (row-major position) is a pure
function of ``(seed, offset + k)``: a few rounds of multiply/square/add modulo the Mersenne
prime ``2**31 - 1`` (:func:`mix`), compared with the integer threshold ``round(p * P)``.
Every intermediate is a non-negative int64 below ``2**62``, so the same arithmetic in numpy
and in C (``%`` of non-negative operands) gives the same bits: the reference and the ``cpu``
backend draw identical masks, and a clone of the node (rematerialization) draws the mask of
the original.  Different ``offset`` attributes give independent streams within one graph;
a new ``seed`` value gives a new mask.

The seed is an ``int64[]`` operand.  Captured programs read it from a graph param named
:data:`RNG_SEED_PARAM`, which the runtime refills from torch's default generator before
every call (so ``torch.manual_seed`` makes runs reproducible and every call draws a new
mask).  The op carries the ``random`` trait: CSE never merges two of them, fusion keeps
them out of kernels, constant folding leaves them alone.
"""

from __future__ import annotations

import math

import numpy as np

from ..registry import Attr, defop
from ..types import DType, TensorType
from ._infer import fmt_shape
from .compute import cmp, const, convert, defcompute, linear_index, size_value
from .vjp import defvjp, nondifferentiable

PRIME = 2**31 - 1
"""The modulus of the generator (a Mersenne prime)."""

RNG_SEED_PARAM = "rng.seed"
"""Name of the ``int64[]`` graph param holding a captured program's per-call seed."""

_ROUNDS = ((48271, 1), (16807, 3), (69621, 5))


def mix(seed, counter, ops=None):
    """The generator: a value in ``[0, PRIME)`` from ``seed`` and ``counter`` (numpy int64
    arrays, or loop-IR expressions with ``ops=(const, mod)``)."""
    if ops is None:
        def c(v):
            return np.int64(v)

        def mod(v):
            return v % np.int64(PRIME)
    else:
        c, mod = ops
    s = mod(seed)
    x = mod(counter)
    h = x
    for mult, add in _ROUNDS:
        h = mod(h * c(mult) + s + c(add))   # linear step mixes in the seed
        h = mod(h * h + x)                  # squaring: the nonlinear step
    return h


def threshold(p: float) -> int:
    """The integer threshold: an element is kept when its value is ``>=`` it."""
    return round(min(max(p, 0.0), 1.0) * PRIME)


def _mask_infer(types, *, shape, p, offset=0):
    (seed,) = types
    if seed.dtype != DType.int64 or seed.rank != 0:
        raise TypeError(f"the seed must be an int64 scalar (i64[]), got {seed}")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {fmt_shape(shape)} has a negative size")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"drop probability p={p} must be between 0 and 1")
    if offset < 0:
        raise ValueError(f"offset {offset} must be non-negative")
    return TensorType(tuple(shape), DType.bool)


@defop("dropout_mask", infer=_mask_infer, num_inputs=1, traits=("random", "replayable"),
       attrs={"shape": Attr("ints"), "p": Attr("float"), "offset": Attr("int", 0)})
def dropout_mask(seed, *, shape, p, offset=0):
    """``True`` (keep) with probability ``1 - p`` per element, from ``(seed, offset + k)``."""
    count = math.prod(shape)
    counter = np.arange(count, dtype=np.int64) + np.int64(offset)
    values = mix(np.asarray(seed, dtype=np.int64), counter)
    return (values >= np.int64(threshold(p))).reshape(tuple(shape))


defvjp("dropout_mask")(nondifferentiable)


def int64_const(v) -> object:
    """A loop-IR int64 constant (the generator's arithmetic is all int64)."""
    return const(int(v), DType.int64)


def mix_at(seed, i, shape, offset):
    """The loop-IR expression of :func:`mix` for element ``i`` (row-major in ``shape``) of a
    draw at counter ``offset``: what generated code computes, bit for bit the reference's."""
    i64 = DType.int64
    counter = convert(linear_index(i, shape), i64, i64) + size_value(offset, i64)
    return mix(seed.at((), i64), counter, (int64_const, lambda v: v % int64_const(PRIME)))


@defcompute("dropout_mask")
def _dropout_mask_compute(ctx, seed, *, shape, p, offset=0):
    return ctx.tensor(ctx.out_shape, DType.bool,
                      lambda i: cmp(">=", mix_at(seed, i, shape, offset), int64_const(threshold(p))))
