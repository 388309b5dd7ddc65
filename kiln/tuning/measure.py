"""Measurement of graphs and executables, on the one timing loop.

* :func:`best_time` -- :func:`kiln.runtime.timing.best_time`, re-exported: every timer in
  kiln uses it;
* :func:`measure_runtime` -- the measured cost of a graph: median seconds of the numpy
  reference implementations on seeded random arguments (the ``"measured"`` cost of pass
  ordering, :mod:`kiln.tuning.rl.costs`);
* :func:`call_overhead_us` -- per-call time of a cpu executable whose kernels do almost
  nothing;
* :func:`kernel_profiling` and :func:`profile_plan` -- where one call of a cpu executable
  spends its time, summed per :data:`PROFILE_CATEGORIES`.

Model-level measurement (a PyTorch model compiled by ``kiln.compile`` beside eager) is a
benchmark: ``python -m benchmarks.measure`` (``docs/tuning.md``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kiln.backends import get_backend
from kiln.backends.cpu.backend import PROFILE_ENV_VAR
from kiln.ir import Graph, parse
from kiln.ir.ops.fused import run_body
from kiln.passes.ordering.cost import random_arguments
from kiln.passes.pipeline import default_pipeline
from kiln.runtime.timing import best_time


def measure_runtime(graph: Graph, *, repeats: int = 3, seed: int = 0) -> float:
    """Median wall time in seconds of running ``graph`` with the registry's numpy references
    (the semantics of the reference executor) on seeded random arguments
    (:func:`~kiln.passes.ordering.cost.random_arguments`), after one warm-up run."""
    inputs, params = random_arguments(graph, seed)
    flat = graph.clone()  # params become trailing inputs, so the ir-level interpreter runs it
    flat.inputs, flat.params = flat.inputs + flat.params, []
    arrays = inputs + params
    return best_time(lambda: run_body(flat, arrays), repeat=max(1, repeats), warmup=1, statistic="median")


TINY_GRAPH = """
graph @tiny(%x: f32[4], %y: f32[4]) {
  %0: f32[4] = add(%x, %y)
  %1: f32[] = sum(%0)
  %2: f32[4] = mul(%0, %1)
  %3: f32[4] = exp(%2)
  return %3
}"""
"""The graph :func:`call_overhead_us` times: 2 inputs, 3 tiny kernels, 1 output."""


def call_overhead_us(repeats: int = 20000) -> float:
    """Per-call time of the cpu executable of :data:`TINY_GRAPH` (default pipeline), in
    microseconds: the mean of ``repeats`` consecutive calls after 100 warm-up calls."""
    graph = default_pipeline().run(parse(TINY_GRAPH)).graph
    exe = get_backend("cpu").build(graph)
    args = [torch.randn(4), torch.randn(4)]
    with torch.no_grad():
        return best_time(lambda: exe(args), repeat=1, warmup=100, number=repeats) * 1e6


PROFILE_CATEGORIES = (
    ("GEMM (+ fused epilogue)", lambda step, label: "[gemm" in label),
    ("convolution", lambda step, label: "conv" in label and step == "TorchStep"),
    ("attention (torch SDPA)", lambda step, label: "scaled_dot_product_attention" in label),
    ("normalization kernels", lambda step, label: "norm" in label and step == "NativeRunStep"),
    ("other generated kernels", lambda step, label: step == "NativeRunStep"),
    ("other library calls", lambda step, label: step == "TorchStep"),
    ("copies, packing, views", lambda step, label: step in ("ContiguousStep", "PackStep", "ViewStep")),
    ("releasing buffers", lambda step, label: step == "ReleaseStep"),
)
"""How :func:`profile_plan` groups the calls of a plan (first matching category wins)."""


@contextmanager
def kernel_profiling() -> Iterator[None]:
    """Inside it, the cpu backend builds executables whose kernels are each a native call of
    their own (``KILN_PROFILE_KERNELS=1``), so :func:`profile_plan` can time each."""
    previous = os.environ.get(PROFILE_ENV_VAR)
    os.environ[PROFILE_ENV_VAR] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(PROFILE_ENV_VAR)
        else:
            os.environ[PROFILE_ENV_VAR] = previous


def profile_plan(plan: Any, args: Sequence[Any], repeat: int = 5) -> tuple[float, list[tuple[str, float, int]]]:
    """Where one call of a call plan (``executable.plan``) spends its time: every call of the
    plan is timed (``plan.profile``, best of ``repeat``) and the times are summed per
    :data:`PROFILE_CATEGORIES` entry.  Returns the total seconds and ``(category, seconds,
    calls)`` rows, largest first.  Build under :func:`kernel_profiling` to see each kernel."""
    with torch.no_grad():
        timings = plan.profile(list(args), repeat=repeat)
    totals: dict[str, list[float]] = {}
    for label, seconds in timings:
        step, _, what = label.partition(": ")
        category = next((c for c, test in PROFILE_CATEGORIES if test(step, what)), "other")
        entry = totals.setdefault(category, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    rows = sorted(((c, t, int(n)) for c, (t, n) in totals.items()), key=lambda r: -r[1])
    return sum(t for _, t in timings), rows


__all__ = [
    "PROFILE_CATEGORIES", "TINY_GRAPH", "best_time", "call_overhead_us", "kernel_profiling", "measure_runtime",
    "profile_plan",
]
