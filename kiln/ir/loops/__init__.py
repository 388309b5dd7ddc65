"""The loop-level IR: buffers, a tree of loops and statements, and what reads and runs it.

* :mod:`.expr` -- expressions; :mod:`.program` -- loops, statements, programs;
* :mod:`.text` -- the canonical text form (``format_program`` / ``parse_program``);
* :mod:`.interp` -- a numpy interpreter (``run``);
* :mod:`.cfront` -- ``from_c``: a PolyBench-style C subset;
* :mod:`.cgen` -- ``to_c`` and :class:`~.cgen.CStylePrinter`, the base of every C-family
  printer (the cpu backend's OpenMP printer is one).

The IR only prints C; building and running it natively is the cpu backend's
(:mod:`kiln.backends.cpu.native`, ``compile_c``).

Nothing here imports islpy at module level; the polyhedral view lives in :mod:`kiln.ir.poly`.
"""

from .expr import (
    INDEX, MATH_FUNCS, Affine, Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var,
    affine_expr, affine_form, as_expr, dtype_of, free_vars, loads_of, map_expr, substitute, walk,
)
from .program import (
    ANNOTATIONS, COMBINERS, SCOPES, SERIAL, Annotation, Buffer, If, Loop, Node, Param, Program, Reduce,
    Statement, Store, verify_program,
)
from .text import format_expr, format_program, parse_expr, parse_program

__all__ = [
    "ANNOTATIONS", "Affine", "Annotation", "Binary", "Buffer", "COMBINERS", "Call", "Cast", "Const", "Expr",
    "INDEX", "If", "Load", "Loop", "MATH_FUNCS", "Node", "Param", "Program", "Reduce", "SCOPES", "SERIAL",
    "Select", "Statement", "Store", "Unary", "Var", "affine_expr", "affine_form", "as_expr", "dtype_of",
    "format_expr", "format_program", "free_vars", "loads_of", "map_expr", "parse_expr", "parse_program",
    "substitute", "verify_program", "walk",
]
