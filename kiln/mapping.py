"""``kiln.mapping``: task mappings, their exactly-once proofs, and the race check of kernels.

::

    from kiln.mapping import spatial, repeat, auto_map, prove_coverage, check_races

    m = repeat(2, 1) * spatial(4, 32)          # 128 workers, tasks of an 8x32 grid
    assert m.worker2task(33) == [(1, 1), (5, 1)]
    assert auto_map(8, 32, workers=64) == repeat(4, 1) * spatial(2, 32)
    print(prove_coverage(m))                   # isl: every task exactly once
    kernel = ...                               # a loop program in kernel form
    check_races(kernel)                        # RaceError naming two workers and a cell

Task loops ``for (i, j) in m on t { ... }`` are built with ``m.on(t).loop(iterators, body)``
and lowered to index arithmetic by :func:`lower_mappings`.  See ``docs/mapping.md``.
"""

from kiln.ir.loops.mapping import TaskMapping, auto_map, repeat, spatial
from kiln.ir.loops.tasks import lower_mappings
from kiln.ir.poly.coverage import CoverageError, CoverageProof, prove_coverage
from kiln.ir.poly.races import RaceError, check_races

__all__ = [
    "CoverageError", "CoverageProof", "RaceError", "TaskMapping", "auto_map", "check_races", "lower_mappings",
    "prove_coverage", "repeat", "spatial",
]
