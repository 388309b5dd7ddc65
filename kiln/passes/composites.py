"""Composite recognition: turn what ATen decompositions break apart back into one op.

Registered pass ``composites{patterns="all"}``; ``patterns`` is ``"all"`` or a comma-separated
subset of :data:`PATTERN_GROUPS`:

================  ============================================================================
group             recognized (``x`` float; every reduction ``keepdim=true``)
================  ============================================================================
``layer_norm``    ``(x - mean(x)) * rsqrt(v + eps)`` or ``/ sqrt(v + eps)``, with ``v`` one of
                  ``mean((x - mean(x))^2)`` (``pow 2`` or ``d * d``) or
                  ``var(x, correction=0)`` (the ``var_mean`` form), then ``* weight`` and
                  ``+ bias`` -> ``layer_norm(x[, w[, b]]) {normalized_rank, eps}``
``rms_norm``      ``x * rsqrt(mean(x^2) + eps)`` or ``x / sqrt(...)``, then ``* weight``
                  -> ``rms_norm(x[, w]) {normalized_rank, eps}``
``softmax``       ``exp(x - amax(x)) / sum(exp(x - amax(x)))`` (also without the ``amax``
                  shift) -> ``softmax(x) {dim}``
``log_softmax``   ``(x - amax(x)) - log(sum(exp(x - amax(x))))`` (also unshifted)
                  -> ``log_softmax(x) {dim}``
``gelu``          ``0.5 * x * (1 + erf(x / sqrt(2)))`` -> ``gelu(x)``;
                  ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``
                  -> ``gelu(x) {approximate="tanh"}`` (scalings by ``mul`` or ``div``, any
                  operand order, ``x^3`` as ``pow`` or products)
``silu``          ``x * sigmoid(x)``, ``x / (1 + exp(-x))`` -> ``silu(x)``
``gated_mlp``     ``silu(a) * b`` with ``a``, ``b`` of one type (the SiLU-gated MLP,
                  ``silu(x @ W1) * (x @ W3)``) -> ``silu_mul(a, b)``; fusion then puts it in
                  the epilogue of one projection
``attention``     ``softmax(q @ k^T * scale [+ mask | where(mask, ., -inf)]) @ v``
                  -> ``scaled_dot_product_attention(q, k, v[, mask]) {scale}``, also
                  through the batch-only ``reshape``/``expand`` views, the split scaling
                  of ``q`` and ``k`` and the NaN-safe softmax of torch's decomposition
================  ============================================================================

A rewrite fires only when the math is the op's math: the normalized axes are the trailing
axes (layer/RMS norm), every reduction reduces the same axes with ``keepdim=true``, ``eps``
is a scalar constant (captured into the attribute as the shortest decimal that rounds to the
constant's value), scaling constants equal the expected value up to the constant dtype's
rounding, weights/biases have exactly the normalized axes' shape and the input's dtype, and
the replacement has exactly the matched root's type.  Intermediate values used elsewhere stay
in the graph (the result is still correct, only less compact).

Guarantees: the input graph is untouched; outputs are unchanged up to floating-point
rounding (fully masked attention rows give 0 in ``scaled_dot_product_attention`` where a
plain softmax would give NaN); the pass is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np

from kiln.ir import DType, Graph, OpTypeError, Value
from kiln.ir.printer import format_scalar
from kiln.ir.types import normalize_dim
from kiln.passes.base import Pass, PassResult, register_pass
from kiln.passes.pattern import (FLOAT_DTYPES, Builder, Match, Pat, Rewrite, RewriteFn,
                                 any_value, apply_patterns, const, match, op, splat_value)

# ----------------------------------------------------------------------------- constants
def rounding(dtype: DType) -> float:
    """Relative tolerance for constants stored in ``dtype`` (two ulps; at least 1e-6)."""
    if not dtype.is_floating:
        return 0.0
    return max(2 * float(ml_dtypes.finfo(dtype.numpy).eps), 1e-6)


def is_close(actual: float, expected: float, dtype: DType = DType.float32) -> bool:
    return abs(actual - expected) <= rounding(dtype) * abs(expected)


def near(target: float) -> Callable[[np.ndarray], bool]:
    """Predicate: every element equals ``target`` up to the array dtype's rounding."""

    def check(data: np.ndarray) -> bool:
        dtype = DType.from_numpy(data.dtype)  # bfloat16's numpy kind is "V", so ask kiln
        if data.size == 0 or dtype == DType.bool:
            return False
        rtol = rounding(dtype)
        return bool(np.all(np.abs(data.astype(np.float64) - target) <= rtol * abs(target)))

    return check


def scalar_of(value: Value) -> float | None:
    """The element value of a splat constant with one element or a rank-0 shape."""
    if value.type.rank and value.type.size != 1:  # symbolic sizes: never one element
        return None
    s = splat_value(value)
    return None if s is None else float(s)


def attr_float(value: Value) -> float | None:
    """A splat constant's value as the shortest decimal that rounds back to it."""
    s = scalar_of(value)
    if s is None:
        return None
    return float(format_scalar(s, value.dtype)) if value.dtype.is_floating else s


def unscale(value: Value) -> tuple[Value, float]:
    """Peel ``mul``/``div`` by scalar constants: ``value == base * factor`` (same type)."""
    factor = 1.0
    while value.producer is not None and value.producer.op_name in ("mul", "div"):
        node = value.producer
        a, b = node.inputs
        if node.op_name == "mul" and scalar_of(a) is not None and scalar_of(b) is None:
            a, b = b, a
        c = scalar_of(b)
        if c is None or c == 0.0 or a.type != value.type:
            break
        factor = factor * c if node.op_name == "mul" else factor / c
        value = a
    return value, factor


def trailing_rank(dims: Sequence[int], rank: int) -> int | None:
    """``k`` when ``dims`` are exactly the last ``k`` axes of a rank-``rank`` tensor."""
    if rank == 0:
        return None
    axes = sorted({normalize_dim(d, rank) for d in dims}) if dims else list(range(rank))
    k = len(axes)
    return k if axes == list(range(rank - k, rank)) else None


def single_axis(dims: Sequence[int], rank: int) -> int | None:
    """The one (non-negative) axis in ``dims``, else ``None``."""
    if rank == 0 or len(dims) != 1:
        return None
    return normalize_dim(dims[0], rank)


KEEPDIM = {"keepdim": True}
FLOAT_X = any_value("x", dtype=FLOAT_DTYPES)
X = any_value("x")

# ----------------------------------------------------------------------------- norms
def _square(name: str) -> list[Pat]:
    v = any_value(name)
    return [op("pow", v, const(data_where=near(2.0))), op("mul", v, any_value(name))]


def _normalize(numerator: Pat, variance: Pat) -> list[Pat]:
    """``numerator * rsqrt(variance + eps)`` and ``numerator / sqrt(variance + eps)``."""
    plus_eps = op("add", variance, const("eps"), commutative=True)
    return [
        op("mul", numerator, op("rsqrt", plus_eps), commutative=True),
        op("div", numerator, op("sqrt", plus_eps)),
    ]


def _centered() -> Pat:
    return op("sub", FLOAT_X, op("mean", X, name="mu", attrs=KEEPDIM), name="d")


def _norm_fn(m: Match, b: Builder) -> Value | None:
    """layer_norm when the pattern centered ``x`` (captured ``mu``), else rms_norm."""
    x, ms = m["x"], m.node("ms")
    k = trailing_rank(ms.attrs["dims"], x.type.rank)
    eps = attr_float(m["eps"])
    if k is None or eps is None or x.type != m.value.type:
        return None
    if "mu" not in m:
        return b.op("rms_norm", x, normalized_rank=k, eps=eps)
    if trailing_rank(m.node("mu").attrs["dims"], x.type.rank) != k:
        return None
    return b.op("layer_norm", x, normalized_rank=k, eps=eps)


def _layer_norm_from_rms_fn(m: Match, b: Builder) -> Value | None:
    x, mu, rms = m["x"], m.node("mu"), m.node("n")
    k = trailing_rank(mu.attrs["dims"], x.type.rank)
    if k != rms.attrs["normalized_rank"] or x.type != m.value.type:
        return None
    return b.op("layer_norm", x, normalized_rank=k, eps=rms.attrs["eps"])


def _norm_param(b: Builder, param: Value, x: Value, k: int) -> Value | None:
    """``param`` shaped like the last ``k`` axes of ``x`` (dropping leading 1s), else None."""
    trailing = x.shape[x.type.rank - k:]
    if param.dtype != x.dtype:
        return None
    if param.shape == trailing:
        return param
    lead = param.type.rank - k
    if lead > 0 and param.shape[lead:] == trailing and all(d == 1 for d in param.shape[:lead]):
        return b.op("reshape", param, shape=tuple(trailing))
    return None


def _norm_weight_fn(m: Match, b: Builder) -> Value | None:
    norm = m.node("n")
    if len(norm.inputs) != 1 or m.value.type != norm.output.type:
        return None
    x = norm.inputs[0]
    w = _norm_param(b, m["w"], x, norm.attrs["normalized_rank"])
    return None if w is None else b.op(norm.op_name, x, w, **norm.attrs)


def _norm_bias_fn(m: Match, b: Builder) -> Value | None:
    norm = m.node("n")
    if len(norm.inputs) != 2 or m.value.type != norm.output.type:
        return None
    x, w = norm.inputs
    bias = _norm_param(b, m["b"], x, norm.attrs["normalized_rank"])
    return None if bias is None else b.op("layer_norm", x, w, bias, **norm.attrs)


def _rewrites(name: str, patterns: Sequence[Pat], fn: RewriteFn) -> list[Rewrite]:
    return [Rewrite(f"{name}[{i}]", p, fn) for i, p in enumerate(patterns)]


def _norm_affine_rewrites(norms: tuple[str, ...]) -> list[Rewrite]:
    weighted = op("mul", op(norms, name="n", one_use=True), any_value("w"), commutative=True)
    out = _rewrites("norm-weight", [weighted], _norm_weight_fn)
    if "layer_norm" in norms:
        norm = op("layer_norm", name="n", one_use=True)
        biased = op("add", norm, any_value("b"), commutative=True)
        out += _rewrites("norm-bias", [biased], _norm_bias_fn)
    return out


def layer_norm_rewrites() -> list[Rewrite]:
    variances = [op("mean", sq, name="ms", attrs=KEEPDIM) for sq in _square("d")]
    variances.append(op("var", X, name="ms", attrs={**KEEPDIM, "correction": 0.0}))
    patterns = [p for var in variances for p in _normalize(_centered(), var)]
    from_rms = op("rms_norm", _centered(), name="n")
    return (_rewrites("layer-norm", patterns, _norm_fn)
            + _rewrites("layer-norm-from-rms", [from_rms], _layer_norm_from_rms_fn)
            + _norm_affine_rewrites(("layer_norm",)))


def rms_norm_rewrites() -> list[Rewrite]:
    mean_sq = [op("mean", sq, name="ms", attrs=KEEPDIM) for sq in _square("x")]
    patterns = [p for ms in mean_sq for p in _normalize(FLOAT_X, ms)]
    return _rewrites("rms-norm", patterns, _norm_fn) + _norm_affine_rewrites(("rms_norm",))


# ---------------------------------------------------------------------------- softmax
def _shifted() -> list[Pat]:
    """``x - amax(x)`` (captured as ``s``) and the unshifted ``x``."""
    return [op("sub", FLOAT_X, op("amax", X, name="mx", attrs=KEEPDIM), name="s"), FLOAT_X]


def _softmax_axis(m: Match) -> int | None:
    x, den = m["x"], m.node("den")
    rank = x.type.rank
    dim = single_axis(den.attrs["dims"], rank)
    if dim is None or den.attrs.get("dtype") is not None or x.type != m.value.type:
        return None
    if "mx" in m and single_axis(m.node("mx").attrs["dims"], rank) != dim:
        return None
    return dim


def _along_axis(op_name: str):
    def fn(m: Match, b: Builder) -> Value | None:
        dim = _softmax_axis(m)
        return None if dim is None else b.op(op_name, m["x"], dim=dim)

    return fn


def softmax_rewrites() -> list[Rewrite]:
    patterns = []
    for s in _shifted():
        e = op("exp", s, name="e")
        patterns.append(op("div", e, op("sum", any_value("e"), name="den", attrs=KEEPDIM)))
    return _rewrites("softmax", patterns, _along_axis("softmax"))


def log_softmax_rewrites() -> list[Rewrite]:
    patterns = []
    for s in _shifted():
        name = "s" if s.ops else "x"
        lse = op("log", op("sum", op("exp", any_value(name)), name="den", attrs=KEEPDIM))
        patterns.append(op("sub", s, lse))
    return _rewrites("log-softmax", patterns, _along_axis("log_softmax"))


# ------------------------------------------------------------------------ activations
SQRT1_2 = 0.7071067811865476
SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715


def _one_plus(function: str) -> Pat:
    return op("add", op(function, any_value("arg"), name="t"), const(data_where=near(1.0)),
              commutative=True, name="onep")


def _gelu_patterns(function: str) -> list[Pat]:
    """``0.5 * x * onep`` in its three associations; scalings are checked by the function."""
    onep = _one_plus(function)
    scale = const("s")
    return [
        op("mul", any_value("a"), onep, commutative=True),
        op(("mul", "div"), op("mul", any_value("a"), onep, commutative=True, name="prod"), scale),
        op("mul", any_value("a"), op(("mul", "div"), onep, scale, name="sonep"), commutative=True),
    ]


def _outer_factor(m: Match) -> float | None:
    """The scalar factor outside ``x * onep`` (1 when there is none)."""
    if "s" not in m:
        return 1.0
    s = scalar_of(m["s"])
    if s is None or s == 0.0:
        return None
    scaled = m.root if "prod" in m else m.node("sonep")
    return s if scaled.op_name == "mul" else 1.0 / s


def power_of(value: Value, x: Value) -> float | None:
    """``n`` when ``value`` is ``x ** n`` built from ``x``, ``mul`` and ``pow`` by constants."""
    if value is x:
        return 1.0
    node = value.producer
    if node is None or node.op_name not in ("mul", "pow") or value.type != x.type:
        return None
    base = power_of(node.inputs[0], x)
    if node.op_name == "pow":
        exponent = scalar_of(node.inputs[1])
        return None if base is None or exponent is None else base * exponent
    other = power_of(node.inputs[1], x)
    return None if base is None or other is None else base + other


def _tanh_argument_ok(arg: Value, x: Value) -> bool:
    inner, f = unscale(arg)
    node = inner.producer
    if not is_close(f, SQRT_2_OVER_PI, x.dtype) or node is None or node.op_name != "add":
        return False
    for lin, cubic in (node.inputs, node.inputs[::-1]):
        cube, fc = unscale(cubic)
        if lin is x and is_close(fc, GELU_CUBIC, x.dtype) and power_of(cube, x) == 3.0:
            return True
    return False


def _gelu_fn(m: Match, b: Builder) -> Value | None:
    outer = _outer_factor(m)
    if outer is None:
        return None
    x, fa = unscale(m["a"])
    if x.type != m.value.type or not is_close(outer * fa, 0.5, x.dtype):
        return None
    if m.node("t").op_name == "erf":
        arg, f = unscale(m["arg"])
        if arg is not x or not is_close(f, SQRT1_2, x.dtype):
            return None
        return b.op("gelu", x)
    if not _tanh_argument_ok(m["arg"], x):
        return None
    return b.op("gelu", x, approximate="tanh")


def gelu_rewrites() -> list[Rewrite]:
    return (_rewrites("gelu-erf", _gelu_patterns("erf"), _gelu_fn)
            + _rewrites("gelu-tanh", _gelu_patterns("tanh"), _gelu_fn))


def _silu_fn(m: Match, b: Builder) -> Value | None:
    x = m["x"]
    return b.op("silu", x) if x.type == m.value.type else None


def silu_rewrites() -> list[Rewrite]:
    patterns = [
        op("mul", FLOAT_X, op("sigmoid", X), commutative=True),
        op("div", FLOAT_X, op("add", op("exp", op("neg", X)), const(data_where=near(1.0)),
                              commutative=True)),
    ]
    return _rewrites("silu", patterns, _silu_fn)


def _gated_fn(m: Match, b: Builder) -> Value | None:
    a, gate_b = m["a"], m["b"]
    if a.type != gate_b.type or a.type != m.value.type:
        return None
    return b.op("silu_mul", a, gate_b)


def gated_mlp_rewrites() -> list[Rewrite]:
    pattern = op("mul", op("silu", any_value("a"), one_use=True), any_value("b"), commutative=True)
    return _rewrites("gated-mlp", [pattern], _gated_fn)


# -------------------------------------------------------------------------- attention
def strip_batch_views(value: Value) -> Value:
    """Peel ``reshape``/``expand`` nodes that keep the last two axes (batch-only views)."""
    while value.producer is not None and value.producer.op_name in ("reshape", "expand"):
        inner = value.producer.inputs[0]
        if min(inner.type.rank, value.type.rank) < 2 or inner.shape[-2:] != value.shape[-2:]:
            break
        value = inner
    return value


def peel(value: Value) -> tuple[Value, float]:
    """Strip batch-only views and scalar scalings, in any interleaving."""
    factor = 1.0
    while True:
        stripped, f = unscale(strip_batch_views(value))
        factor *= f
        if stripped is value:
            return value, factor
        value = stripped


def _last_axis(dims: Sequence[int], rank: int) -> bool:
    return single_axis(dims, rank) == rank - 1


_SOFTMAX_S = op("softmax", any_value("s"), name="p")
_ROW_ALIVE = op("any", op("logical_not", op("eq", any_value("s"), const(value=-np.inf))),
                name="anyk", attrs=KEEPDIM)
_PROBS = [_SOFTMAX_S, op("where", op("logical_not", _ROW_ALIVE), const(value=0), _SOFTMAX_S)]


def _probabilities(graph: Graph, value: Value) -> Value | None:
    """The scores ``s`` when ``value`` is ``softmax(s)`` over the last axis (or its NaN-safe
    form from torch's attention decomposition), else ``None``."""
    for pattern in _PROBS:
        m = match(pattern, value, graph)
        if m is None:
            continue
        s = m["s"]
        if not _last_axis((m.node("p").attrs["dim"],), s.type.rank):
            return None
        if "anyk" in m and not _last_axis(m.node("anyk").attrs["dims"], s.type.rank):
            return None
        return s
    return None


def _split_mask(b: Builder, scores: Value) -> tuple[Value, Value | None]:
    """``scores = raw + mask`` or ``where(mask, raw, -inf)`` -> (raw, mask); else (scores, None)."""
    node = scores.producer
    if node is None:
        return scores, None
    if node.op_name == "add":
        for raw, mask in (node.inputs, node.inputs[::-1]):
            if raw.type == scores.type and mask.dtype.is_floating and _is_qk(raw):
                return raw, mask
    if node.op_name == "where":
        cond, a, c = node.inputs
        if cond.dtype.name == "bool":
            if a.type == scores.type and _is_neg_inf(c) and _is_qk(a):
                return a, cond
            if c.type == scores.type and _is_neg_inf(a) and _is_qk(c):
                return c, b.op("logical_not", cond)
    return scores, None


def _is_neg_inf(value: Value) -> bool:
    s = scalar_of(value)
    return s is not None and s == -np.inf


def _is_qk(value: Value) -> bool:
    base, _ = peel(value)
    return base.producer is not None and base.producer.op_name == "matmul"


def _untransposed(b: Builder, kt: Value) -> Value:
    """``k`` such that ``kt`` is ``k`` with its last two axes swapped."""
    rank = kt.type.rank
    swap = tuple(range(rank - 2)) + (rank - 1, rank - 2)
    node = kt.producer
    if node is not None and node.op_name == "permute":
        dims = tuple(normalize_dim(d, rank) for d in node.attrs["dims"])
        composed = tuple(dims[i] for i in swap)
        if composed == tuple(range(rank)):
            return node.inputs[0]
        return b.op("permute", node.inputs[0], dims=composed)
    return b.op("permute", kt, dims=swap)


def _attention_fn(m: Match, b: Builder) -> Value | None:
    mm = m.node("mm")
    scores = _probabilities(m.graph, strip_batch_views(mm.inputs[0]))
    if scores is None:
        return None
    v = strip_batch_views(mm.inputs[1])
    raw, mask = _split_mask(b, scores)
    qk, scale = peel(raw)
    if qk.producer is None or qk.producer.op_name != "matmul":
        return None
    q, fq = peel(qk.producer.inputs[0])
    kt, fk = peel(qk.producer.inputs[1])
    if q.type.rank < 2 or kt.type.rank < 2 or not q.dtype.is_floating:
        return None
    scale *= fq * fk
    k = _untransposed(b, kt)
    attrs = {} if is_close(scale, q.shape[-1] ** -0.5, q.dtype) else {"scale": scale}
    operands = (q, k, v) if mask is None else (q, k, v, mask)
    try:
        out = b.op("scaled_dot_product_attention", *operands, **attrs)
    except OpTypeError:
        return None
    return out if out.type == m.value.type else None


def attention_rewrites() -> list[Rewrite]:
    product = op("matmul", any_value("pb"), any_value("vb"), name="mm")
    reshaped = op("reshape", op("matmul", any_value("pb"), any_value("vb"), name="mm"))
    return _rewrites("attention", [product, reshaped], _attention_fn)


# ---------------------------------------------------------------------------- the pass
PATTERN_GROUPS: dict[str, Callable[[], list[Rewrite]]] = {
    "attention": attention_rewrites,
    "layer_norm": layer_norm_rewrites,
    "rms_norm": rms_norm_rewrites,
    "log_softmax": log_softmax_rewrites,
    "softmax": softmax_rewrites,
    "gelu": gelu_rewrites,
    "gated_mlp": gated_mlp_rewrites,
    "silu": silu_rewrites,
}
"""Pattern groups by name, in the order their rewrites are tried on a node."""


def select_groups(patterns: str) -> list[str]:
    """Group names selected by a ``patterns`` option (``"all"`` or comma-separated names)."""
    text = patterns.strip()
    if text == "all":
        return list(PATTERN_GROUPS)
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PATTERN_GROUPS]
    if unknown:
        raise ValueError(f"composites: unknown pattern group(s) {', '.join(unknown)}; "
                         f"known: all, {', '.join(PATTERN_GROUPS)}")
    return [g for g in PATTERN_GROUPS if g in chosen]


def composite_rewrites(patterns: str = "all") -> list[Rewrite]:
    """The rewrites of the selected groups, in :data:`PATTERN_GROUPS` order."""
    return [rw for group in select_groups(patterns) for rw in PATTERN_GROUPS[group]()]


@register_pass
@dataclass(frozen=True)
class Composites(Pass):
    """Recognize decomposed layer/RMS norm, (log-)softmax, GELU, SiLU, the SiLU-gated MLP
    and attention, and replace each by its one op (see :mod:`kiln.passes.composites`).

    Options: ``patterns`` (``"all"`` or comma-separated group names), ``max_rounds``.
    """

    name: ClassVar[str] = "composites"
    patterns: str = "all"
    max_rounds: int = 32

    def __post_init__(self) -> None:
        select_groups(self.patterns)

    def run(self, graph: Graph) -> PassResult:
        return apply_patterns(graph, composite_rewrites(self.patterns), max_rounds=self.max_rounds)


__all__ = [
    "Composites", "PATTERN_GROUPS", "attr_float", "composite_rewrites", "near", "scalar_of",
    "select_groups", "unscale",
]
