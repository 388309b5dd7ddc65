"""Micro-batches of variable-length samples, by dynamic programming (as in DynaPipe).

A micro-batch pads its samples to its longest one.  :func:`plan_microbatches` groups the
samples so that the padded tokens plus ``overhead`` per micro-batch (the fixed cost of one
pipeline slot: a launch, a send, a bubble share, in token units) is minimal, under optional
limits on a micro-batch's padded tokens (``max_tokens``, memory) and sample count
(``max_samples``).

Why the dynamic program is exact: the cost of a group depends only on its size and its
longest sample, so some optimal grouping takes, after sorting by length, contiguous runs --
for a group with the longest sample, filling it with the next longest samples never raises
another group's maximum, nor breaks a limit.  Over sorted lengths ``L``, ``best[i]`` is the
cost of the first ``i`` samples, ``best[i] = min_j best[j] + L[i-1] * (i - j) -
sum(L[j:i]) + overhead`` over the ``j`` the limits allow: O(n^2) time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir.errors import ScheduleError


@dataclass(frozen=True)
class MicrobatchPlan:
    groups: list[list[int]]
    """Sample indices (into the given lengths) of each micro-batch, shortest samples first."""
    padded_tokens: int
    """Sum over micro-batches of longest sample x sample count."""
    padding: int
    """Padded minus real tokens."""
    cost: float
    """``padding + overhead * len(groups)``: what the plan minimizes."""


def group_cost(lengths: Sequence[int], overhead: float) -> float:
    """Padding of one micro-batch plus ``overhead``."""
    return max(lengths) * len(lengths) - sum(lengths) + overhead


def plan_microbatches(lengths: Sequence[int], *, overhead: float = 0.0, max_tokens: int | None = None,
                      max_samples: int | None = None) -> MicrobatchPlan:
    """The grouping of samples of ``lengths`` into micro-batches of least cost (see the
    module docstring)."""
    lens = [int(n) for n in lengths]
    if not lens:
        raise ScheduleError("plan_microbatches: no samples")
    if any(n <= 0 for n in lens):
        raise ScheduleError(f"plan_microbatches: lengths must be positive, got {lens}")
    if overhead < 0:
        raise ScheduleError(f"plan_microbatches: overhead must be >= 0, got {overhead}")
    if max_tokens is not None and max(lens) > max_tokens:
        raise ScheduleError(f"plan_microbatches: a sample of {max(lens)} tokens exceeds max_tokens={max_tokens}; "
                            "raise max_tokens or truncate that sample")
    if max_samples is not None and max_samples < 1:
        raise ScheduleError(f"plan_microbatches: max_samples must be >= 1, got {max_samples}")
    order = sorted(range(len(lens)), key=lambda i: (lens[i], i))
    s = [lens[i] for i in order]
    prefix = [0]
    for n in s:
        prefix.append(prefix[-1] + n)
    inf = float("inf")
    best = [0.0] + [inf] * len(s)
    back = [0] * (len(s) + 1)
    for i in range(1, len(s) + 1):
        longest = s[i - 1]
        for j in range(i - 1, -1, -1):
            count = i - j
            if max_samples is not None and count > max_samples:
                break
            if max_tokens is not None and longest * count > max_tokens:
                break
            cost = best[j] + longest * count - (prefix[i] - prefix[j]) + overhead
            if cost < best[i]:
                best[i], back[i] = cost, j
    groups: list[list[int]] = []
    i = len(s)
    while i > 0:
        j = back[i]
        groups.append([order[k] for k in range(j, i)])
        i = j
    groups.reverse()
    padded = sum(max(lens[k] for k in g) * len(g) for g in groups)
    return MicrobatchPlan(groups, padded, padded - sum(lens), best[len(s)])


__all__ = ["MicrobatchPlan", "group_cost", "plan_microbatches"]
