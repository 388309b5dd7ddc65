"""Data selects whose branches the cpu backend's printer evaluates unconditionally.

``c ? expf(x) : 0`` (an attention mask applied to a softmax) keeps GCC from vectorizing its
loop: it may not speculate the call.  When both branches are safe to run whatever the
condition (:func:`speculable`), :class:`~kiln.backends.cpu.codegen.KernelPrinter` prints
``kiln_blend_f32(c, expf(x), 0)`` instead, an inline function whose arguments are all
evaluated, and the loop vectorizes (GPT-2's masked attention softmax in a training step:
0.54 -> 0.1 ms).
"""

from __future__ import annotations

from collections.abc import Callable

from kiln.ir.loops.expr import Binary, Call, Expr, Load, Select, Var, walk
from kiln.ir.types import DType

BLEND = {DType.float32: "kiln_blend_f32", DType.float64: "kiln_blend_f64"}
BLEND_HELPERS = ("static inline float kiln_blend_f32(int c, float a, float b) { return c ? a : b; }\n"
                 "static inline double kiln_blend_f64(int c, double a, double b) { return c ? a : b; }\n")
"""A data select whose branches call math functions is printed as a call of these (both
branches evaluated, then blended): ``c ? expf(x) : 0`` keeps GCC from vectorizing (a call
it may not speculate), ``kiln_blend_f32(c, expf(x), 0)`` vectorizes."""


def speculable(e: Select, dtype: Callable[[Expr], DType]) -> bool:
    """Whether both branches of ``e`` may run whatever its condition: the condition reads
    no loop iterator outside a load (it is data, such as an attention mask, not a bounds
    guard), no load in a branch has a data-dependent index, no branch divides integers
    (which could trap), and a branch calls a math function (the case worth it)."""
    def guards(x: Expr) -> bool:
        return isinstance(x, Var) or (not isinstance(x, Load) and any(guards(c) for c in x.children()))

    inside = [x for b in (e.if_true, e.if_false) for x in walk(b)]
    return (not guards(e.cond) and any(isinstance(x, Call) for x in inside)
            and not any(isinstance(y, Load) for x in inside if isinstance(x, Load) for i in x.indices for y in walk(i))
            and not any(isinstance(x, Binary) and x.op in ("/", "%", "floordiv", "floormod") and dtype(x).is_integer
                        for x in inside))


__all__ = ["BLEND", "BLEND_HELPERS", "speculable"]
