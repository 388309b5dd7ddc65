"""Latency of one legality check (kiln.loops.Schedule) on gemm-sized and stencil nests.

Each case builds the schedule and its dependences once, then times, many times over:

* ``check``: :func:`kiln.ir.poly.legality.check_schedule` on the transformed tree -- the
  work every checked primitive does before it applies;
* ``step``: a whole checked primitive on a copy of the schedule (tree rewrite + check).

Each sample is one call timed by :func:`kiln.runtime.timing.best_time` (the table reports
the median and the 90th percentile of the samples, so every call is a sample of its own).

Usage::

    python3 benchmarks/legality_check.py [--repeat 200] [--update-docs docs/loops.md]

``--update-docs`` rewrites the table between the ``legality-benchmark`` markers.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import kiln.loops as kl
from kiln.ir.poly.legality import check_schedule
from kiln.passes.schedule import tree_ops
from kiln.tuning.measure import best_time

GEMM = """
for (i = 0; i < NI; i++) {
  for (j = 0; j < NJ; j++) C[i][j] *= beta;
  for (k = 0; k < NK; k++)
    for (j = 0; j < NJ; j++) C[i][j] += alpha * A[i][k] * B[k][j];
}"""
MATMUL = """
for (i = 0; i < N; i++)
  for (j = 0; j < N; j++)
    for (k = 0; k < N; k++)
      C[i][j] += A[i][k] * B[k][j];
"""
JACOBI_2D = """
for (t = 0; t < T; t++) {
  for (i = 1; i < N - 1; i++)
    for (j = 1; j < N - 1; j++)
      B[i][j] = 0.2 * (A[i][j] + A[i][j - 1] + A[i][1 + j] + A[1 + i][j] + A[i - 1][j]);
  for (i = 1; i < N - 1; i++)
    for (j = 1; j < N - 1; j++)
      A[i][j] = 0.2 * (B[i][j] + B[i][j - 1] + B[i][1 + j] + B[1 + i][j] + B[i - 1][j]);
}"""
SEIDEL_2D = """
for (t = 0; t < T; t++)
  for (i = 1; i < N - 1; i++)
    for (j = 1; j < N - 1; j++)
      A[i][j] = (A[i-1][j-1] + A[i-1][j] + A[i-1][j+1] + A[i][j-1] + A[i][j] + A[i][j+1]
                 + A[i+1][j-1] + A[i+1][j] + A[i+1][j+1]) / 9.0;
"""
HEAT_3D = """
for (t = 1; t <= T; t++) {
  for (i = 1; i < N - 1; i++)
    for (j = 1; j < N - 1; j++)
      for (k = 1; k < N - 1; k++)
        B[i][j][k] = 0.125 * (A[i+1][j][k] - 2.0 * A[i][j][k] + A[i-1][j][k])
                   + 0.125 * (A[i][j+1][k] - 2.0 * A[i][j][k] + A[i][j-1][k])
                   + 0.125 * (A[i][j][k+1] - 2.0 * A[i][j][k] + A[i][j][k-1]) + A[i][j][k];
  for (i = 1; i < N - 1; i++)
    for (j = 1; j < N - 1; j++)
      for (k = 1; k < N - 1; k++)
        A[i][j][k] = 0.125 * (B[i+1][j][k] - 2.0 * B[i][j][k] + B[i-1][j][k])
                   + 0.125 * (B[i][j+1][k] - 2.0 * B[i][j][k] + B[i][j-1][k])
                   + 0.125 * (B[i][j][k+1] - 2.0 * B[i][j][k] + B[i][j][k-1]) + B[i][j][k];
}"""

Case = tuple[str, str, Callable, Callable[[kl.Schedule], kl.Schedule]]
CASES: list[Case] = [
    ("matmul: tile i,j,k by 32", MATMUL, lambda t: tree_ops.tile(t, ["i", "j", "k"], [32, 32, 32]),
     lambda s: s.tile(["i", "j", "k"], [32, 32, 32])),
    ("gemm: tile k,j by 32 + interchange", GEMM,
     lambda t: tree_ops.interchange(tree_ops.tile(t, ["k", "j_1"], [32, 32]), "k", "j_1"),
     lambda s: s.tile(["k", "j_1"], [32, 32])),
    ("jacobi-2d: tile i,j by 16", JACOBI_2D, lambda t: tree_ops.tile(t, ["i", "j"], [16, 16]),
     lambda s: s.tile(["i", "j"], [16, 16])),
    ("seidel-2d: skew + interchange", SEIDEL_2D,
     lambda t: tree_ops.interchange(tree_ops.skew(t, "j", "i", 1), "i", "j"),
     lambda s: s.skew("j", "i", 1)),
    ("seidel-2d: interchange (illegal)", SEIDEL_2D, lambda t: tree_ops.interchange(t, "i", "j"), None),
    ("heat-3d: tile i,j,k by 8", HEAT_3D, lambda t: tree_ops.tile(t, ["i", "j", "k"], [8, 8, 8]),
     lambda s: s.tile(["i", "j", "k"], [8, 8, 8])),
]


def _stats(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[int(0.9 * (len(ordered) - 1))] * 1e3


def _time_step(step: Callable, trial: kl.Schedule) -> float:
    """Seconds of one checked primitive on ``trial`` (a fresh copy, made before timing)."""
    return best_time(lambda: step(trial), repeat=1, warmup=0)


def run(repeat: int) -> list[tuple[str, bool, float, float, float | None, float | None]]:
    rows = []
    for name, source, rewrite, step in CASES:
        schedule = kl.Schedule(kl.from_c(source))
        deps = schedule.dependences
        tree = rewrite(schedule.tree)
        legal = check_schedule(schedule.model, deps, tree).legal  # warm-up
        samples = [best_time(lambda: check_schedule(schedule.model, deps, tree), repeat=1, warmup=0)
                   for _ in range(repeat)]
        med, p90 = _stats(samples)
        step_med = step_p90 = None
        if step is not None:
            steps = [_time_step(step, schedule.copy()) for _ in range(max(repeat // 4, 10))]
            step_med, step_p90 = _stats(steps)
        rows.append((name, legal, med, p90, step_med, step_p90))
    return rows


def table(rows) -> str:
    lines = ["| case | verdict | check median (ms) | check p90 (ms) | checked step median (ms) |",
             "|---|---|---|---|---|"]
    for name, legal, med, p90, step_med, _ in rows:
        step = f"{step_med:.2f}" if step_med is not None else "-"
        lines.append(f"| {name} | {'legal' if legal else 'illegal'} | {med:.2f} | {p90:.2f} | {step} |")
    lines.append(f"\nMeasured on {platform.machine()} with Python {platform.python_version()} "
                 f"({platform.processor() or 'unknown CPU'}).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--update-docs", type=Path, default=None)
    args = ap.parse_args()
    text = table(run(args.repeat))
    print(text)
    if args.update_docs is not None:
        doc = args.update_docs.read_text()
        start, end = "<!-- legality-benchmark:start -->", "<!-- legality-benchmark:end -->"
        head, rest = doc.split(start, 1)
        _, tail = rest.split(end, 1)
        args.update_docs.write_text(f"{head}{start}\n{text}\n{end}{tail}")


if __name__ == "__main__":
    main()
