"""``Schedule``: loop transformations of a loop program, each checked for legality first.

A schedule starts as the program's own loop structure (a schedule tree, see
:mod:`kiln.ir.poly.tree`).  Primitives rewrite the tree; with ``check=True`` (the default)
every primitive first checks, exactly and with isl, that the rewritten schedule keeps every
dependence of the program in order and that every loop marked parallel, vectorized or
mapped carries no dependence.  An illegal step raises
:class:`~kiln.ir.errors.IllegalTransformError` whose ``explanation`` names the dependence it
would break, and leaves the schedule unchanged.  A misapplied primitive (unknown loop, loops
not perfectly nested, bad factor) raises :class:`~kiln.ir.errors.ScheduleError`.

With ``check=False`` (research mode) primitives apply without checking; :meth:`verify`
returns the verdict of the current schedule at any time.  :meth:`program` regenerates a loop
program from the schedule through isl's AST generator.  Every applied step is appended to
``trace`` (JSON-ready dicts); :meth:`Schedule.replay` re-applies a trace to a program.

Example (gemm, loops ``i``, ``j``, ``k``)::

    s = Schedule(program)
    s.tile(["i", "j"], [32, 32])      # loops: i_tile, j_tile, i, j, k
    s.interchange("j", "k")           # loops: i_tile, j_tile, i, k, j
    s.parallel("i_tile")
    s.vectorize("j")
    fast = s.program()
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import islpy as isl

from kiln.ir.errors import IllegalTransformError, ScheduleError
from kiln.ir.loops.program import Annotation, Program
from kiln.ir.poly.affine import plain_name
from kiln.ir.poly.astgen import generate
from kiln.ir.poly.deps import Dependences, compute_dependences
from kiln.ir.poly.legality import Verdict, check_schedule
from kiln.ir.poly.model import PolyModel, build_model
from kiln.ir.poly.tree import TreeNode, bands, format_tree, initial_tree, statements_under, time_maps

from . import producer_consumer, tree_ops

PRIMITIVES = ("interchange", "tile", "split", "skew", "reverse", "shift", "fuse", "fission", "parallel",
              "vectorize", "unroll", "map_to", "serial", "compute_at", "inline")


class Schedule:
    """Transformations of one loop program; see the module docstring."""

    def __init__(self, program: Program, check: bool = True):
        self.original = program
        self.check = check
        self._model: PolyModel = build_model(program)
        self._tree: TreeNode = initial_tree(self._model)
        self._deps: Dependences | None = None
        self._broken: Verdict | None = None
        self.trace: list[dict[str, Any]] = []

    # ================================================================= state
    @property
    def model(self) -> PolyModel:
        return self._model

    @property
    def tree(self) -> TreeNode:
        return self._tree

    @property
    def dependences(self) -> Dependences:
        """Every dependence of the program (computed once, on first use)."""
        if self._deps is None:
            self._deps = compute_dependences(self._model)
        return self._deps

    def copy(self) -> Schedule:
        """An independent schedule sharing this one's (immutable) model and dependences."""
        other = Schedule.__new__(Schedule)
        other.__dict__.update(self.__dict__)
        other.trace = [dict(step) for step in self.trace]
        return other

    def loops(self) -> list[str]:
        """Loop (band) names, outer to inner, in program order."""
        return tree_ops.loop_names(self._tree)

    def statements(self) -> list[str]:
        return statements_under(self._tree)

    def loop_statements(self, loop: str) -> list[str]:
        band, _ = tree_ops.find_band(self._tree, loop, "loop_statements")
        return statements_under(band)

    def annotation(self, loop: str) -> Annotation:
        band, _ = tree_ops.find_band(self._tree, loop, "annotation")
        return band.annotation

    def __str__(self) -> str:
        return format_tree(self._tree)

    # ================================================================= checking
    def verify(self) -> Verdict:
        """Whether the current schedule (parallel marks included) is legal, and if not, the
        dependence it breaks."""
        if self._broken is not None:
            return self._broken
        return check_schedule(self._model, self.dependences, self._tree)

    def _commit(self, primitive: str, args: dict[str, Any], tree: TreeNode) -> Schedule:
        if self.check:
            verdict = check_schedule(self._model, self.dependences, tree)
            if not verdict:
                call = ", ".join(f"{k}={v!r}" for k, v in args.items())
                raise IllegalTransformError(f"{primitive}({call}) is illegal: {verdict.explanation}",
                                            verdict.violation)
        self._tree = tree
        self.trace.append({"primitive": primitive, "args": args})
        return self

    # ================================================================= loop order
    def interchange(self, a: str, b: str) -> Schedule:
        """Swap two perfectly nested loops (any bands on one chain without statements between).

        ``for i { for j { S } }`` -> ``for j { for i { S } }``."""
        return self._commit("interchange", {"a": a, "b": b}, tree_ops.interchange(self._tree, a, b))

    def tile(self, loops: list[str], sizes: list[int]) -> Schedule:
        """Tile perfectly nested ``loops`` (outer to inner) by ``sizes``; tiles start at 0.

        ``for i { for j { S } }`` with sizes ``[4, 8]`` ->
        ``for i_tile { for j_tile { for i { for j { S } } } }`` where ``i_tile = floor(i/4)``
        and ``i`` runs over its tile.  Tile again for more levels (``i_tile`` -> ``i_tile_tile``)."""
        args = {"loops": list(loops), "sizes": list(sizes)}
        return self._commit("tile", args, tree_ops.tile(self._tree, list(loops), list(sizes)))

    def split(self, loop: str, factor: int) -> Schedule:
        """Strip-mine ``loop`` into ``<loop>_o = floor(loop/factor)`` and ``<loop>_i = loop mod factor``.

        ``for i { S(i) }`` -> ``for i_o { for i_i in [0, factor) { S(factor*i_o + i_i) } }``."""
        return self._commit("split", {"loop": loop, "factor": factor}, tree_ops.split(self._tree, loop, factor))

    # ================================================================= affine changes
    def skew(self, target: str, source: str, factor: int = 1) -> Schedule:
        """Add ``factor`` times the enclosing loop ``source`` to loop ``target``'s schedule.

        ``for i { for j { S(i, j) } }`` with ``skew("j", "i", 1)`` ->
        ``for i { for j in [i + lo, i + hi) { S(i, j - i) } }``."""
        args = {"target": target, "source": source, "factor": factor}
        return self._commit("skew", args, tree_ops.skew(self._tree, target, source, factor))

    def reverse(self, loop: str) -> Schedule:
        """Run ``loop`` backwards."""
        return self._commit("reverse", {"loop": loop}, tree_ops.reverse(self._tree, loop))

    def shift(self, loop: str, statement: str, offset: int) -> Schedule:
        """Delay ``statement``'s instances by ``offset`` iterations of ``loop``."""
        args = {"loop": loop, "statement": statement, "offset": offset}
        return self._commit("shift", args, tree_ops.shift(self._tree, loop, statement, offset))

    # ================================================================= structure
    def fuse(self, a: str, b: str) -> Schedule:
        """Merge loop ``b`` into the loop ``a`` it directly follows; ``b``'s body runs after ``a``'s
        in each iteration.  ``for i {S} for i2 {T}`` -> ``for i {S; T}``."""
        return self._commit("fuse", {"a": a, "b": b}, tree_ops.fuse(self._tree, a, b))

    def fission(self, loop: str, split_before_child: int | str) -> Schedule:
        """Split ``loop`` in two before a child (index, statement or loop name); the second
        loop is named ``<loop>_b``.  ``for i {S; T}`` -> ``for i {S} for i_b {T}``."""
        args = {"loop": loop, "split_before_child": split_before_child}
        return self._commit("fission", args, tree_ops.fission(self._tree, loop, split_before_child))

    # ================================================================= annotations
    def parallel(self, loop: str) -> Schedule:
        """Mark ``loop`` parallel; legal iff no dependence is carried by it."""
        return self._annotate("parallel", loop, Annotation("parallel"))

    def vectorize(self, loop: str) -> Schedule:
        """Mark the innermost ``loop`` vectorized; legal iff no dependence is carried by it."""
        return self._annotate("vectorize", loop, Annotation("vectorized"))

    def unroll(self, loop: str, factor: int) -> Schedule:
        """Mark ``loop`` to be unrolled by ``factor`` (always legal: the order is unchanged)."""
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
            raise ScheduleError(f"unroll: the factor must be a positive integer, got {factor!r}")
        return self._annotate("unroll", loop, Annotation("unrolled", factor=factor), factor=factor)

    def map_to(self, loop: str, axis: str) -> Schedule:
        """Map ``loop`` to a hardware axis (``"blockIdx.x"``); legal iff it carries no dependence."""
        if not isinstance(axis, str) or not axis:
            raise ScheduleError(f"map_to: the axis must be a non-empty string, got {axis!r}")
        return self._annotate("map_to", loop, Annotation("mapped", axis=axis), axis=axis)

    def serial(self, loop: str) -> Schedule:
        """Remove ``loop``'s annotation."""
        return self._annotate("serial", loop, Annotation())

    def _annotate(self, primitive: str, loop: str, annotation: Annotation, **extra: Any) -> Schedule:
        tree = tree_ops.annotate(self._tree, loop, annotation, primitive)
        return self._commit(primitive, {"loop": loop, **extra}, tree)

    # ================================================================= producers and consumers
    def compute_at(self, statement: str, loop: str) -> Schedule:
        """Move producer ``statement`` (with its own loops) into consumer ``loop``: each instance
        runs in the first iteration that reads its result.

        ``for i {P: B[i] = f(A[i])} for j {C: D[j] = B[j] + B[j+1]}`` with
        ``compute_at("P", "j")`` -> ``for j { for i in [..] {P} C }``."""
        tree = producer_consumer.compute_at(self._model, self.dependences, self._tree, statement, loop)
        return self._commit("compute_at", {"statement": statement, "loop": loop}, tree)

    def inline(self, statement: str) -> Schedule:
        """Replace every read of the local buffer ``statement`` stores to by its expression,
        and remove ``statement``."""
        times = time_maps(self._tree, self._model)
        try:
            model, tree = producer_consumer.inline(self._model, self._tree, times, statement)
        except IllegalTransformError as e:
            if self.check:
                raise
            model, tree = producer_consumer.inline(self._model, self._tree, times, statement, enforce=False)
            self._broken = Verdict(False, e.violation)
        self._model, self._tree = model, tree
        self._deps = compute_dependences(model, tree)
        self.trace.append({"primitive": "inline", "args": {"statement": statement}})
        return self

    # ================================================================= results
    def program(self, name: str | None = None, atomic: bool = True) -> Program:
        """The loop program this schedule describes, generated with isl (``atomic``: one copy
        of each statement per loop level, see :func:`kiln.ir.poly.astgen.generate`)."""
        return generate(self._model, self._tree, name, atomic)

    def instance_times(self, params: dict[str, int]) -> dict[str, dict[tuple[int, ...], tuple[int, ...]]]:
        """For fixed size parameters, every statement instance and its time vector."""
        out: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
        for stmt, m in time_maps(self._tree, self._model).items():
            fixed = _fix_params(m, params)
            n_in = fixed.dim(isl.dim_type.in_)
            points: dict[tuple[int, ...], tuple[int, ...]] = {}

            def add(pt: isl.Point, points=points, n_in=n_in, n=fixed.dim(isl.dim_type.out)) -> None:
                vals = [pt.get_coordinate_val(isl.dim_type.set, i).to_python() for i in range(n_in + n)]
                points[tuple(vals[:n_in])] = tuple(vals[n_in:])

            fixed.wrap().foreach_point(add)
            out[stmt] = points
        return out

    def parallel_loops(self) -> dict[str, int]:
        """Loops marked parallel/vectorized/mapped and their time-vector positions."""
        return {b.name: len(p) for b, p in bands(self._tree) if b.annotation.is_parallel}

    def loop_dims(self) -> dict[str, int]:
        """Every loop's position in the time vector."""
        return {b.name: len(p) for b, p in bands(self._tree)}

    # ================================================================= traces
    def trace_json(self) -> str:
        return json.dumps(self.trace)

    @classmethod
    def replay(cls, program: Program, trace: list[dict[str, Any]] | str, check: bool = True) -> Schedule:
        """A new schedule of ``program`` with the steps of ``trace`` (a list or its JSON) applied."""
        steps = json.loads(trace) if isinstance(trace, str) else trace
        s = cls(program, check=check)
        for step in steps:
            s.apply(step["primitive"], **step["args"])
        return s

    def apply(self, primitive: str, **args: Any) -> Schedule:
        """Apply a primitive by name (what traces and search use)."""
        if primitive not in PRIMITIVES:
            raise ScheduleError(f"unknown primitive '{primitive}'; primitives: {', '.join(PRIMITIVES)}")
        method = getattr(self, primitive)
        try:
            inspect.signature(method).bind(**args)
        except TypeError as e:
            raise ScheduleError(f"{primitive}: bad arguments {args}: {e}") from None
        return method(**args)


def _fix_params(m: isl.Map, params: dict[str, int]) -> isl.Map:
    n = m.dim(isl.dim_type.param)
    for i in range(n):
        name = m.get_dim_name(isl.dim_type.param, i)
        if plain_name(name) not in params:
            raise ValueError(f"no value for size parameter '{plain_name(name)}'")
        m = m.fix_val(isl.dim_type.param, i, isl.Val(int(params[plain_name(name)])))
    return m
