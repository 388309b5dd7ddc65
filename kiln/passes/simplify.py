"""Algebraic simplification, written as rewrites for the pattern driver.

Every rewrite keeps the exact result type of what it replaces: when a simplification would
change the broadcast shape or the dtype (``x * ones(4, 3)`` with ``x: f32[3]``, or
``i32 * f32``), it does not fire.  The rules and their fine print:

* ``x * 1``, ``1 * x``, ``x / 1``, ``x - 0``  ->  ``x`` (exact).
* ``x + 0``, ``0 + x``  ->  ``x``; for floats exact except that ``-0.0 + 0.0`` is ``+0.0``
  while ``x`` stays ``-0.0`` (the values compare equal).
* ``x * 0``, ``0 * x``  ->  zeros, only for integer and bool results (for floats,
  ``inf * 0`` and ``nan * 0`` are NaN).
* ``neg(neg(x))``  ->  ``x``.
* ``log(exp(x))``  ->  ``x`` for floats (exact in real arithmetic; removes overflow).
  ``exp(log(x))``  ->  ``x`` only when ``x`` is provably non-negative (produced by an op
  with trait ``nonnegative`` -- ``exp``, ``sigmoid``, ``relu``, ``abs``, ``sqrt``, ``rsqrt``,
  ``softmax`` --, by ``x * x``, or a constant with no negative element); for ``x < 0``
  ``log`` gives NaN.
* ``x / c``  ->  ``x * (1 / c)`` for floating ``c`` whose elements are all the same power of
  two (normal range, so ``1 / c`` is exact): both round the same real number, so the
  results are bit-identical.  Other divisors are left alone: ``x * (1/c)`` can differ from
  ``x / c`` in the last bit, and kiln keeps bit-exact rewrites here.
* ``permute(permute(x, p), q)``  ->  ``permute(x, p[q])``, or ``x`` when that is the identity;
  ``permute`` with the identity permutation  ->  ``x``.
* ``reshape(reshape(x))``  ->  one ``reshape``; ``reshape`` / ``expand`` to ``x``'s own shape
  ->  ``x``; a ``slice`` whose result has ``x``'s shape  ->  ``x`` (it covers the whole dim).
* ``cast(x, x.dtype)``  ->  ``x``; ``cast(cast(x, a), b)``  ->  ``cast(x, b)`` (or ``x`` when
  ``b`` is ``x``'s dtype) when ``a`` represents every value of ``x``'s dtype exactly
  (``f32 -> f64 -> f32`` folds; ``f32 -> f16 -> f32`` stays).
* ``scaled_dot_product_attention(q, k, v, mask)`` with a constant mask that is the causal
  one (``tril(ones(L, S))`` in every batch slice: bool ``True`` where kept, or float ``0``
  kept and ``-inf`` masked)  ->  the same attention with ``is_causal=True`` and no mask.
  The same scores are excluded, so the result is the same; a kernel can then skip the
  masked blocks instead of reading a mask (GPT-2's captured graph carries its causal mask
  as such a constant).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np

from kiln.ir import DType, Value, has_op
from kiln.passes.base import register_pass
from kiln.passes.pattern import (
    FLOAT_DTYPES,
    Builder,
    Match,
    PatternPass,
    Rewrite,
    any_value,
    const,
    constant_data,
    op,
    rewrite,
)


def _same_type_as_root(m: Match, name: str) -> Value | None:
    x = m[name]
    return x if x.type == m.value.type else None


@rewrite(op("mul", any_value("x"), const(value=1), commutative=True))
def mul_by_one(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


@rewrite(op("add", any_value("x"), const(value=0), commutative=True))
def add_zero(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


@rewrite(op("sub", any_value("x"), const(value=0)))
def sub_zero(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


@rewrite(op("div", any_value("x"), const(value=1), attrs={"rounding_mode": None}))
def div_by_one(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


@rewrite(op("mul", any_value("x"), const(value=0), commutative=True))
def mul_by_zero_int(m: Match, b: Builder) -> Value | None:
    out = m.value.type
    if out.dtype.is_floating or not out.is_static or not has_op("full"):
        return None
    return b.op("full", shape=tuple(out.shape), value=0, dtype=out.dtype)


@rewrite(op("neg", op("neg", any_value("x"))))
def double_neg(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


@rewrite(op("log", op("exp", any_value("x", dtype=FLOAT_DTYPES))))
def log_of_exp(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


def provably_nonnegative(v: Value) -> bool:
    """True when every element of ``v`` is >= 0 or NaN, judged from its producer: a
    constant, an op with trait ``nonnegative`` or a square ``mul(x, x)``."""
    data = constant_data(v, max_elements=1 << 16)
    if data is not None:
        return not bool(np.any(np.asarray(data, dtype=np.float64) < 0))
    node = v.producer
    if node is None:
        return False
    if node.op.has("nonnegative"):
        return True
    return node.op_name == "mul" and node.inputs[0] is node.inputs[1]


@rewrite(op("exp", op("log", any_value("x", dtype=FLOAT_DTYPES, where=provably_nonnegative))))
def exp_of_log(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


def _power_of_two_reciprocal(data: np.ndarray) -> float | None:
    """``1 / c`` when every element of ``data`` is the same power of two with a normal,
    finite reciprocal in ``data``'s dtype; else ``None``."""
    flat = np.asarray(data, dtype=np.float64).reshape(-1)
    if flat.size == 0 or not np.all(flat == flat[0]):
        return None
    c = float(flat[0])
    if not np.isfinite(c) or c == 0 or abs(np.frexp(c)[0]) != 0.5:
        return None
    reciprocal = 1.0 / c
    info = ml_dtypes.finfo(data.dtype)
    if not float(info.tiny) <= abs(reciprocal) <= float(info.max):
        return None
    return reciprocal


@rewrite(op("div", any_value("x"), const("c", dtype=FLOAT_DTYPES), attrs={"rounding_mode": None}))
def div_by_power_of_two(m: Match, b: Builder) -> Value | None:
    c = m["c"]
    reciprocal = _power_of_two_reciprocal(m.const("c"))
    if reciprocal is None:
        return None
    inverse = b.const(np.full(c.shape, reciprocal, dtype=c.dtype.numpy), dtype=c.dtype)
    out = b.op("mul", m["x"], inverse)
    return out if out.type == m.value.type else None


def _norm_perm(dims: Sequence[int]) -> tuple[int, ...]:
    rank = len(dims)
    return tuple(d % rank if rank else d for d in dims)


@rewrite(op("permute", op("permute", any_value("x"), name="inner")))
def permute_of_permute(m: Match, b: Builder) -> Value | None:
    inner = _norm_perm(m.attrs("inner")["dims"])
    outer = _norm_perm(m.value.producer.attrs["dims"])
    composed = tuple(inner[j] for j in outer)
    if composed == tuple(range(len(composed))):
        return _same_type_as_root(m, "x")
    return b.op("permute", m["x"], dims=composed)


@rewrite(op("permute", any_value("x")))
def identity_permute(m: Match, b: Builder) -> Value | None:
    dims = _norm_perm(m.value.producer.attrs["dims"])
    if dims != tuple(range(len(dims))):
        return None
    return _same_type_as_root(m, "x")


@rewrite(op("reshape", op("reshape", any_value("x"))))
def reshape_of_reshape(m: Match, b: Builder) -> Value | None:
    out = m.value.type
    if not out.is_static:
        return None
    if m["x"].type == out:
        return m["x"]
    return b.op("reshape", m["x"], shape=tuple(out.shape))


@rewrite(op(("reshape", "expand", "slice"), any_value("x")))
def view_to_same_shape(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


@rewrite(op("cast", any_value("x")))
def cast_to_same_dtype(m: Match, b: Builder) -> Value | None:
    return _same_type_as_root(m, "x")


_INT_RANGE = {
    DType.bool: (0, 1), DType.uint8: (0, 255), DType.int8: (-128, 127),
    DType.int32: (-(2**31), 2**31 - 1), DType.int64: (-(2**63), 2**63 - 1),
}
_FLOAT_BITS = {DType.float16: (11, 5), DType.bfloat16: (8, 8), DType.float32: (24, 8),
               DType.float64: (53, 11)}
"""Significand bits (with the implicit one) and exponent bits of each float dtype."""


def represents_exactly(src: DType, dst: DType) -> bool:
    """True when every value of dtype ``src`` converts to ``dst`` and back unchanged."""
    if src == dst:
        return True
    if dst == DType.bool:
        return src == DType.bool
    if src in _INT_RANGE:
        lo, hi = _INT_RANGE[src]
        if dst in _INT_RANGE:
            dlo, dhi = _INT_RANGE[dst]
            return dlo <= lo and hi <= dhi
        significand = _FLOAT_BITS[dst][0]
        return max(abs(lo), hi) <= 2**significand
    if dst in _INT_RANGE:
        return False
    (s_sig, s_exp), (d_sig, d_exp) = _FLOAT_BITS[src], _FLOAT_BITS[dst]
    return d_sig >= s_sig and d_exp >= s_exp


@rewrite(op("cast", op("cast", any_value("x"), name="mid")))
def cast_of_lossless_cast(m: Match, b: Builder) -> Value | None:
    x, mid = m["x"], m["mid"]
    if not represents_exactly(x.dtype, mid.dtype):
        return None
    target = m.value.dtype
    if target == x.dtype:
        return x
    return b.op("cast", x, dtype=target)


def _is_causal_mask(data: np.ndarray, length: int, keys: int) -> bool:
    """Whether ``data`` (a constant attention mask, broadcasting to ``[..., length, keys]``)
    keeps exactly the scores of ``tril(ones(length, keys))`` in every batch slice."""
    if data.ndim < 2 or data.shape[-2:] != (length, keys):
        return False
    causal = np.tril(np.ones((length, keys), dtype=bool))
    slices = data.reshape(-1, length, keys)
    if data.dtype == np.bool_:
        return bool(np.all(slices == causal))
    values = slices.astype(np.float64)  # else floating: the op's type rule admits no other mask
    return bool(np.all(np.where(causal, values == 0.0, values == -np.inf)))


@rewrite(op("scaled_dot_product_attention", any_value("q"), any_value("k"), any_value("v"), const("mask"),
            attrs={"is_causal": False}))
def causal_mask_to_flag(m: Match, b: Builder) -> Value | None:
    q, k = m["q"], m["k"]
    if not (q.type.is_static and k.type.is_static and m["mask"].type.is_static):
        return None
    if not _is_causal_mask(m.const("mask"), q.shape[-2], k.shape[-2]):
        return None
    out = b.op("scaled_dot_product_attention", q, k, m["v"], is_causal=True,
               scale=m.value.producer.attrs["scale"])
    return out if out.type == m.value.type else None


SIMPLIFY_REWRITES: tuple[Rewrite, ...] = (
    mul_by_one, add_zero, sub_zero, div_by_one, mul_by_zero_int, double_neg, log_of_exp,
    exp_of_log, div_by_power_of_two, permute_of_permute, identity_permute, reshape_of_reshape,
    view_to_same_shape, cast_to_same_dtype, cast_of_lossless_cast, causal_mask_to_flag,
)


@register_pass
@dataclass(frozen=True)
class Simplify(PatternPass):
    """Algebraic simplification: the rewrites listed in :mod:`kiln.passes.simplify`.

    Guarantees: results keep their exact types; every rewrite is exact (bit-identical
    results, up to the sign of a zero in ``x + 0``) except ``log(exp(x)) -> x``, which is
    exact in real arithmetic and avoids overflow.  Idempotent: it runs to a fixpoint.
    """

    name: ClassVar[str] = "simplify"

    def rewrites(self) -> Sequence[Rewrite]:
        return SIMPLIFY_REWRITES
