"""``kiln.schedule.verify``: the scheduled model against the original, outputs and gradients.

Both models run on the same inputs under the same seed; the loss is ``loss_fn(output)``, by
default ``(output * fixed_random).sum()`` with a seeded ``fixed_random``.  After the
backward, every parameter gradient of the scheduled model is gathered across the ranks
(sharded parameters are all-gathered and put back together, :func:`unshard_tensor`) and
compared with the original's gradient of the parameter of the same name, in backward order
(the parameters registered last, nearest the loss, first: where a wrong schedule first shows
in the gradients).  It works on one
process (no schedule communication then) and on any ``torch.distributed`` group, gloo on
CPUs included.  A difference raises :class:`ScheduleMismatch`, which names the output
and the first parameter (in backward order) whose gradient differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kiln.ir import KilnError

from .build import unshard_tensor


GRADIENT_FLOOR = 1e-3
"""A gradient is compared relative to at least this fraction of the model's largest gradient
element (see :func:`relative_error`)."""


class ScheduleMismatch(KilnError):
    """The scheduled model computes something else than the original (see ``report``)."""

    def __init__(self, message: str, report: VerifyReport):
        super().__init__(message)
        self.report = report


@dataclass
class VerifyReport:
    output_error: float
    grad_errors: dict[str, float] = field(default_factory=dict)
    """Parameter name -> relative error of its gathered gradient."""
    mismatched: list[str] = field(default_factory=list)
    """Parameters whose gradient differs, in backward order (last registered first)."""
    not_compared: list[str] = field(default_factory=list)
    """Parameters of the original missing from the scheduled model (replaced modules)."""
    tolerance: float = 1e-5

    @property
    def ok(self) -> bool:
        return self.output_error <= self.tolerance and not self.mismatched


def first_tensor(out: Any) -> torch.Tensor:
    """The primary tensor of a model's output (a tensor, a tuple's first entry, a
    transformers output's first field)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise KilnError(f"verify: cannot find the output tensor in a {type(out).__name__}; pass loss_fn")


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """``max|got - want| / max(max|want|, floor)`` (an absolute error where both are 0).
    ``floor`` keeps a gradient that is zero up to rounding (a key projection's bias, to
    which softmax is invariant) from counting its rounding noise as a relative error."""
    if got.shape != want.shape:
        return float("inf")
    scale = max(want.abs().max().item() if want.numel() else 0.0, floor)
    diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _run(model: nn.Module, inputs: tuple, kwargs: dict, loss_fn: Callable | None, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    out = model(*inputs, **kwargs)
    y = first_tensor(out)
    if loss_fn is not None:
        loss = loss_fn(out)
    else:
        weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=y.dtype)
        loss = (y * weights).sum()
    loss.backward()
    return y.detach()


def gathered_grad(p: nn.Parameter, shard: tuple[int, int] | None, world: int) -> torch.Tensor | None:
    """``p.grad`` put back together across the ranks when ``p`` is sharded."""
    g = p.grad if p.grad is not None else torch.zeros_like(p)
    if shard is None or world == 1:
        return g
    parts = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(parts, g.contiguous())
    return unshard_tensor(parts, *shard)


def verify(sch: Any, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
           example_kwargs: dict | None = None, tolerance: float = 1e-5, seed: int = 0,
           raise_on_mismatch: bool = True) -> VerifyReport:
    """Compare the scheduled model (``sch.build()``) with the original (see the module
    docstring); returns the :class:`VerifyReport` or raises :class:`ScheduleMismatch`."""
    root = sch.root
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    original = root.original
    scheduled = root.build()
    if hasattr(scheduled, "stage_of"):
        raise KilnError("verify: a pipeline schedule runs stage by stage; compare its losses with "
                        "PipelineModule.train_step instead")
    for m in (original, scheduled):
        m.zero_grad(set_to_none=True)
    want = _run(original, inputs, kwargs, loss_fn, seed)
    got = _run(scheduled, inputs, kwargs, loss_fn, seed)
    info = getattr(scheduled, "kiln_schedule", None)
    world = info.world_size if info is not None else 1
    shards = info.shards if info is not None else {}
    report = VerifyReport(relative_error(got, want), tolerance=tolerance)
    mine = dict(scheduled.named_parameters())
    largest = max((p.grad.abs().max().item() for p in original.parameters()
                   if p.grad is not None and p.grad.numel()), default=0.0)
    floor = GRADIENT_FLOOR * largest
    for name, p in reversed(list(original.named_parameters())):
        q = mine.get(name)
        if q is None:
            report.not_compared.append(name)
            continue
        g = gathered_grad(q, shards.get(name), world)
        w = p.grad if p.grad is not None else torch.zeros_like(p)
        err = relative_error(g, w, floor)
        report.grad_errors[name] = err
        if not err <= tolerance:
            report.mismatched.append(name)
    for m in (original, scheduled):
        m.zero_grad(set_to_none=True)
    if raise_on_mismatch and not report.ok:
        parts = []
        if not report.output_error <= tolerance:
            parts.append(f"the output differs (relative error {report.output_error:.3g})")
        if report.mismatched:
            first = report.mismatched[0]
            parts.append(f"the first parameter whose gradient differs is {first!r} (relative error "
                         f"{report.grad_errors[first]:.3g}; {len(report.mismatched)} differ in all)")
        raise ScheduleMismatch(f"verify: the scheduled model does not match the original within {tolerance}: "
                               + "; ".join(parts) + ". Check that schedule's shards and syncs "
                               "(a row-parallel bias must be added once, after the all_reduce)", report)
    return report


__all__ = ["ScheduleMismatch", "VerifyReport", "first_tensor", "gathered_grad", "relative_error", "verify"]
