"""ATen -> kiln rules for random ops: every distribution from ``random_uniform`` draws.

See :mod:`kiln.frontends.torch.aten` for how rules are declared, and
:mod:`kiln.ir.ops.distributions` for the generator op.  Each rule draws uniforms on kiln's
counter-based generator (the graph param ``rng.seed``, refilled from torch's default
generator before every call, so ``torch.manual_seed`` makes a run reproducible and every
call draws anew) and transforms them with ordinary ops:

========================================  ==================================================
ATen op                                   kiln program (``u``: uniform in ``[0, 1)``)
========================================  ==================================================
``rand``, ``rand_like``, ``uniform``      ``from + (to - from) * u``
``randn``, ``randn_like``, ``normal``     ``mean + std * z``, ``z = sqrt(-2 log(1 - u1)) cos(2 pi u2)``
                                          (Box-Muller, two draws per element)
``randint``, ``randint_like``             ``low + floor(u * (high - low))`` (``u`` float64)
``bernoulli`` (tensor or float ``p``)     ``u < p`` (the dropouts of the decomposition use it)
``exponential``                           ``-log(1 - u) / lambd``
``geometric``                             ``floor(log(1 - u) / log(1 - p)) + 1``
``log_normal``                            ``exp(mean + std * z)``
``cauchy``                                ``median + sigma * tan(pi (u - 1/2))``
``multinomial`` with replacement          ``searchsorted(cumsum(p), u * sum(p), right=True)``
``multinomial`` without replacement       the ``k`` smallest ``-log(u') / p`` (``argsort``):
                                          exponential races, one per category
``rrelu`` (training)                      ``x * noise``, ``noise = x <= 0 ? lower + (upper - lower) u : 1``
``empty_strided``, ``new_empty_strided``  zeros (their contents are unspecified)
========================================  ==================================================

Float32 and float64 results draw on a grid of ``2**24`` and ``2**31`` points, so
``1 - u`` is never zero and the normal tail reaches 5.8 (float32) or 6.5 (float64) standard
deviations.  Float16 and bfloat16 results are computed in float32 and rounded once.  Each
draw of a graph has its own counter range (``offset``), above those of the dropout masks
(which count from 0): draws of one call are independent.

Dropout variants (``dropout2d``/``dropout3d``/``feature_dropout``, ``alpha_dropout``,
``feature_alpha_dropout``) in training mode reach kiln decomposed into ``bernoulli.p`` of a
per-channel (or per-element) shape and ordinary arithmetic, so their gradients go through
the mask like eager's.  An explicit ``torch.Generator`` is refused: kiln draws from torch's
default generator only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir import DType, Value

from .aten import LoweringContext, aten, lowers, meta, optional_ops
from .aten_norm import rng_seed

STREAM_BASE = 2**30
"""First counter of ``random_uniform`` draws; ``dropout_mask`` counters count up from 0."""

RANDINT_MAX_RANGE = 2**31
"""The widest ``high - low`` ``randint`` draws (one float64 uniform of 31 bits per element)."""


# ------------------------------------------------------------------ drawing
def _next_offset(ctx: LoweringContext) -> int:
    """The first counter no earlier random draw of the graph uses (at least :data:`STREAM_BASE`)."""
    end = STREAM_BASE
    for n in ctx.graph.nodes:
        if n.op.has("random") and "offset" in n.attrs and "shape" in n.attrs:
            end = max(end, int(n.attrs["offset"]) + math.prod(int(d) for d in n.attrs["shape"]))
    return end


def _work_dtype(dtype: DType) -> DType:
    """The dtype a distribution of ``dtype`` results is computed in."""
    return DType.float64 if dtype == DType.float64 else DType.float32


def uniform(ctx: LoweringContext, shape: Sequence[int], dtype: DType) -> Value:
    """A fresh ``random_uniform`` draw of ``shape`` (values in ``[0, 1)``)."""
    shape = tuple(int(d) for d in shape)
    return ctx.op("random_uniform", rng_seed(ctx), shape=shape, offset=_next_offset(ctx), dtype=dtype)


def _scalar(ctx: LoweringContext, x: float, dtype: DType) -> Value:
    return ctx.const(x, dtype)


def _affine(ctx: LoweringContext, x: Value, scale: float, shift: float) -> Value:
    """``shift + scale * x`` in ``x``'s dtype (no node for a unit scale or a zero shift)."""
    if scale != 1.0:
        x = ctx.op("mul", x, _scalar(ctx, scale, x.dtype))
    if shift != 0.0:
        x = ctx.op("add", x, _scalar(ctx, shift, x.dtype))
    return x


def _one_minus(ctx: LoweringContext, u: Value) -> Value:
    """``1 - u``: exact on the draw's grid, in ``(0, 1]``."""
    return ctx.op("sub", _scalar(ctx, 1.0, u.dtype), u)


def standard_normal(ctx: LoweringContext, shape: Sequence[int], dtype: DType) -> Value:
    """Standard normal values of ``shape`` in ``dtype``'s work dtype (Box-Muller)."""
    work = _work_dtype(dtype)
    u1 = uniform(ctx, shape, work)
    u2 = uniform(ctx, shape, work)
    radius = ctx.op("sqrt", ctx.op("mul", ctx.op("log", _one_minus(ctx, u1)), _scalar(ctx, -2.0, work)))
    angle = ctx.op("cos", ctx.op("mul", u2, _scalar(ctx, 2.0 * math.pi, work)))
    return ctx.op("mul", radius, angle)


def _result(ctx: LoweringContext, x: Value) -> Value:
    """``x`` in the dtype torch recorded for the node."""
    return ctx.cast(x, ctx.out.dtype)


# ------------------------------------------------------------------ checks
def _describe_generator(generator: Any) -> str | None:
    if generator is not None:
        return ("an explicit torch.Generator is not supported: kiln draws from torch's default "
                "generator (seeded by torch.manual_seed); drop the generator argument")
    return None


def _floating_result(node: torch.fx.Node) -> str | None:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[0]
    if isinstance(val, torch.Tensor) and val.dtype not in (torch.float64, torch.float32,
                                                           torch.float16, torch.bfloat16):
        return (f"{node.target} with a {val.dtype} result is not supported; kiln draws "
                "float64, float32, float16 and bfloat16 values")
    return None


def _generator_check(position: int | None = None, floating: bool = True):
    """A check refusing an explicit generator (keyword ``generator`` or argument
    ``position``) and, with ``floating``, a result of a dtype kiln cannot draw."""

    def check(node: torch.fx.Node, *args: Any) -> str | None:
        names = [a.name for a in node.target._schema.arguments]
        gen = args[names.index("generator")] if "generator" in names else None
        reason = _describe_generator(gen)
        if reason is None and floating:
            reason = _floating_result(node)
        return reason

    return check


# ------------------------------------------------------------------ uniform
@lowers(aten.rand.default, aten.rand_like.default, check=_generator_check())
def _rand(ctx: LoweringContext, *_: Any) -> Value:
    return uniform(ctx, ctx.out.shape, ctx.out.dtype)


def _uniform_check(node: torch.fx.Node, x: Any, low: float, high: float, generator: Any) -> str | None:
    if not float(low) <= float(high):
        return f"uniform needs from <= to, got from={low}, to={high}"
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        return f"uniform needs finite bounds, got from={low}, to={high}"
    return _describe_generator(generator) or _floating_result(node)


@lowers(aten.uniform.default, check=_uniform_check)
def _uniform(ctx: LoweringContext, x: Value, low: float, high: float, generator: Any) -> Value:
    out = ctx.out
    u = uniform(ctx, out.shape, _work_dtype(out.dtype))
    return _result(ctx, _affine(ctx, u, float(high) - float(low), float(low)))


# ------------------------------------------------------------------ normal
@lowers(aten.randn.default, aten.randn_like.default, check=_generator_check())
def _randn(ctx: LoweringContext, *_: Any) -> Value:
    return _result(ctx, standard_normal(ctx, ctx.out.shape, ctx.out.dtype))


def _std_check(std: Any) -> str | None:
    if isinstance(std, (int, float)) and not float(std) >= 0.0:
        return f"normal expects std >= 0.0, but found std {std}"
    return None


def _normal_check(node: torch.fx.Node, *args: Any) -> str | None:
    names = [a.name for a in node.target._schema.arguments]
    reason = _std_check(args[names.index("std")]) if "std" in names else None
    return reason or _generator_check()(node, *args)


def _normal(ctx: LoweringContext, mean: Any, std: Any) -> Value:
    """``mean + std * z`` with ``mean``/``std`` python numbers or tensors (broadcast)."""
    out = ctx.out
    work = _work_dtype(out.dtype)
    z = standard_normal(ctx, out.shape, out.dtype)
    if isinstance(std, Value):
        z = ctx.op("mul", z, ctx.cast(std, work))
    elif float(std) != 1.0:
        z = ctx.op("mul", z, _scalar(ctx, float(std), work))
    if isinstance(mean, Value):
        z = ctx.op("add", z, ctx.cast(mean, work))
    elif float(mean) != 0.0:
        z = ctx.op("add", z, _scalar(ctx, float(mean), work))
    return _result(ctx, z)


@lowers(aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor,
        check=_normal_check)
def _normal_tensors(ctx: LoweringContext, mean: Any, std: Any, generator: Any) -> Value:
    return _normal(ctx, mean, std)


@lowers(aten.normal.float_float, check=_normal_check)
def _normal_sized(ctx: LoweringContext, mean: float, std: float, *_: Any) -> Value:
    return _normal(ctx, mean, std)


@lowers(aten.normal_functional.default, check=_normal_check)
def _normal_like(ctx: LoweringContext, x: Value, mean: float, std: float, generator: Any) -> Value:
    return _normal(ctx, mean, std)


# ------------------------------------------------------------------ integers
def _randint_bounds(node: torch.fx.Node, args: Sequence[Any]) -> tuple[int, int]:
    names = [a.name for a in node.target._schema.arguments]
    low = args[names.index("low")] if "low" in names else 0
    return int(low), int(args[names.index("high")])


def _randint_check(node: torch.fx.Node, *args: Any) -> str | None:
    names = [a.name for a in node.target._schema.arguments]
    if isinstance(args[names.index("high")], torch.fx.Node):
        return ("randint_like with a tensor bound is data-dependent; pass a python int "
                "(e.g. int(high))")
    low, high = _randint_bounds(node, args)
    if high <= low:
        return f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}"
    if high - low > RANDINT_MAX_RANGE:
        return (f"randint over a range of {high - low} values is not supported: kiln draws "
                f"integers from ranges of at most 2**31 values")
    gen = args[names.index("generator")] if "generator" in names else None
    return _describe_generator(gen)


@lowers(aten.randint.default, aten.randint.low, aten.randint_like.default,
        aten.randint_like.low_dtype, *optional_ops("randint_like.Tensor"), check=_randint_check)
def _randint(ctx: LoweringContext, *args: Any) -> Value:
    low, high = _randint_bounds(ctx.aten_node, args)
    out = ctx.out
    u = uniform(ctx, out.shape, DType.float64)
    k = ctx.op("floor", ctx.op("mul", u, _scalar(ctx, float(high - low), DType.float64)))
    k = ctx.op("cast", k, dtype=DType.int64)
    if low != 0:
        k = ctx.op("add", k, ctx.const(low, DType.int64))
    return _result(ctx, k)


# ------------------------------------------------------------------ bernoulli
def _bernoulli_p_check(node: torch.fx.Node, x: Any, p: Any, generator: Any) -> str | None:
    if isinstance(p, (int, float)) and not 0.0 <= float(p) <= 1.0:
        return f"bernoulli_ expects p to be in [0, 1], but got p={p}"
    return _describe_generator(generator)


@lowers(aten.bernoulli.p, aten.bernoulli.Tensor, check=_bernoulli_p_check)
def _bernoulli_p(ctx: LoweringContext, x: Value, p: Any, generator: Any) -> Value:
    out = ctx.out
    if isinstance(p, Value):
        work = _work_dtype(p.dtype) if p.dtype.is_floating else DType.float32
        u = uniform(ctx, out.shape, work)
        return _result(ctx, ctx.op("lt", u, ctx.cast(p, work)))
    u = uniform(ctx, out.shape, DType.float64)
    return _result(ctx, ctx.op("lt", u, _scalar(ctx, float(p), DType.float64)))


def _bernoulli_check(node: torch.fx.Node, x: Any, generator: Any) -> str | None:
    return _describe_generator(generator) or _floating_result(node)


@lowers(aten.bernoulli.default, check=_bernoulli_check)
def _bernoulli(ctx: LoweringContext, p: Value, generator: Any) -> Value:
    work = _work_dtype(p.dtype)
    u = uniform(ctx, p.shape, work)
    return _result(ctx, ctx.op("lt", u, ctx.cast(p, work)))


# ------------------------------------------------------------------ other distributions
def _positive_check(name: str, what: str, strict: bool = True):
    def check(node: torch.fx.Node, x: Any, a: float, *rest: Any) -> str | None:
        value = float(rest[0]) if what == "second" else float(a)
        ok = value > 0.0 if strict else value >= 0.0
        if not (ok and math.isfinite(value)):
            bound = "> 0" if strict else ">= 0"
            return f"{node.target} expects its {name} {bound} and finite, got {value}"
        return _describe_generator(rest[-1]) or _floating_result(node)

    return check


@lowers(aten.exponential.default, check=_positive_check("lambd", "first"))
def _exponential(ctx: LoweringContext, x: Value, lambd: float, generator: Any) -> Value:
    work = _work_dtype(ctx.out.dtype)
    u = uniform(ctx, ctx.out.shape, work)
    log = ctx.op("log", _one_minus(ctx, u))  # <= 0
    return _result(ctx, ctx.op("mul", log, _scalar(ctx, -1.0 / float(lambd), work)))


def _geometric_check(node: torch.fx.Node, x: Any, p: float, generator: Any) -> str | None:
    if not 0.0 < float(p) < 1.0:
        return f"geometric_ expects p to be in (0, 1), got p={p}"
    return _describe_generator(generator)


@lowers(aten.geometric.default, check=_geometric_check)
def _geometric(ctx: LoweringContext, x: Value, p: float, generator: Any) -> Value:
    u = uniform(ctx, ctx.out.shape, DType.float64)
    log = ctx.op("log", _one_minus(ctx, u))
    trials = ctx.op("floor", ctx.op("mul", log, _scalar(ctx, 1.0 / math.log1p(-float(p)), DType.float64)))
    return _result(ctx, ctx.op("add", trials, _scalar(ctx, 1.0, DType.float64)))


@lowers(aten.log_normal.default, check=_positive_check("std", "second"))
def _log_normal(ctx: LoweringContext, x: Value, mean: float, std: float, generator: Any) -> Value:
    z = standard_normal(ctx, ctx.out.shape, ctx.out.dtype)
    return _result(ctx, ctx.op("exp", _affine(ctx, z, float(std), float(mean))))


@lowers(aten.cauchy.default, check=_positive_check("sigma", "second"))
def _cauchy(ctx: LoweringContext, x: Value, median: float, sigma: float, generator: Any) -> Value:
    work = _work_dtype(ctx.out.dtype)
    u = uniform(ctx, ctx.out.shape, work)
    t = ctx.op("tan", _affine(ctx, u, math.pi, -0.5 * math.pi))
    return _result(ctx, _affine(ctx, t, float(sigma), float(median)))


# ------------------------------------------------------------------ multinomial
def _multinomial_check(node: torch.fx.Node, probs: Any, num_samples: int, replacement: bool,
                       generator: Any) -> str | None:
    val = meta(probs)
    if not isinstance(val, torch.Tensor):
        return None
    if val.dim() not in (1, 2):
        return f"multinomial takes a 1-d or 2-d probability tensor, got {val.dim()}-d {list(val.shape)}"
    if not val.dtype.is_floating_point:
        return f"multinomial takes floating-point probabilities, got {val.dtype}"
    n = int(val.shape[-1])
    if n == 0:
        return "multinomial needs at least one category"
    if int(num_samples) <= 0:
        return f"multinomial needs num_samples > 0, got {num_samples}"
    if not replacement and int(num_samples) > n:
        return (f"multinomial without replacement draws at most the {n} categories, "
                f"got num_samples={num_samples}")
    return _describe_generator(generator)


@lowers(aten.multinomial.default, check=_multinomial_check)
def _multinomial(ctx: LoweringContext, probs: Value, num_samples: int, replacement: bool,
                 generator: Any) -> Value:
    f64 = DType.float64
    p = ctx.cast(probs, f64)
    n = int(probs.shape[-1])
    rows = tuple(int(d) for d in probs.shape[:-1])
    k = int(num_samples)
    if replacement:
        cdf = ctx.op("cumsum", p, dim=-1)
        total = ctx.op("slice", cdf, dim=-1, start=n - 1, end=n)
        target = ctx.op("mul", uniform(ctx, (*rows, k), f64), total)
        index = ctx.op("searchsorted", cdf, target, right=True)
        index = ctx.op("minimum", index, ctx.const(n - 1, DType.int64))
        return _result(ctx, index)
    # Exponential races: category i finishes at E_i / p_i (E_i ~ Exp(1)); the first k to
    # finish are a draw of k categories without replacement, each step proportional to p.
    # u' = u + 2**-32 lies in (0, 1) on the float64 grid, so every E_i is finite and > 0.
    u = _affine(ctx, uniform(ctx, (*rows, n), f64), 1.0, 2.0 ** -32)
    race = ctx.op("div", ctx.op("neg", ctx.op("log", u)), p)
    order = ctx.op("argsort", race, dim=-1)
    return _result(ctx, ctx.op("slice", order, dim=-1, start=0, end=k))


# ------------------------------------------------------------------ rrelu
def _rrelu_check(node: torch.fx.Node, x: Any, *args: Any) -> str | None:
    names = [a.name for a in node.target._schema.arguments]
    bound = dict(zip(names, (x, *args)))
    lower, upper = float(bound["lower"]), float(bound["upper"])
    if not lower <= upper:
        return f"rrelu needs lower <= upper, got lower={lower}, upper={upper}"
    return _describe_generator(bound.get("generator")) or _floating_result(node)


def _rrelu_parts(ctx: LoweringContext, x: Value, lower: float, upper: float,
                 training: bool) -> tuple[Value, Value | None]:
    """``(rrelu(x), noise)``; the noise is ``None`` in eval mode (slope ``(lower + upper) / 2``)."""
    lower, upper = float(lower), float(upper)
    work = _work_dtype(x.dtype)
    xw = ctx.cast(x, work)
    zero = _scalar(ctx, 0.0, work)
    if not training:
        scaled = ctx.op("mul", xw, _scalar(ctx, (lower + upper) / 2.0, work))
        return _result(ctx, ctx.op("where", ctx.op("gt", xw, zero), xw, scaled)), None
    slope = _affine(ctx, uniform(ctx, x.shape, work), upper - lower, lower)
    noise = ctx.op("where", ctx.op("le", xw, zero), slope, _scalar(ctx, 1.0, work))
    return _result(ctx, ctx.op("mul", xw, noise)), ctx.cast(noise, x.dtype)


@lowers(aten.rrelu.default, check=_rrelu_check)
def _rrelu(ctx: LoweringContext, x: Value, lower: Any, upper: Any, training: bool, generator: Any) -> Value:
    return _rrelu_parts(ctx, x, lower, upper, training)[0]


@lowers(*optional_ops("rrelu_with_noise_functional.default"), check=_rrelu_check)
def _rrelu_with_noise(ctx: LoweringContext, x: Value, noise: Value, lower: Any, upper: Any,
                      training: bool, generator: Any) -> tuple:
    """``(out, noise_out)``: in eval mode the noise comes back unchanged, as in ATen."""
    out, drawn = _rrelu_parts(ctx, x, lower, upper, training)
    return out, (drawn if drawn is not None else noise)


# ------------------------------------------------------------------ uninitialized
def _zeros(ctx: LoweringContext, *_: Any) -> Value:
    """Zeros of the node's type: an uninitialized tensor's contents are unspecified."""
    out = ctx.out
    value: Any = False if out.dtype == DType.bool else (0 if out.dtype.is_integer else 0.0)
    return ctx.op("full", shape=tuple(out.shape), value=value, dtype=out.dtype)


lowers(aten.empty_strided.default, aten.new_empty_strided.default)(_zeros)
