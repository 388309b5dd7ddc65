"""``kiln.loops``: loop programs, their C front door, and checked schedules.

::

    import kiln.loops as kl

    prog = kl.from_c('''
        for (i = 0; i < N; i++)
          for (j = 0; j < M; j++)
            for (k = 0; k < K; k++)
              C[i][j] += A[i][k] * B[k][j];
    ''')
    s = kl.Schedule(prog)
    s.tile(["i", "j"], [32, 32]).interchange("j", "k")
    s.parallel("i_tile")
    kl.run(s.program(), {"N": 64, "M": 64, "K": 64}, {"A": a, "B": b, "C": c})
    print(kl.to_c(s.program()))

Illegal steps raise :class:`IllegalTransformError` (with an explanation naming the broken
dependence); misapplied ones raise :class:`ScheduleError`.  :func:`measure_runtime` and
:func:`export_dataset` (timed schedules) come from :mod:`kiln.tuning.schedules`.  See
``docs/loops.md``.
"""

from kiln.ir.errors import IllegalTransformError, ParseError, ScheduleError
from kiln.ir.loops import (
    Annotation, Binary, Buffer, Call, Cast, Const, Expr, If, Load, Loop, Param, Program, Reduce, Select, Store,
    Unary, Var, format_program, parse_program,
)
from kiln.ir.loops.cfront import from_c
from kiln.ir.loops.cgen import to_c
from kiln.ir.loops.interp import run
from kiln.backends.cpu.native import NativeKernel, compile_c
from kiln.ir.poly import Dependence, Instance, Verdict, Violation
from kiln.ir.poly.deps import Proof
from kiln.passes.schedule import (
    PRIMITIVES, NodeInfo, Schedule, Step, applicable, candidate_steps, nodes, random_legal_sequence, random_sequence,
)
from kiln.tuning.schedules import export_dataset, measure_runtime

parse = parse_program
"""Read the loop-IR text form."""

__all__ = [
    "Annotation", "Binary", "Buffer", "Call", "Cast", "Const", "Dependence", "Expr", "If", "IllegalTransformError",
    "Instance", "Load", "Loop", "NativeKernel", "NodeInfo", "PRIMITIVES", "Param", "ParseError", "Program", "Proof",
    "Reduce",
    "Schedule", "ScheduleError", "Select", "Step", "Store", "Unary", "Var", "Verdict", "Violation", "applicable",
    "candidate_steps", "compile_c", "export_dataset", "format_program", "from_c", "measure_runtime", "nodes",
    "parse", "parse_program", "random_legal_sequence", "random_sequence", "run", "to_c",
]
