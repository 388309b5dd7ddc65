"""``kiln.jax`` on real JAX models, against ``jax.jit`` and ``jax.grad`` (float32, 1e-4).

The models are the benchmark's (``benchmarks/jax_bench.py``: an MLP, a transformer block
with causal attention, layer norm and GELU, a small CNN), at small sizes, on the native
``cpu`` backend.  Gradients use the loss ``(out * fixed_random).sum()`` and are checked by
both routes: kiln's autodiff of the captured forward graph (``kiln.jax.grad``) and JAX's
own gradient jaxpr compiled by kiln (``kiln.jax.jit(jax.grad(f))``).  Also here: the
per-signature cache, pytrees in and out, literals, closed-over constants, static arguments,
``has_aux``, the output kinds, zero-copy inputs and outputs, and the errors of ``grad`` (these
on the ``reference`` backend where the lowering is what is tested).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX frontend tests need jax (pip install 'jax>=0.10,<0.13')")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import kiln  # noqa: E402
import kiln.jax  # noqa: E402
from benchmarks.jax_bench import cnn, cnn_setup, mlp, mlp_setup, transformer_block, transformer_setup  # noqa: E402

TOL = 1e-4

MODELS = {
    "mlp": (mlp, lambda rng: mlp_setup(rng, batch=3, sizes=(12, 16, 16, 5))),
    "transformer-block": (transformer_block, lambda rng: transformer_setup(rng, batch=2, seq=8, d=16)),
    "cnn": (cnn, lambda rng: cnn_setup(rng, batch=2, size=9, channels=(3, 4, 6), classes=5)),
}


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def assert_trees_close(got, want, tol=TOL):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    errors = jax.tree_util.tree_map(rel_error, got, want)
    worst = max(jax.tree_util.tree_leaves(errors))
    assert worst <= tol, errors


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    fn, setup = MODELS[request.param]
    rng = np.random.default_rng(0)
    params, x = setup(rng)
    fixed = rng.standard_normal(jax.eval_shape(fn, params, x).shape).astype(np.float32)

    def loss(p, x):
        return (fn(p, x) * fixed).sum()
    return fn, loss, params, x


def test_forward_matches_jax_jit(model):
    fn, _, params, x = model
    got = kiln.jax.jit(fn)(params, x)
    assert isinstance(got, jax.Array)
    assert rel_error(got, jax.jit(fn)(params, x)) <= TOL


def test_gradients_match_jax_grad_by_both_routes(model):
    _, loss, params, x = model
    want = jax.grad(loss, argnums=(0, 1))(params, x)
    by_kiln = kiln.jax.grad(loss, argnums=(0, 1))
    ours = by_kiln(params, x)
    theirs = kiln.jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    assert_trees_close(ours, want)
    assert_trees_close(theirs, want)
    # kiln's route differentiates the captured forward graph: one output in, loss + grads out
    assert len(by_kiln.captured_graph.outputs) == 1
    assert len(by_kiln.graph.outputs) == 1 + len(jax.tree_util.tree_leaves((params, x)))


def test_value_and_grad_matches(model):
    _, loss, params, x = model
    value, grads = kiln.jax.value_and_grad(loss)(params, x)
    want_value, want_grads = jax.value_and_grad(loss)(params, x)
    assert rel_error(value, want_value) <= TOL
    assert_trees_close(grads, want_grads)


# ------------------------------------------------------------------ jit behaviour
def test_compiled_once_per_signature():
    calls = []

    def f(x, y):
        calls.append(1)
        return x * 2 + y

    fast = kiln.jax.jit(f, backend="reference")
    a, b = np.ones((2, 3), np.float32), np.ones(3, np.float32)
    for _ in range(3):
        np.testing.assert_allclose(fast(a, b), a * 2 + b)
    assert fast.cache_size == 1 and len(calls) == 1
    fast(np.ones((4, 3), np.float32), b)                         # new shape
    fast(a.astype(np.int32), b.astype(np.int32))                # new dtypes
    fast(a, 1.5)                                                # a python scalar (weakly typed)
    fast(a, 2.5)                                                # same signature, new value
    assert fast.cache_size == 4 and len(calls) == 4
    np.testing.assert_allclose(fast(a, 2.5), a * 2 + 2.5)


def test_pytrees_in_and_out_match_jax_jit():
    def f(tree, scale):
        h = tree["x"] @ tree["layers"][0]["w"] + tree["layers"][0]["b"]
        return {"out": jnp.tanh(h) * scale, "parts": (h.sum(0), None, [h.max()])}

    rng = np.random.default_rng(1)
    tree = {"x": rng.standard_normal((5, 4)).astype(np.float32),
            "layers": [{"w": rng.standard_normal((4, 3)).astype(np.float32),
                        "b": rng.standard_normal(3).astype(np.float32)}]}
    got = kiln.jax.jit(f, backend="reference")(tree, np.float32(0.5))
    want = jax.jit(f)(tree, np.float32(0.5))
    assert_trees_close(got, want, 1e-5)


def test_literals_constants_and_nested_jit():
    table = np.random.default_rng(2).standard_normal((6, 4)).astype(np.float32)
    inner = jax.jit(lambda y: jnp.exp(-y) + jnp.asarray(table)[:, :1].T)

    def f(x):
        return inner(x * 3.0 + 1) @ jnp.asarray(table) + jnp.float32(2.5)

    closed = jax.make_jaxpr(f)(np.ones((2, 6), np.float32))
    assert len(closed.consts) >= 1 and "jit" in {e.primitive.name for e in closed.jaxpr.eqns}
    x = np.random.default_rng(3).standard_normal((2, 6)).astype(np.float32)
    assert rel_error(kiln.jax.jit(f, backend="reference")(x), jax.jit(f)(x)) <= 1e-5


def test_static_argnums_and_argnames():
    def f(x, n, *, mode):
        for _ in range(n):
            x = jnp.sin(x) if mode == "sin" else jnp.cos(x)
        return x

    fast = kiln.jax.jit(f, static_argnums=1, static_argnames="mode", backend="reference")
    x = np.linspace(-1, 1, 7, dtype=np.float32)
    assert rel_error(fast(x, 3, mode="sin"), jax.jit(f, static_argnums=1, static_argnames="mode")(x, 3, mode="sin")) <= 1e-5
    fast(x, 2, mode="sin")
    fast(x, 2, mode="cos")
    assert fast.cache_size == 3


def test_decorator_forms_and_argument_errors():
    import functools

    @kiln.jax.jit
    def double(x):
        return x * 2

    @functools.partial(kiln.jax.jit, static_argnums=1, backend="reference")
    def power(x, n):
        return x ** n

    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(double(x), x * 2)
    np.testing.assert_array_equal(power(x, 3), x ** 3)
    with pytest.raises(TypeError, match=r"leaf of type str is not an array.*static_argnums"):
        double("text")
    with pytest.raises(TypeError, match=r"static arguments must be hashable"):
        power(x, np.ones(2))


def test_numpy_outputs_and_zero_copy_inputs_and_outputs():
    import torch

    from kiln.frontends.jax.arrays import from_torch, to_torch

    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    out = kiln.jax.jit(lambda a: a.sum(0), outputs="numpy")(x)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, np.asarray(x).sum(0))
    assert to_torch(x, None).data_ptr() == x.unsafe_buffer_pointer()
    for dtype in (torch.float32, torch.bool, torch.bfloat16):
        t = torch.ones(4, 3, dtype=dtype)
        assert from_torch(t, "jax").unsafe_buffer_pointer() == t.data_ptr()


def test_control_flow_model_matches():
    """An embedding lookup feeding a recurrent cell unrolled by scan, a cond on a traced
    value, fori_loop; gradients by both routes (JAX's has scatter-add and transposed scans).
    On the reference backend: what is tested is the lowering (the primitives' cpu cases
    cover the native backend)."""
    rng = np.random.default_rng(4)
    params = {"w": rng.standard_normal((4, 4)).astype(np.float32) * 0.5,
              "emb": rng.standard_normal((10, 4)).astype(np.float32)}
    tokens = rng.integers(0, 10, 6).astype(np.int32)

    def rnn(params, tokens, flag):
        def step(h, x):
            h = jnp.tanh(h @ params["w"] + x)
            return h, h.sum()
        h, sums = lax.scan(step, jnp.zeros(4), params["emb"][tokens])
        h = lax.cond(flag > 0, lambda v: v * 2.0, lambda v: -v, h)
        return lax.fori_loop(0, 3, lambda i, v: v + i * 0.1, h).sum() + (sums * jnp.arange(6.0)).sum()

    for flag in (np.float32(1.0), np.float32(-1.0)):
        assert rel_error(kiln.jax.jit(rnn, backend="reference")(params, tokens, flag), jax.jit(rnn)(params, tokens, flag)) <= 1e-5
        want = jax.grad(rnn)(params, tokens, flag)
        assert_trees_close(kiln.jax.grad(rnn, backend="reference")(params, tokens, flag), want)
        assert_trees_close(kiln.jax.jit(jax.grad(rnn), backend="reference")(params, tokens, flag), want)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_outputs_that_are_inputs_constants_duplicates_or_empty(backend):
    def f(x):
        return {"same": x, "twice": (x * 2, x * 2), "const": jnp.ones(3), "empty": x[:, :0] * 2,
                "flags": (x > 1, jnp.argmax(x, 0)), "none": None}

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got, want = kiln.jax.jit(f, backend=backend)(x), jax.jit(f)(x)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unused_inputs_and_a_gradient_that_is_zero():
    x, y = np.ones(3, np.float32), np.ones(2, np.float32)
    np.testing.assert_array_equal(kiln.jax.jit(lambda x, y, n: x + 1, backend="reference")(x, y, 3), x + 1)
    g = kiln.jax.grad(lambda x, y: (x * 2).sum(), argnums=1, backend="reference")(x, y)
    np.testing.assert_array_equal(g, np.zeros(2, np.float32))


def test_has_aux_and_single_argnum():
    def loss(w, x):
        y = jnp.tanh(x @ w)
        return (y ** 2).mean(), {"y": y}

    rng = np.random.default_rng(5)
    w, x = rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    (value, aux), g = kiln.jax.value_and_grad(loss, has_aux=True)(w, x)
    (want_value, want_aux), want_g = jax.value_and_grad(loss, has_aux=True)(w, x)
    assert rel_error(value, want_value) <= TOL and rel_error(g, want_g) <= TOL
    assert rel_error(aux["y"], want_aux["y"]) <= 1e-5
    g2, aux2 = kiln.jax.grad(loss, argnums=1, has_aux=True)(w, x)
    assert rel_error(g2, jax.grad(loss, argnums=1, has_aux=True)(w, x)[0]) <= TOL


def test_custom_vjp_is_differentiated_through_its_primal():
    @jax.custom_vjp
    def clip_gradient(x):
        return jnp.sin(x)
    clip_gradient.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.clip(g * jnp.cos(x), -0.1, 0.1),))

    x = np.linspace(-2, 2, 9, dtype=np.float32)
    ours = kiln.jax.grad(lambda v: (clip_gradient(v) * 3).sum())(x)
    np.testing.assert_allclose(ours, 3 * np.cos(x), rtol=1e-5, atol=1e-6)  # the primal's gradient


def test_grad_errors_name_the_problem():
    with pytest.raises(kiln.KilnError, match=r"scalar float loss .*got float32\[3\]"):
        kiln.jax.grad(lambda x: x * 2)(np.ones(3, np.float32))
    with pytest.raises(kiln.KilnError, match=r"cannot differentiate with respect to an input of type i32\[3\]"):
        kiln.jax.grad(lambda x, y: (x * 2).sum() + y, argnums=0)(np.ones(3, np.int32), np.float32(1))
    with pytest.raises(kiln.KilnError, match=r"argnums 2 is out of range"):
        kiln.jax.grad(lambda x: x.sum(), argnums=2)(np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"outputs='torch'"):
        kiln.jax.jit(lambda x: x, outputs="torch")
