"""Matrix factorizations and solvers (kiln/ir/ops/linalg.py, factorizations.py, kiln/frontends/torch/aten_linalg.py)
end to end against PyTorch eager.

Each case is a torch function of well-conditioned matrices.  Forward: compiled with
``kiln.compile(..., strict=True)`` on the ``reference`` and ``cpu`` backends.  Gradients:
``torch.compile(backend="kiln", options={"strict": True})`` with the loss
``sum(out * R)`` for a fixed random ``R`` per floating-point output (sign- and
order-dependent outputs such as singular vectors included: kiln follows torch's LAPACK
conventions, so even gauge-dependent losses agree).  Results are compared by the rule of
:mod:`kiln.zoo.compare`: kiln's float32 result against eager float64, within 1e-4 relative
or 10x eager float32's own error.
"""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.zoo.compare import compare


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def spd(*shape: int, seed: int = 0) -> torch.Tensor:
    x = rand(*shape, seed=seed)
    return x @ x.mT + shape[-1] * torch.eye(shape[-1])


def tri(*shape: int, upper: bool, seed: int = 0) -> torch.Tensor:
    x = rand(*shape, seed=seed) + 3 * torch.eye(shape[-1])
    return x.triu() if upper else x.tril()


def _lu_data(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    lu, piv = torch.linalg.lu_factor(rand(*shape, seed=seed))
    return lu, piv


_SQ = rand(2, 4, 4, seed=1)
_LU, _PIV = _lu_data(2, 4, 4, seed=2)
_LU_WIDE, _PIV_WIDE = _lu_data(3, 5, seed=3)
_QR_A, _QR_TAU = torch.geqrf(rand(5, 3, seed=4))

# name -> (function, inputs)
CASES = {
    "cholesky": (torch.linalg.cholesky, [spd(2, 4, 4)]),
    "cholesky_upper": (lambda a: torch.linalg.cholesky(a, upper=True), [spd(4, 4)]),
    "cholesky_ex": (lambda a: torch.linalg.cholesky_ex(a), [spd(3, 3)]),
    "cholesky_old": (lambda a: torch.cholesky(a, upper=True), [spd(3, 3)]),
    "cholesky_solve": (lambda b, l: torch.cholesky_solve(b, l), [rand(2, 4, 2), torch.linalg.cholesky(spd(2, 4, 4))]),
    "cholesky_solve_upper": (lambda b, u: torch.cholesky_solve(b, u, upper=True),
                             [rand(4, 3), torch.linalg.cholesky(spd(4, 4), upper=True)]),
    "cholesky_inverse": (torch.cholesky_inverse, [torch.linalg.cholesky(spd(4, 4))]),
    "solve_triangular": (lambda a, b: torch.linalg.solve_triangular(a, b, upper=True),
                         [tri(2, 4, 4, upper=True), rand(4, 3)]),
    "solve_triangular_right_unit": (
        lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, left=False, unitriangular=True),
        [tri(4, 4, upper=False), rand(2, 3, 4)]),
    "triangular_solve_transpose": (lambda b, a: torch.triangular_solve(b, a, upper=False, transpose=True),
                                   [rand(4, 2), tri(4, 4, upper=False)]),
    "svd_tall": (lambda a: torch.linalg.svd(a, full_matrices=False), [rand(2, 5, 3)]),
    "svd_wide": (lambda a: torch.linalg.svd(a, full_matrices=False), [rand(3, 5)]),
    "svd_old": (lambda a: torch.svd(a), [rand(4, 3)]),
    "svd_full_tall": (torch.linalg.svd, [rand(4, 3)]),
    "svd_full_wide": (torch.linalg.svd, [rand(2, 3, 4)]),
    "svdvals": (torch.linalg.svdvals, [rand(2, 3, 4)]),
    "norm_nuc": (lambda a: torch.linalg.matrix_norm(a, ord="nuc"), [rand(4, 3)]),
    "norm_2": (lambda a: torch.linalg.matrix_norm(a, ord=2), [rand(3, 4)]),
    "cond": (torch.linalg.cond, [_SQ]),
    "matrix_rank": (lambda a: torch.linalg.matrix_rank(a), [rand(4, 2) @ rand(2, 5)]),
    "pinv": (torch.linalg.pinv, [rand(2, 5, 3)]),
    "pinv_hermitian": (lambda a: torch.linalg.pinv(a, hermitian=True), [spd(4, 4)]),
    "pinverse": (torch.pinverse, [rand(3, 4)]),
    "eigh": (torch.linalg.eigh, [spd(2, 4, 4)]),
    "eigh_upper": (lambda a: torch.linalg.eigh(a, UPLO="U"), [rand(4, 4)]),
    "eigvalsh": (torch.linalg.eigvalsh, [rand(3, 3)]),
    "lu_factor": (torch.linalg.lu_factor, [rand(2, 4, 4)]),
    "lu_factor_ex_wide": (torch.linalg.lu_factor_ex, [rand(3, 5)]),
    "lu": (torch.linalg.lu, [rand(5, 3)]),
    "lu_old": (lambda a: torch.linalg.lu_factor(a), [rand(4, 4)]),
    "lu_unpack": (torch.lu_unpack, [_LU_WIDE, _PIV_WIDE]),
    "lu_solve": (lambda lu, piv, b: torch.linalg.lu_solve(lu, piv, b), [_LU, _PIV, rand(2, 4, 3)]),
    "lu_solve_adjoint_right": (lambda lu, piv, b: torch.linalg.lu_solve(lu, piv, b, left=False, adjoint=True),
                               [_LU, _PIV, rand(2, 3, 4)]),
    "lu_solve_old": (lambda b, lu, piv: torch.lu_solve(b, lu, piv), [rand(2, 4, 1), _LU, _PIV]),
    "qr": (torch.linalg.qr, [rand(2, 5, 3)]),
    "qr_wide": (torch.linalg.qr, [rand(3, 5)]),
    "qr_complete": (lambda a: torch.linalg.qr(a, mode="complete"), [rand(5, 3)]),
    "geqrf": (torch.geqrf, [rand(4, 3)]),
    "householder_product": (torch.linalg.householder_product, [_QR_A, _QR_TAU]),
    "ormqr": (lambda a, tau, c: torch.ormqr(a, tau, c, left=False, transpose=True), [_QR_A, _QR_TAU, rand(2, 5)]),
    "matrix_exp": (torch.linalg.matrix_exp, [rand(2, 4, 4) * 0.7]),
    "ldl_factor": (torch.linalg.ldl_factor, [rand(2, 4, 4, seed=5) + rand(2, 4, 4, seed=5).mT]),
    "ldl_factor_ex": (torch.linalg.ldl_factor_ex, [rand(5, 5, seed=6) + rand(5, 5, seed=6).mT]),
    "ldl_solve": (lambda ld, piv, b: torch.linalg.ldl_solve(ld, piv, b),
                  [*torch.linalg.ldl_factor(rand(4, 4, seed=7) + rand(4, 4, seed=7).mT), rand(4, 2)]),
    "tensorsolve": (torch.linalg.tensorsolve, [rand(2, 3, 6), rand(2, 3)]),
    "tensorinv": (lambda a: torch.linalg.tensorinv(a, ind=2), [(rand(6, 6) + 4 * torch.eye(6)).reshape(2, 3, 6)]),
}


def _plain(fn, n: int):
    """``fn`` as a Python function of ``n`` named tensors (kiln.compile reads signatures)."""
    return [lambda a: fn(a), lambda a, b: fn(a, b), lambda a, b, c: fn(a, b, c)][n - 1]


CASES = {name: (_plain(fn, len(inputs)), inputs) for name, (fn, inputs) in CASES.items()}
# outputs that are not differentiable in torch, or whose gradient torch refuses
NO_GRAD = {"geqrf", "matrix_rank", "qr_complete", "ldl_factor", "ldl_factor_ex", "ldl_solve"}


def _leaves(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _leaves(o)] if isinstance(out, (tuple, list)) else []


def _check(got, eager, ref, what: str) -> None:
    got, eager, ref = _leaves(got), _leaves(eager), _leaves(ref)
    assert len(got) == len(eager)
    for i, (g, e, r) in enumerate(zip(got, eager, ref)):
        assert g.shape == e.shape and g.dtype == e.dtype, f"{what} {i}: {g.shape} {g.dtype}, eager {e.shape} {e.dtype}"
        if not e.is_floating_point():
            assert torch.equal(g, e), f"{what} {i}: {g} vs eager {e}"
            continue
        c = compare(f"{what}{i}", g.double(), e.double(), r.double())
        assert c.ok, f"{what} {i}: relative error {c.error:.3g} (eager float32 {c.eager_error:.3g})"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_eager(name, backend, one_torch_thread):
    fn, inputs = CASES[name]
    compiled = kiln.compile(fn, tuple(inputs), strict=True, backend=backend)
    got = compiled(*inputs)
    _check(got, fn(*inputs), fn(*[x.double() if x.is_floating_point() else x for x in inputs]), "result")


def _grads(fn, inputs: list[torch.Tensor], dtype=None) -> list[torch.Tensor]:
    xs = [x.detach().to(dtype) if (dtype and x.is_floating_point()) else x.detach().clone() for x in inputs]
    for x in xs:
        if x.is_floating_point():
            x.requires_grad_(True)
    gen = _gen(7)
    loss = 0
    # a weight per floating output by position, so both sides weight each output alike even
    # where they disagree on which outputs require grad (an output built from integer pivots)
    for o in _leaves(fn(*xs)):
        if o.is_floating_point():
            w = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
            if o.requires_grad:
                loss = loss + (o * w).sum()
    return list(torch.autograd.grad(loss, [x for x in xs if x.requires_grad]))


# P of linalg.lu / lu_unpack comes from the integer pivots and gets no gradient, but
# (lu and lu_unpack check that their permutation output, built from integer pivots, does not
# require grad, as in eager)
GRAD_CASES = sorted(set(CASES) - NO_GRAD)


@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradients_match_eager(name, one_torch_thread):
    import torch._dynamo

    fn, inputs = CASES[name]
    eager = _grads(fn, inputs)
    ref = _grads(fn, inputs, torch.float64)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, backend="kiln", options={"strict": True, "backend": "reference"})
        got = _grads(compiled, inputs)
    finally:
        torch._dynamo.reset()
    _check(got, eager, ref, "gradient")


def test_gradient_of_complete_qr_of_a_tall_matrix_is_refused():
    import torch._dynamo

    torch._dynamo.reset()
    fn = torch.compile(lambda a: torch.linalg.qr(a, mode="complete").Q, backend="kiln",
                       options={"strict": True})
    a = rand(5, 3).requires_grad_(True)
    with pytest.raises(Exception, match="mode 'complete'"):
        fn(a).sum().backward()
    torch._dynamo.reset()


def test_not_positive_definite_gives_nan_and_info():
    a = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    l, info = kiln.compile(lambda a: torch.linalg.cholesky_ex(a), (a,), strict=True)(a)
    assert torch.isnan(l).all() and int(info) == torch.linalg.cholesky_ex(a).info == 2


def test_singular_lu_info_matches_torch():
    a = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    got = kiln.compile(lambda a: torch.linalg.lu_factor_ex(a), (a,), strict=True)(a)
    want = torch.linalg.lu_factor_ex(a)
    assert torch.equal(got[1], want.pivots) and int(got[2]) == int(want.info) == 2


@pytest.mark.parametrize("fn, inputs, message", [
    (torch.linalg.eig, [rand(3, 3)], "complex"),
    (torch.linalg.eigvals, [rand(3, 3)], "complex"),
    (lambda a: torch.linalg.lu_factor(a, pivot=False), [rand(3, 3)], "pivot=False"),
])
def test_bad_input_is_refused_clearly(fn, inputs, message):
    with pytest.raises(kiln.UnsupportedOpError, match=message):
        kiln.compile(_plain(fn, len(inputs)), tuple(inputs), strict=True)


def test_effect_tokens_of_decomposed_factorizations_are_ignored():
    """Decomposed, linalg.cholesky / lu_factor / tensorinv check their info through an
    effect token (``with_effects(token, _linalg_check_errors, ...)``); capture drops it."""
    from kiln.backends.reference import run_graph
    from kiln.frontends.torch.capture import capture_program, export_program

    class Model(torch.nn.Module):
        def forward(self, a, b):
            return torch.linalg.cholesky(a), torch.linalg.lu_factor(b).LU

    a, b = spd(3, 3), rand(4, 4)
    ep = export_program(Model(), (a, b), decompose=True)
    assert any(s.kind.name == "TOKEN" for s in ep.graph_signature.input_specs)
    captured = capture_program(ep)
    got = run_graph(captured.graph, [a.numpy(), b.numpy()], [])
    want = Model()(a, b)
    for g, w in zip(got, want):
        assert torch.allclose(torch.from_numpy(g), w, rtol=1e-4, atol=1e-5)
