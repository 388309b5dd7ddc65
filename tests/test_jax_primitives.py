"""Every JAX primitive kiln maps, against ``jax.jit``, on random inputs (float32 within 1e-5).

Each case is a small function built to produce its primitive; the test first checks that
the primitive really is in the function's jaxpr (so a case cannot silently test something
else), then compares ``kiln.jax.jit`` with ``jax.jit``.  Broadcasting (rank-0 literals,
``[m, 1]`` against ``[1, n]``) and odd sizes are among the cases.  The table runs on the
``reference`` backend (fast: the frontend's mapping is what is tested); a subset runs on the
native ``cpu`` backend, all of it under ``-m slow``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX frontend tests need jax (pip install 'jax>=0.10,<0.13')")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import kiln.jax  # noqa: E402
from kiln.frontends.jax import PRIMITIVE_TABLE, UnsupportedPrimitiveError  # noqa: E402

RNG_SEED = 0


def f32(*shape, low=None, high=None):
    def make(rng):
        if low is not None:
            return rng.uniform(low, high, shape).astype(np.float32)
        return rng.standard_normal(shape).astype(np.float32)
    return make


def i32(*shape, low=-5, high=6):
    return lambda rng: rng.integers(low, high, shape).astype(np.int32)


def boolean(*shape):
    return lambda rng: rng.random(shape) < 0.5


POS = dict(low=0.2, high=3.0)
UNIT = dict(low=-0.9, high=0.9)

# (id, primitive that must appear in the jaxpr, function, input makers)
CASES = [
    # ---------------------------------------------------------------- unary
    *[(name, name.split("-")[0], fn, [f32(3, 7)]) for name, fn in [
        ("neg", lambda x: -x), ("abs", jnp.abs), ("sign", jnp.sign), ("floor", jnp.floor),
        ("ceil", jnp.ceil), ("exp", jnp.exp), ("exp2", jnp.exp2), ("expm1", jnp.expm1),
        ("tanh", jnp.tanh), ("sin", jnp.sin), ("cos", jnp.cos), ("tan", jnp.tan), ("atan", jnp.arctan),
        ("sinh", jnp.sinh), ("cosh", jnp.cosh), ("asinh", jnp.arcsinh), ("logistic", jax.nn.sigmoid),
        ("erf", lax.erf), ("erfc", lax.erfc), ("erfc-negated", lambda x: lax.erfc(-x * 0.7)),
        ("square", jnp.square),
        ("stop_gradient", lax.stop_gradient), ("copy", jnp.copy)]],
    *[(name, name, fn, [f32(5, 3, **POS)]) for name, fn in [
        ("log", jnp.log), ("log1p", jnp.log1p), ("sqrt", jnp.sqrt), ("rsqrt", lax.rsqrt),
        ("lgamma", lax.lgamma)]],
    *[(name, name, fn, [f32(13, **UNIT)]) for name, fn in [
        ("asin", jnp.arcsin), ("acos", jnp.arccos), ("atanh", jnp.arctanh), ("erf_inv", lax.erf_inv)]],
    ("acosh", "acosh", jnp.arccosh, [f32(4, 5, low=1.1, high=4.0)]),
    ("round-even", "round", jnp.round, [lambda rng: (rng.integers(-8, 8, (4, 6)) / 2).astype(np.float32)]),
    ("round-away", "round", lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
     [lambda rng: (rng.integers(-8, 8, (4, 6)) / 2).astype(np.float32)]),
    ("is_finite", "is_finite", jnp.isfinite,
     [lambda rng: np.array([1.0, np.inf, -np.inf, np.nan, -2.0], np.float32)]),
    ("not", "not", jnp.logical_not, [boolean(3, 4)]),
    # ---------------------------------------------------------------- binary
    *[(name, name, fn, [f32(3, 7), f32(3, 7)]) for name, fn in [
        ("add", jnp.add), ("sub", jnp.subtract), ("mul", jnp.multiply), ("div", jnp.divide),
        ("max", jnp.maximum), ("min", jnp.minimum), ("atan2", jnp.arctan2), ("nextafter", jnp.nextafter),
        ("eq", lambda a, b: jnp.round(a) == jnp.round(b)), ("ne", lambda a, b: jnp.round(a) != jnp.round(b)),
        ("lt", jnp.less), ("le", jnp.less_equal), ("gt", jnp.greater), ("ge", jnp.greater_equal),
        ("rem", lax.rem)]],
    ("add-broadcast", "add", lambda a, b: a + b, [f32(5, 1), f32(1, 7)]),
    ("mul-literal", "mul", lambda a: a * 3.5, [f32(2, 3, 5)]),
    ("sub-scalar-first", "sub", lambda a: 1.0 - a, [f32(9)]),
    ("pow", "pow", jnp.power, [f32(3, 5, **POS), f32(3, 5)]),
    ("div-int", "div", lambda a, b: lax.div(a, b), [i32(4, 5), i32(4, 5, low=1, high=4)]),
    ("rem-int", "rem", lambda a, b: lax.rem(a, b), [i32(4, 5), i32(4, 5, low=1, high=4)]),
    ("and", "and", jnp.logical_and, [boolean(6), boolean(6)]),
    ("or", "or", jnp.logical_or, [boolean(6), boolean(6)]),
    ("xor", "xor", jnp.logical_xor, [boolean(6), boolean(6)]),
    *[(f"integer_pow-{y}", "integer_pow", (lambda y: lambda x: lax.integer_pow(x, y))(y), [f32(4, 3, **POS)])
      for y in (2, 3, 5, -2, 0)],
    ("select_n-bool", "select_n", jnp.where, [boolean(3, 4), f32(3, 4), f32(3, 4)]),
    ("select_n-broadcast", "select_n", lambda c, a: jnp.where(c, a, -1.0), [boolean(5, 1), f32(5, 6)]),
    ("select_n-int", "select_n", lambda i, a, b, c: lax.select_n(i, a, b, c),
     [i32(4, 5, low=0, high=3), f32(4, 5), f32(4, 5), f32(4, 5)]),
    ("clamp", "clamp", lambda x: lax.clamp(-0.5, x, 0.7), [f32(3, 7)]),
    ("clip", "min", lambda x: jnp.clip(x, -0.3, 0.4), [f32(11)]),
    ("convert-f2i", "convert_element_type", lambda x: (x * 3).astype(jnp.int32), [f32(3, 7)]),
    ("convert-f2bool", "convert_element_type", lambda x: jnp.round(x).astype(bool), [f32(3, 7)]),
    ("convert-i2f", "convert_element_type", lambda x: x.astype(jnp.float32) / 3, [i32(3, 7)]),
    ("convert-bf16", "convert_element_type", lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), [f32(6)]),
    # ---------------------------------------------------------------- contractions
    ("matmul", "dot_general", jnp.matmul, [f32(5, 7), f32(7, 3)]),
    ("matvec", "dot_general", jnp.matmul, [f32(5, 7), f32(7)]),
    ("vecmat", "dot_general", jnp.matmul, [f32(7), f32(7, 3)]),
    ("dot-batched", "dot_general", lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a, b), [f32(2, 3, 5, 4), f32(2, 3, 7, 4)]),
    ("dot-multi-contract", "dot_general", lambda a, b: jnp.einsum("ijk,jkl->il", a, b), [f32(3, 4, 5), f32(4, 5, 2)]),
    ("dot-batch-middle", "dot_general", lambda a, b: jnp.einsum("ibj,bjk->bik", a, b), [f32(3, 2, 5), f32(2, 5, 4)]),
    ("dot-outer", "dot_general", lambda a, b: lax.dot_general(a, b, (((), ()), ((), ()))), [f32(5), f32(3)]),
    ("dot-preferred", "dot_general",
     lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32),
     [lambda rng: rng.standard_normal((3, 4)).astype(jnp.bfloat16), lambda rng: rng.standard_normal((4, 2)).astype(jnp.bfloat16)]),
    ("conv-nchw-same", "conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"), [f32(2, 3, 9, 7), f32(4, 3, 3, 3)]),
    ("conv-nhwc-strided-dilated", "conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "VALID", rhs_dilation=(2, 1),
                                           dimension_numbers=("NHWC", "HWIO", "NHWC")),
     [f32(2, 11, 9, 3), f32(3, 2, 3, 5)]),
    ("conv-grouped-asymmetric", "conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (1, 2), ((0, 1), (2, 1)), feature_group_count=2),
     [f32(1, 4, 6, 7), f32(6, 2, 2, 3)]),
    ("conv-same-even-kernel", "conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"), [f32(1, 2, 6, 5), f32(3, 2, 2, 4)]),
    ("conv-1d", "conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (1,), ((1, 1),)), [f32(2, 3, 13), f32(5, 3, 3)]),
    ("conv-transpose", "conv_general_dilated",
     lambda x, w: lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")),
     [f32(1, 3, 5, 4), f32(2, 3, 3, 3)]),
    # ---------------------------------------------------------------- layout
    ("broadcast_in_dim", "broadcast_in_dim", lambda x: jnp.broadcast_to(x, (4, 3, 5)), [f32(3, 1)]),
    ("expand_dims", "broadcast_in_dim", lambda x: jnp.expand_dims(x, (0, 2)), [f32(3, 5)]),
    ("reshape", "reshape", lambda x: x.reshape(5, 3, 2), [f32(6, 5)]),
    ("transpose", "transpose", lambda x: x.transpose(2, 0, 1), [f32(2, 3, 5)]),
    ("squeeze", "squeeze", lambda x: jnp.squeeze(x, (0, 2)), [f32(1, 3, 1, 5)]),
    ("concatenate", "concatenate", lambda a, b: jnp.concatenate([a, b, a], axis=1), [f32(3, 2), f32(3, 5)]),
    ("split", "split", lambda x: jnp.split(x, [2, 5], axis=1)[1] * 2, [f32(3, 7)]),
    ("slice", "slice", lambda x: x[1:4, ::2], [f32(5, 7)]),
    ("slice-strided", "slice", lambda x: lax.slice(x, (0, 1), (5, 7), (2, 3)), [f32(5, 7)]),
    ("rev", "rev", lambda x: jnp.flip(x, 1), [f32(3, 5)]),
    ("dynamic_slice-const", "dynamic_slice", lambda x: lax.dynamic_slice(x, (1, 2), (2, 3)), [f32(4, 7)]),
    ("dynamic_slice-clamped", "dynamic_slice", lambda x: lax.dynamic_slice(x, (3, 6), (2, 3)), [f32(4, 7)]),
    ("dynamic_slice-traced", "dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 3)),
     [f32(5, 6), lambda rng: np.int32(2)]),
    ("dynamic_slice-traced-clamped", "dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 3)),
     [f32(5, 6), lambda rng: np.int32(9)]),
    ("gather-rows", "gather", lambda x, i: x[i], [f32(7, 3), i32(5, low=-7, high=7)]),
    ("gather-take-axis1", "gather", lambda x, i: jnp.take(x, i, axis=1), [f32(4, 6), i32(3, 2, low=0, high=6)]),
    ("gather-take-fill", "gather", lambda x, i: jnp.take(x, i, axis=0, mode="fill", fill_value=-1.0),
     [f32(5, 3), lambda rng: np.array([0, 4, 5, 9, 2], np.int32)]),
    ("gather-take_along_axis", "gather", lambda x, i: jnp.take_along_axis(x, i, axis=1),
     [f32(4, 6), i32(4, 3, low=0, high=6)]),
    ("gather-two-axes", "gather", lambda x, i, j: x[i, :, j], [f32(5, 3, 4), i32(2, 3, low=0, high=5), i32(2, 3, low=0, high=4)]),
    ("scatter-add-duplicates", "scatter-add", lambda x, i, u: x.at[i].add(u),
     [f32(6, 3), lambda rng: np.array([1, 4, 1, 0, 4], np.int32), f32(5, 3)]),
    ("scatter-add-dropped", "scatter-add", lambda x, i, u: x.at[i].add(u, mode="drop"),
     [f32(6, 3), lambda rng: np.array([1, 7, -9, 5], np.int32), f32(4, 3)]),
    ("scatter-add-clip", "scatter-add", lambda x, i, u: x.at[i].add(u, mode="clip"),
     [f32(6, 3), lambda rng: np.array([1, 7, 2], np.int32), f32(3, 3)]),
    ("scatter-add-along-axis", "scatter-add",
     jax.grad(lambda x, i: (jnp.take_along_axis(x, i, axis=1) ** 2).sum()),
     [f32(4, 6), i32(4, 3, low=0, high=6)]),
    ("scatter-set", "scatter", lambda x, i, u: x.at[:, i].set(u), [f32(3, 7), lambda rng: np.array([6, 0, 2], np.int32), f32(3, 3)]),
    ("dynamic_update_slice-const", "dynamic_update_slice",
     lambda x, u: lax.dynamic_update_slice(x, u, (1, 5)), [f32(4, 7), f32(2, 3)]),
    ("dynamic_update_slice-traced", "dynamic_update_slice",
     lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 2)), [f32(5, 6), f32(2, 3), lambda rng: np.int32(4)]),
    ("iota", "iota", lambda x: x + jnp.arange(7, dtype=jnp.float32), [f32(3, 7)]),
    ("iota-2d", "iota", lambda x: x * lax.broadcasted_iota(jnp.float32, (4, 5), 0), [f32(4, 5)]),
    ("pad", "pad", lambda x: jnp.pad(x, ((1, 2), (0, 3)), constant_values=1.5), [f32(3, 4)]),
    ("pad-traced-value", "pad", lambda x, v: lax.pad(x, v, ((1, 0, 1), (2, 1, 0))), [f32(3, 4), f32()]),
    ("dynamic_slice-grad", "dynamic_update_slice",
     jax.grad(lambda x, i: (lax.dynamic_slice(x, (i, 0), (2, 3)) ** 2).sum()), [f32(5, 3), lambda rng: np.int32(1)]),
    ("pad-negative-interior", "pad", lambda x: lax.pad(x, 0.0, ((-1, 2, 1), (2, -1, 2))), [f32(4, 5)]),
    # ---------------------------------------------------------------- reductions and scans
    ("reduce_sum", "reduce_sum", lambda x: x.sum(axis=(0, 2)), [f32(3, 5, 7)]),
    ("reduce_sum-all", "reduce_sum", jnp.sum, [f32(13)]),
    ("reduce_max", "reduce_max", lambda x: x.max(axis=1), [f32(3, 5, 7)]),
    ("reduce_min", "reduce_min", lambda x: x.min(axis=-1), [f32(3, 5, 7)]),
    ("reduce_prod", "reduce_prod", lambda x: x.prod(axis=0), [f32(3, 5, **POS)]),
    ("reduce_and", "reduce_and", lambda x: jnp.all(x, axis=1), [boolean(3, 4)]),
    ("reduce_or", "reduce_or", lambda x: jnp.any(x, axis=0), [boolean(3, 4)]),
    ("argmax", "argmax", lambda x: jnp.argmax(x, axis=1), [f32(5, 7)]),
    ("argmin", "argmin", lambda x: jnp.argmin(x, axis=0), [f32(5, 7)]),
    ("argmax-ties", "argmax", lambda x: jnp.argmax(jnp.round(x), axis=1), [f32(4, 9)]),
    ("cumsum", "cumsum", lambda x: jnp.cumsum(x, axis=1), [f32(3, 7)]),
    ("cumsum-reverse", "cumsum", lambda x: lax.cumsum(x, axis=0, reverse=True), [f32(5, 3)]),
    ("cumprod", "cumprod", lambda x: jnp.cumprod(x, axis=0), [f32(5, 3, **POS)]),
    ("cummax", "cummax", lambda x: lax.cummax(x, axis=1), [f32(3, 7)]),
    ("cummin-reverse", "cummin", lambda x: lax.cummin(x, axis=1, reverse=True), [f32(3, 7)]),
    # ---------------------------------------------------------------- calls and control flow
    ("jit", "jit", lambda x: jax.jit(lambda y: jnp.sin(y) * 2)(x) + 1, [f32(3, 4)]),
    ("custom_jvp_call", "custom_jvp_call", jax.nn.relu, [f32(3, 7)]),
    ("custom_jvp_call-gelu", "custom_jvp_call", lambda x: jax.nn.softplus(x) + jax.nn.silu(x), [f32(9)]),
    ("remat2", "remat2", jax.checkpoint(lambda x: jnp.tanh(x) * x), [f32(3, 5)]),
    ("cond-traced", "cond", lambda p, x: lax.cond(p > 0, lambda a: a + 1.0, lambda a: a * 2.0, x),
     [f32(), f32(3, 4)]),
    ("cond-const", "cond", lambda x: lax.cond(True, lambda a: jnp.sin(a), lambda a: a, x), [f32(3, 4)]),
    ("switch", "cond", lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, jnp.exp], x), [lambda rng: np.int32(2), f32(5)]),
    ("scan", "scan", lambda c, xs: lax.scan(lambda c, x: (c * 0.5 + x, (c * x).sum()), c, xs),
     [f32(4), f32(5, 4)]),
    ("scan-reverse", "scan", lambda xs: lax.scan(lambda c, x: (c + x, c), jnp.zeros(3), xs, reverse=True),
     [f32(6, 3)]),
    ("fori_loop", "scan", lambda x: lax.fori_loop(0, 4, lambda i, v: v * 0.9 + jnp.sin(v) * i, x), [f32(3, 5)]),
    ("scan-dynamic-slice", "scan",
     lambda x: lax.fori_loop(0, 3, lambda i, acc: acc + lax.dynamic_slice(x, (i, 0), (2, 4)), jnp.zeros((2, 4))),
     [f32(5, 4)]),
]


def _custom_vjp_case():
    @jax.custom_vjp
    def scaled(x):
        return jnp.sin(x) * 3.0
    scaled.defvjp(lambda x: (scaled(x), x), lambda x, g: (g * jnp.cos(x) * 3.0,))
    return scaled


CASES.append(("custom_vjp_call", "custom_vjp_call", _custom_vjp_case(), [f32(4, 3)]))

NOT_IN_CASES = {
    "while": "refused on purpose; test_while_is_refused",
    "closed_call": "made by jax internals only (no public API produces it in a jaxpr)",
    "sharding_constraint": "needs a device mesh; the identity on one device",
    "add_any": "made by JAX's own AD: test_jax_models.py compiles jax.grad jaxprs",
}

CPU_SUBSET = {"add-broadcast", "matmul", "dot-batched", "conv-nhwc-strided-dilated", "gather-rows",
              "scatter-add-dropped", "dynamic_update_slice-traced",
              "reduce_sum", "cumsum-reverse", "scan", "select_n-int", "pad-negative-interior"}


def primitives_in(jaxpr) -> set[str]:
    """Names of every primitive in ``jaxpr`` and its sub-jaxprs."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= primitives_in(sub)
    return names


def assert_close(got, want, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if not np.issubdtype(want.dtype, np.floating) and want.dtype != jnp.bfloat16:
        np.testing.assert_array_equal(got, want)
        return
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    scale = max(np.abs(want[finite]).max(initial=0.0), 1e-6)
    err = np.abs(got[finite] - want[finite]).max(initial=0.0) / scale
    assert err <= tol, f"max relative error {err:.2e} > {tol:.0e}"


def run_case(fn, makers, backend):
    rng = np.random.default_rng(RNG_SEED)
    args = [m(rng) for m in makers]
    want = jax.jit(fn)(*args)
    got = kiln.jax.jit(fn, backend=backend)(*args)
    jax.tree_util.tree_map(assert_close, got, want)


@pytest.mark.parametrize("case_id,primitive,fn,makers", CASES, ids=[c[0] for c in CASES])
def test_primitive_matches_jax(case_id, primitive, fn, makers):
    args = [m(np.random.default_rng(RNG_SEED)) for m in makers]
    assert primitive in primitives_in(jax.make_jaxpr(fn)(*args).jaxpr), f"{case_id} does not make {primitive}"
    run_case(fn, makers, "reference")


@pytest.mark.parametrize("case_id,primitive,fn,makers",
                         [pytest.param(*c, marks=() if c[0] in CPU_SUBSET else pytest.mark.slow) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_primitive_matches_jax_on_cpu_backend(case_id, primitive, fn, makers):
    run_case(fn, makers, "cpu")


def test_every_mapped_primitive_has_a_case():
    covered = {c[1] for c in CASES}
    missing = set(PRIMITIVE_TABLE) - covered - set(NOT_IN_CASES)
    assert not missing, f"primitives without a test case: {sorted(missing)}"
    assert not (covered & set(NOT_IN_CASES))


# ------------------------------------------------------------------------------ errors
def test_unsupported_primitive_names_itself_its_shapes_and_the_line():
    def f(x):
        return jnp.sort(x) + 1  # the sort line

    with pytest.raises(UnsupportedPrimitiveError) as info:
        kiln.jax.jit(f, backend="reference")(np.ones((3, 5), np.float32))
    text = str(info.value)
    assert re.search(r"JAX primitive sort\(f32\[3, 5\]", text), text
    assert re.search(r"test_jax_primitives\.py:\d+ in \S*<locals>\.f: return jnp\.sort\(x\) \+ 1", text), text
    assert "docs/jax.md" in text
    assert info.value.op == "sort" and isinstance(info.value, kiln.UnsupportedOpError)


def test_unsupported_primitive_inside_nested_jit_points_at_the_inner_line():
    inner = jax.jit(lambda y: lax.cumlogsumexp(y, axis=0))

    def f(x):
        return inner(x) * 2

    with pytest.raises(UnsupportedPrimitiveError, match=r"cumlogsumexp\(f32\[4\], axis=0.*\n  at test_jax_primitives\.py:\d+ in test_\w+\.<locals>\.<lambda>: inner = "):
        kiln.jax.jit(f, backend="reference")(np.ones(4, np.float32))


def test_while_is_refused():
    def f(x):
        return lax.while_loop(lambda v: v.sum() < 10.0, lambda v: v * 2.0, x)

    with pytest.raises(UnsupportedPrimitiveError, match=r"JAX primitive while\(f32\[3\].*trip count that depends on values"):
        kiln.jax.jit(f, backend="reference")(np.ones(3, np.float32))


def test_dtype_kiln_lacks_is_refused_with_the_input():
    with pytest.raises(UnsupportedPrimitiveError, match=r"input 0 \(uint32\[3\]\).*no kiln equivalent"):
        kiln.jax.jit(lambda x: x + 1, backend="reference")(np.ones(3, np.uint32))


def test_gather_of_wide_slices_is_refused():
    def f(x):
        return lax.gather(x, jnp.array([[1], [2]]), lax.GatherDimensionNumbers((1, 2), (), (0,)), (2, 3))

    with pytest.raises(UnsupportedPrimitiveError, match=r"gather windows of size 2 along indexed axis 0"):
        kiln.jax.jit(f, backend="reference")(np.ones((5, 3), np.float32))


def test_version_and_primitive_name_guards(monkeypatch):
    from kiln.frontends.jax import rules

    rules.check_primitive_names()  # the installed JAX has every primitive the table names
    monkeypatch.setitem(rules.PRIMITIVE_TABLE, "pjit", rules.PRIMITIVE_TABLE["jit"])
    with pytest.raises(rules.JaxVersionError, match=r"has no primitive\(s\) pjit"):
        rules.check_primitive_names()
    monkeypatch.setattr(rules, "jax_version", lambda: (0, 6, 1))
    with pytest.raises(rules.JaxVersionError, match=r"supports jax >= 0\.10\.0, < 0\.13\.0"):
        rules.check_jax_version()
