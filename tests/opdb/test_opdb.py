"""PyTorch's OpInfo database through kiln (:mod:`kiln.zoo.opdb`).

The fast subset runs a fixed list of representative ops of every family on both backends
(forward on ``reference`` and ``cpu``, gradients through ``torch.compile(backend="kiln")`` on
``reference``) and asserts: no wrong answer, no foreign exception, and each op's expected
status.  An op expected ``supported`` must stay supported; one expected ``refused`` may become
supported as kiln learns it, but must never be wrong or foreign.  The full sweep is
``@pytest.mark.slow``.
"""

from __future__ import annotations

import os

import pytest
import torch

import kiln
from kiln.frontends.torch.aten import ATEN_TABLE, AtenRule, aten
from kiln.zoo import opdb

S, R = "supported", "refused"

# op key -> expected status.  Families: unary and binary math, special functions, float
# manipulation, comparisons and logic, selection, reductions, scans, softmax, linear algebra,
# casts, creation, layout, indexing, nn activations/norms/conv/pool, data-dependent ops.
SUBSET = {
    # elementwise unary
    "abs": S, "exp": S, "log1p": S, "sqrt": S, "sigmoid": S, "tanh": S, "sin": S, "erf": S,
    "asin": S, "acosh": S, "asinh": S, "atanh": S, "sinh": S, "log10": S, "exp2": S,
    "lgamma": S, "digamma": S, "erfinv": S, "special.i1e": S, "floor": S, "round": S, "sign": S,
    "signbit": S, "nan_to_num": S, "special.erfcx": S, "special.bessel_j0": S,
    "special.chebyshev_polynomial_t": S, "special.zeta": S, "frexp": S, "angle": S, "igamma": S,
    # binary
    "add": S, "sub": S, "mul": S, "div.floor_rounding": S, "pow": S, "fmod": S, "remainder": S,
    "copysign": S, "fmax": S, "atan2": S, "hypot": S, "xlogy": S, "logaddexp": S, "ldexp": S,
    "nextafter": S, "lerp": S, "addcmul": S,
    # comparisons, logic, selection
    "eq": S, "lt": S, "isnan": S, "logical_and": S, "where": S, "clamp": S, "maximum": S,
    # reductions and scans
    "sum": S, "mean": S, "prod": S, "amax": S, "var": S, "std_mean": S, "logsumexp": S,
    "argmax": S, "cumsum": S, "linalg.vector_norm": S, "dist": S, "nansum": S, "any": S,
    "softmax": S, "log_softmax": S,
    # linear algebra
    "matmul": S, "mm": S, "bmm": S, "addmm": S, "addmv": S, "addbmm": S, "linalg.inv": S,
    "linalg.det": S, "linalg.solve": S, "linalg.slogdet": S, "cdist": S,
    "linalg.cholesky": S, "cholesky_solve": S, "linalg.solve_triangular": S, "linalg.svd": S,
    "linalg.eigh": S, "linalg.qr": S, "linalg.lu_factor": S, "linalg.lu": S, "lu_unpack": S, "linalg.lu_solve": S, "matrix_exp": S,
    "linalg.pinv": S, "linalg.householder_product": S, "linalg.tensorinv": S, "norm.nuc": S,
    "linalg.ldl_factor": S, "linalg.eig": R,
    # casts, creation, layout, indexing
    "float": S, "long": S, "zeros_like": S, "full_like": S, "arange": S, "reshape": S,
    "permute": S, "cat": S, "flip": S, "tril": S, "gather": S, "index_select": R,
    # nn
    "nn.functional.relu": S, "nn.functional.gelu": S, "nn.functional.elu": S,
    "nn.functional.selu": S, "nn.functional.silu": S, "nn.functional.layer_norm": S,
    "nn.functional.linear": S, "nn.functional.conv2d": S, "nn.functional.avg_pool2d": S,
    "nn.functional.normalize": S,
    # random (kiln/frontends/torch/aten_random.py): shapes and dtypes against eager
    "randn": S, "randint": S, "bernoulli": S, "multinomial": S, "nn.functional.dropout2d": S,
    "nn.functional.rrelu": S, "empty_strided": S,
    # refused: data-dependent results, complex results, ops kiln does not have yet
    "equal": R, "allclose": R, "nn.functional.ctc_loss": R, "cfloat": R, "sort": R,
    # statistics, segments, index writes, sampling (kiln/frontends/torch/aten_statistics.py, aten_sampling.py)
    "histc": S, "mode": S, "nanmedian": S, "masked.median": S, "logcumsumexp": S,
    "index_reduce.amax": S, "put": S, "diagonal_scatter": S, "searchsorted": S, "mT": S,
    "nn.functional.pdist": S, "grid_sampler_2d": S, "_upsample_bilinear2d_aa": S,
    "nn.functional.embedding_bag": S, "_segment_reduce.lengths": R, "take": S, "nonzero_static": S,
    "histogramdd": S,
}
# Ops kiln lowers with rules of kiln/frontends/torch/aten_special.py and ops of kiln/ir/ops/special.py
# and linalg.py: forward on both backends, gradients (where torch has them) on reference.
NEW_OPS = {"asin", "acosh", "asinh", "atanh", "sinh", "log10", "exp2", "lgamma", "digamma", "erfinv",
           "special.i1e", "signbit", "fmod", "remainder", "copysign", "fmax", "hypot", "ldexp",
           "nextafter", "linalg.vector_norm", "dist", "addmv", "addbmm", "nn.functional.elu",
           "nn.functional.selu", "nn.functional.normalize", "special.erfcx", "special.bessel_j0",
           "special.chebyshev_polynomial_t", "special.zeta", "frexp", "angle", "linalg.inv",
           "linalg.det", "linalg.solve", "linalg.slogdet", "cdist", "igamma"}
# factorizations and solvers (kiln/frontends/torch/aten_linalg.py)
NEW_OPS |= {"linalg.cholesky", "cholesky_solve", "linalg.solve_triangular", "linalg.svd", "linalg.eigh",
            "linalg.qr", "linalg.lu_factor", "linalg.lu_solve", "matrix_exp", "linalg.pinv",
            "linalg.householder_product", "linalg.tensorinv", "norm.nuc", "linalg.ldl_factor"}
GRADIENT_OPS = NEW_OPS | {"var", "logsumexp", "logaddexp", "mul", "softmax", "matmul"}


@pytest.fixture(scope="module", autouse=True)
def no_capture_cache():
    """The sweep compiles each sample once: the capture cache would only write entries.
    Restored afterwards, so other test files keep their cache."""
    before = os.environ.get("KILN_CAPTURE_CACHE")
    os.environ["KILN_CAPTURE_CACHE"] = "0"
    yield
    if before is None:
        os.environ.pop("KILN_CAPTURE_CACHE", None)
    else:
        os.environ["KILN_CAPTURE_CACHE"] = before


@pytest.fixture(scope="module")
def infos():
    wanted = set(SUBSET)
    found = {opdb.op_key(i): i for i in opdb.load_op_db() if opdb.op_key(i) in wanted}
    missing = wanted - set(found)
    assert not missing, f"ops missing from this torch's op_db: {sorted(missing)}"
    return found


def _check(result: opdb.OpResult | None, expected: str) -> None:
    assert result is not None, "the op has no float32 samples"
    assert result.status not in ("wrong", "foreign"), f"{result.op}: {result.status}: {result.message}"
    if expected == S:
        assert result.status == S, f"{result.op} was supported, now {result.status}: {result.message}"
    if result.status == R:
        assert result.message, f"{result.op} refused without a reason"


@pytest.mark.parametrize("op", sorted(SUBSET))
def test_subset_reference(op, infos, one_torch_thread):
    grads = op in GRADIENT_OPS
    _check(opdb.run_op(infos[op], "reference", grads=grads, max_samples=2), SUBSET[op])


CPU_SUBSET = sorted(set(sorted(op for op, status in SUBSET.items() if status == S)[::3]) | NEW_OPS)


@pytest.mark.parametrize("op", CPU_SUBSET)
def test_subset_cpu(op, infos, one_torch_thread):
    _check(opdb.run_op(infos[op], "cpu", grads=False, max_samples=1), SUBSET[op])


def test_a_wrong_lowering_is_reported_wrong(infos, monkeypatch):
    """The sweep's comparison is live: sinh lowered as cosh is ``wrong``, not ``supported``."""
    monkeypatch.setitem(ATEN_TABLE, aten.sinh.default, AtenRule(lambda ctx, x: ctx.op("cosh", x)))
    result = opdb.run_op(infos["sinh"], "reference", grads=False, max_samples=1)
    assert result.status == "wrong" and "relative error" in result.message


def test_a_wrong_gradient_is_reported_wrong(infos, monkeypatch):
    """Gradients are checked too: exp2 lowered as exp with the result scaled to match has
    the forward right and the gradient wrong by a factor ln 2."""
    import math

    def exp2_via_exp(ctx, x):
        return ctx.op("exp", ctx.op("mul", x, ctx.scalar(math.log(2.0), x.dtype)))

    monkeypatch.setitem(ATEN_TABLE, aten.exp2.default, AtenRule(exp2_via_exp))
    assert opdb.run_op(infos["exp2"], "reference", grads=False, max_samples=1).status == S
    from kiln.ir import get_op

    rule = get_op("exp").vjp
    monkeypatch.setattr(get_op("exp"), "vjp", lambda b, i, o, c, a: [b.mul(rule(b, i, o, c, a)[0],
                                                                         b.const(2.0, i[0]))])
    result = opdb.run_op(infos["exp2"], "reference", grads=True, max_samples=1)
    assert result.status == "wrong" and result.message.startswith("gradient")


def test_foreign_exceptions_are_classified(monkeypatch, infos):
    def broken(ctx, x):
        raise IndexError("boom")

    monkeypatch.setitem(ATEN_TABLE, aten.sinh.default, AtenRule(broken))
    result = opdb.run_op(infos["sinh"], "reference", grads=False, max_samples=1)
    assert result.status in ("foreign", "refused")  # kiln may wrap lowering failures
    if result.status == "refused":
        assert "boom" in result.message


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_integer_fmod_and_remainder_are_exact(backend):
    """Shifted-window index arithmetic: fmod truncates, remainder floors, on int64 exactly."""
    a = torch.arange(-7, 8, dtype=torch.int64).reshape(3, 5) * 1000003
    b = torch.tensor([3, -3, 7, -7, 5], dtype=torch.int64)

    def fn(x, y):
        return torch.fmod(x, y), torch.remainder(x, y), torch.fmod(x, 4), x % -6

    compiled = kiln.compile(fn, (a, b), strict=True, backend=backend)
    for got, want in zip(compiled(a, b), fn(a, b)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("fn", [lambda x, y: torch.equal(x, y),
                                lambda x, y: x * 2 if (x - y).sum() > 0 else x,
                                lambda x, y: torch.nonzero(x > y).sum() + torch.nonzero(x < y).shape[0]])
def test_data_dependent_programs_are_refused_clearly(fn):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(kiln.UnsupportedOpError) as info:
        kiln.compile(fn, (x, y), strict=True, backend="reference")
    text = str(info.value)
    assert "[3, 4]" in text and "torch.compile" in text
    assert "tensor values" in text or "values of its inputs" in text or "symbolic shape" in text


def test_complex_inputs_are_refused_clearly():
    z = torch.randn(2, 3, dtype=torch.complex64)
    for entry in (lambda: kiln.compile(lambda t: t * 2, (z,), strict=True, backend="reference"),
                  lambda: kiln.capture(lambda t: t.real, (z,))):
        with pytest.raises(kiln.KilnError, match=r"complex64\[2, 3\].*no complex numbers"):
            entry()


def test_markdown_replaces_only_the_marked_block(tmp_path):
    doc = tmp_path / "ops.md"
    doc.write_text(f"# ops\nprose naming `{opdb.TABLE_BEGIN}` inline\n\n{opdb.TABLE_BEGIN}\nold\n"
                   f"{opdb.TABLE_END}\ntail\n")
    opdb.write_markdown(str(doc), {"reference": [opdb.OpResult("abs", S), opdb.OpResult("sort", R, "no rule")]})
    text = doc.read_text()
    assert text.startswith(f"# ops\nprose naming `{opdb.TABLE_BEGIN}` inline\n") and text.endswith("tail\n")
    assert "old" not in text and "| `sort` | refused | no rule |" in text
    assert "1 supported (50.0%), 1 refused" in text


@pytest.mark.slow
def test_full_sweep():
    """Every op with float32 samples, both backends: no wrong, no foreign, >= 90% supported."""
    for backend in ("reference", "cpu"):
        results = opdb.sweep(backend)
        bad = [f"{r.op}: {r.status}: {r.message}" for r in results if r.status in ("wrong", "foreign")]
        assert not bad, "\n".join(bad)
        s = opdb.summary(results)
        assert s["supported"] >= 0.9 * s["ops"], opdb.summary_line(backend, results)
