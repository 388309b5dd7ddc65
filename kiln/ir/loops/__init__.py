"""The loop-level IR: buffers, a tree of loops and statements, and what reads and runs it.

* :mod:`.expr` -- expressions; :mod:`.program` -- loops, statements, programs, and the
  constructs of GPU kernels (task loops, barriers, shuffles, vector copies);
* :mod:`.mapping` -- task mappings (``spatial``, ``repeat``, composed with ``*``);
  :mod:`.tasks` -- their lowering to index arithmetic;
* :mod:`.gpu` -- the kernel form (launch, verifier); :mod:`.emulate` -- kernels on the host;
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
from .tasks import lower_mappings
from .gpu import (
    Launch, block_loops, kernel_body, kernel_launch, linear_thread, shared_bytes, thread_loops, verify_kernel,
)
from .emulate import emulate
from .mapping import TaskIteration, TaskMapping, auto_map, repeat, spatial
from .program import (
    ANNOTATIONS, COMBINERS, SCOPES, SERIAL, SHUFFLE_MODES, WARP_SIZE, Action, Annotation, Barrier, Buffer,
    CopyCommit, CopyWait, If, Loop, Node, map_nodes, Param, Program, Reduce, Shuffle, Statement, Store, Sync, TaskLoop,
    VectorCopy, verify_program,
)
from .text import format_expr, format_program, parse_expr, parse_program

__all__ = [
    "Action", "Barrier", "CopyCommit", "CopyWait", "SHUFFLE_MODES", "Shuffle", "Sync", "TaskIteration",
    "TaskLoop", "TaskMapping", "VectorCopy", "WARP_SIZE", "Launch", "auto_map", "block_loops", "emulate", "kernel_body",
    "kernel_launch", "linear_thread", "shared_bytes", "thread_loops", "verify_kernel", "lower_mappings", "map_nodes", "repeat", "spatial",
    "ANNOTATIONS", "Affine", "Annotation", "Binary", "Buffer", "COMBINERS", "Call", "Cast", "Const", "Expr",
    "INDEX", "If", "Load", "Loop", "MATH_FUNCS", "Node", "Param", "Program", "Reduce", "SCOPES", "SERIAL",
    "Select", "Statement", "Store", "Unary", "Var", "affine_expr", "affine_form", "as_expr", "dtype_of",
    "format_expr", "format_program", "free_vars", "loads_of", "map_expr", "parse_expr", "parse_program",
    "substitute", "verify_program", "walk",
]
