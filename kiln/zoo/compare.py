"""Comparing kiln's results with PyTorch eager in a way that cannot hide an error.

Every check runs the eager reference twice: in float32 (the user's program as written) and
in float64 (the exact answer, up to float64 rounding).  kiln's float32 result is judged
against the float64 one:

    pass  iff  |kiln - ref64| <= max(rtol * |ref64|, slack * |eager32 - ref64|)

with norms taken per tensor.  The first bound is the usual relative tolerance.  The second
admits results whose float32 rounding error is of the same size as eager's own: a quantity
that is zero in theory (the gradient of a key bias under a softmax over keys, which is
shift-invariant), or one computed by cancellation, is noise in eager float32 too, and
comparing two noises with a relative tolerance says nothing.  A check that passes only by
the second bound is reported as such (``Comparison.by_float32_noise``), so the table says
which results are limited by float32 and by how much.

Gradient checks use ``loss = (out * R).sum()`` for a fixed random ``R`` of each output's
shape: every element of every output reaches the loss with its own weight, unlike
``out.pow(2).mean()``, which a final unit-weight LayerNorm makes constant.

This module depends on torch only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

RTOL = 1e-4
SLACK = 10.0


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to(torch.float64).reshape(-1)


def norm(t: torch.Tensor) -> float:
    """The 2-norm of ``t`` in float64 (``inf`` if any element is not finite)."""
    f = _flat(t)
    if f.numel() == 0:
        return 0.0
    if not torch.isfinite(f).all():
        return math.inf
    return float(torch.linalg.vector_norm(f))


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b|`` in float64; non-finite entries must sit at the same places with equal values."""
    fa, fb = _flat(a), _flat(b)
    if fa.shape != fb.shape:
        return math.inf
    finite_a, finite_b = torch.isfinite(fa), torch.isfinite(fb)
    if not torch.equal(finite_a, finite_b):
        return math.inf
    odd = ~finite_a
    if odd.any() and not torch.equal(fa[odd].nan_to_num(0.0, 1.0, -1.0), fb[odd].nan_to_num(0.0, 1.0, -1.0)):
        return math.inf
    d = fa[finite_a] - fb[finite_a]
    return float(torch.linalg.vector_norm(d)) if d.numel() else 0.0


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` (the absolute difference when ``expected`` is 0)."""
    d = diff(actual, expected)
    scale = norm(expected)
    return d / scale if scale > 0 else d


@dataclass(frozen=True)
class Comparison:
    """One tensor of kiln's against eager float32 and float64."""

    name: str
    error: float
    """``|kiln - ref64| / |ref64|``."""
    eager_error: float
    """``|eager32 - ref64| / |ref64|``: float32's own error on this tensor."""
    vs_eager: float
    """``|kiln - eager32| / |eager32|``, the plain comparison with eager."""
    ok: bool
    by_float32_noise: bool
    """Passed only because eager float32 is as far from the exact answer."""


def compare(name: str, actual: torch.Tensor, eager32: torch.Tensor, ref64: torch.Tensor,
            rtol: float = RTOL, slack: float = SLACK) -> Comparison:
    """Judge ``actual`` (kiln, float32) by the rule in the module docstring."""
    scale = norm(ref64)
    d = diff(actual, ref64)
    d32 = diff(eager32, ref64)
    within_rtol = d <= rtol * scale
    within_noise = math.isfinite(d32) and d <= slack * d32
    rel = d / scale if scale > 0 else d
    rel32 = d32 / scale if scale > 0 else d32
    return Comparison(name, rel, rel32, rel_error(actual, eager32), within_rtol or within_noise,
                      (not within_rtol) and within_noise)


def compare_all(actual: Mapping[str, torch.Tensor], eager32: Mapping[str, torch.Tensor],
                ref64: Mapping[str, torch.Tensor], rtol: float = RTOL,
                slack: float = SLACK) -> list[Comparison]:
    """:func:`compare` for every name of ``ref64``; a name missing from ``actual`` fails."""
    out = []
    for name, r in ref64.items():
        if name not in actual or actual[name] is None:
            out.append(Comparison(name, math.inf, 0.0, math.inf, False, False))
            continue
        out.append(compare(name, actual[name], eager32[name], r, rtol, slack))
    return out


def worst(comparisons: Iterable[Comparison]) -> Comparison | None:
    """The comparison with the largest error among failures, else among all."""
    items = list(comparisons)
    if not items:
        return None
    failed = [c for c in items if not c.ok]
    return max(failed or items, key=lambda c: c.error)


def flatten_outputs(out: object, prefix: str = "out") -> dict[str, torch.Tensor]:
    """The floating-point tensors of a (nested) model output, by path (``out.logits``, ``out.0``)."""
    found: dict[str, torch.Tensor] = {}

    def visit(x: object, path: str) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() or x.is_complex():
                found[path] = x
        elif isinstance(x, Mapping):
            for k, v in x.items():
                visit(v, f"{path}.{k}")
        elif hasattr(x, "to_tuple") and hasattr(x, "keys"):  # transformers ModelOutput
            for k in x.keys():
                visit(x[k], f"{path}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                visit(v, f"{path}.{i}")

    visit(out, prefix)
    return found


def weights_for(outputs: Mapping[str, torch.Tensor], seed: int = 1234) -> dict[str, torch.Tensor]:
    """A fixed random float64 weight per output (the ``R`` of ``(out * R).sum()``)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in outputs.items()}


def weighted_loss(outputs: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``sum((out * R).sum())`` over every output, in the outputs' dtype."""
    total = None
    for k, v in outputs.items():
        term = (v * weights[k].to(v.dtype)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the model returned no floating-point tensor to differentiate")
    return total
