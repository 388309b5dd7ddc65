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
returns the verdict of the current schedule at any time.  ``ranges={"N": (2, 4096)}``
makes every check symbolic over those parameter ranges: a step is accepted iff it is legal
for every size in range, and a refusal says under which sizes it breaks (see
:class:`~kiln.ir.poly.legality.Verdict`).  The model and the dependences of a program are
computed once per program (:func:`analysis`) and shared by all its schedules, with the
checker's memo: a step re-checks only the statement pairs whose common bands it changed.  :meth:`program` regenerates a loop
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
from collections import OrderedDict
from typing import Any

import islpy as isl

from kiln.ir.errors import IllegalTransformError, ScheduleError
from kiln.ir.loops.program import Annotation, Program
from kiln.ir.poly.affine import plain_name
from kiln.ir.poly.astgen import generate
from kiln.ir.poly.deps import Dependences, compute_dependences
from kiln.ir.poly.legality import Ranges, Verdict, checker_for, normalize_ranges
from kiln.ir.poly.model import PolyModel, build_model
from kiln.ir.poly.tree import (
    TreeNode, bands, format_tree, initial_tree, is_split, leaves, statements_under, time_maps,
)

from . import band_ops, producer_consumer, tree_ops

PRIMITIVES = ("interchange", "tile", "split", "skew", "transform", "scale", "reverse", "shift", "split_at",
              "fuse", "full_fuse", "fission", "full_split", "parallel", "vectorize", "unroll", "map_to", "serial",
              "compute_at", "inline")

_ANALYSES: OrderedDict[Program, tuple[PolyModel, list]] = OrderedDict()
_ANALYSES_LIMIT = 64


def analysis(program: Program) -> tuple[PolyModel, Dependences | None]:
    """The polyhedral model of ``program`` and, once computed, its dependences: cached per
    program (by value), so every schedule of one program shares them and the checker's memo."""
    hit = _ANALYSES.get(program)
    if hit is None:
        hit = (build_model(program), [None])
        _ANALYSES[program] = hit
        while len(_ANALYSES) > _ANALYSES_LIMIT:
            _ANALYSES.popitem(last=False)
    else:
        _ANALYSES.move_to_end(program)
    return hit[0], hit[1][0]


def _program_dependences(program: Program, model: PolyModel) -> Dependences:
    hit = _ANALYSES.get(program)
    if hit is None or hit[0] is not model:
        return compute_dependences(model)
    if hit[1][0] is None:
        hit[1][0] = compute_dependences(model)
    return hit[1][0]


class Schedule:
    """Transformations of one loop program; see the module docstring."""

    def __init__(self, program: Program, check: bool = True, ranges: dict[str, tuple[int, int]] | None = None):
        self.original = program
        self.check = check
        self._model, self._deps = analysis(program)
        self._tree: TreeNode = initial_tree(self._model)
        self._broken: Verdict | None = None
        self.ranges: Ranges = normalize_ranges(self._model, ranges)
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
            self._deps = _program_dependences(self.original, self._model)
        return self._deps

    def copy(self) -> Schedule:
        """An independent schedule sharing this one's (immutable) model and dependences."""
        other = Schedule.__new__(Schedule)
        other.__dict__.update(self.__dict__)
        other.trace = [dict(step) for step in self.trace]
        return other

    def restore(self, snapshot: Schedule) -> Schedule:
        """Go back to ``snapshot``, a :meth:`copy` of this schedule taken earlier: a strategy
        that applies several steps as one unit undoes them all when one of them is refused."""
        if snapshot.original is not self.original:
            raise ScheduleError("restore: the snapshot is of another program")
        self.__dict__.update(snapshot.copy().__dict__)
        return self

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
    def verify(self, ranges: dict[str, tuple[int, int]] | None = None) -> Verdict:
        """Whether the current schedule (parallel marks included) is legal, and if not, the
        dependence it breaks; symbolic over ``ranges`` (default: the schedule's own)."""
        if self._broken is not None:
            return self._broken
        rng = self.ranges if ranges is None else normalize_ranges(self._model, ranges)
        return checker_for(self._model, self.dependences).check(self._tree, rng)

    def proof(self) -> Any:
        """The :class:`~kiln.ir.poly.deps.Proof` of the current (legal) schedule."""
        return self.verify().proof()

    def _commit(self, primitive: str, args: dict[str, Any], tree: TreeNode) -> Schedule:
        if self.check:
            verdict = checker_for(self._model, self.dependences).check(tree, self.ranges)
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
        """Add ``factor`` times loop ``source``'s schedule to loop ``target``'s, for the
        statements under both; ``source`` may enclose ``target`` or be inside it.

        ``for i { for j { S(i, j) } }`` with ``skew("j", "i", 1)`` ->
        ``for i { for j in [i + lo, i + hi) { S(i, j - i) } }``; ``skew("i", "j", 1)`` makes
        the outer loop run over ``i + j``."""
        args = {"target": target, "source": source, "factor": factor}
        return self._commit("skew", args, band_ops.skew(self._tree, target, source, factor))

    def transform(self, loops: list[str], matrix: list[list[int]]) -> Schedule:
        """Replace the perfectly nested ``loops`` by ``matrix * loops`` (a unimodular integer
        matrix: interchange, skew and reversal are special cases).

        ``transform(["i", "j"], [[1, 1], [0, 1]])``: the outer loop runs over ``i + j``."""
        args = {"loops": list(loops), "matrix": [list(r) for r in matrix]}
        return self._commit("transform", args, band_ops.transform(self._tree, list(loops), args["matrix"]))

    def scale(self, loop: str, factor: int) -> Schedule:
        """Multiply ``loop``'s schedule by ``factor`` (the loop gets stride ``|factor|``)."""
        return self._commit("scale", {"loop": loop, "factor": factor}, band_ops.scale(self._tree, loop, factor))

    def reverse(self, loop: str) -> Schedule:
        """Run ``loop`` backwards."""
        return self._commit("reverse", {"loop": loop}, tree_ops.reverse(self._tree, loop))

    def shift(self, loop: str, statement: str | None, offset: int | str) -> Schedule:
        """Delay ``statement``'s instances (every statement's when ``None``) by ``offset``
        iterations of ``loop``; ``offset`` is an integer or affine text over the statement's
        iterators and the size parameters (``"N"``, ``"2 * j"``)."""
        args = {"loop": loop, "statement": statement, "offset": offset}
        return self._commit("shift", args, band_ops.shift(self._tree, self._model, loop, statement, offset))

    def split_at(self, loop: str, value: int | str) -> Schedule:
        """Index-set splitting: iterations of ``loop`` below ``value`` run in a first copy of
        the loop, the rest in a second copy ``<loop>_b`` (inner loops renamed ``<name>_b``).

        ``for i in [0, N) {S}`` with ``split_at("i", 4)`` ->
        ``for i in [0, min(N, 4)) {S}  for i_b in [4, N) {S}``."""
        args = {"loop": loop, "value": value}
        return self._commit("split_at", args, band_ops.split_at(self._tree, self._model, loop, value))

    # ================================================================= structure
    def fuse(self, a: str, b: str) -> Schedule:
        """Merge loop ``b`` into loop ``a``, a later loop of the same sequence; ``b``'s body
        runs after ``a``'s in each iteration.  ``for i {S} for i2 {T}`` -> ``for i {S; T}``."""
        return self._commit("fuse", {"a": a, "b": b}, tree_ops.fuse(self._tree, a, b))

    def full_fuse(self, loop: str) -> Schedule:
        """Fuse every loop of the sequence holding ``loop`` into one, named after the first."""
        return self._commit("full_fuse", {"loop": loop}, tree_ops.full_fuse(self._tree, loop))

    def fission(self, loop: str, split_before_child: int | str) -> Schedule:
        """Split ``loop`` in two before a child (index, statement or loop name); the second
        loop is named ``<loop>_b``.  ``for i {S; T}`` -> ``for i {S} for i_b {T}``."""
        args = {"loop": loop, "split_before_child": split_before_child}
        return self._commit("fission", args, tree_ops.fission(self._tree, loop, split_before_child, self._model))

    def full_split(self, loop: str) -> Schedule:
        """One copy of ``loop`` per child of its sequence: ``for i {S; T; U}`` ->
        ``for i {S} for i_b {T} for i_b_1 {U}``."""
        return self._commit("full_split", {"loop": loop}, tree_ops.full_split(self._tree, loop, self._model))

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
        self._whole("compute_at", statement)
        tree = producer_consumer.compute_at(self._model, self.dependences, self._tree, statement, loop)
        return self._commit("compute_at", {"statement": statement, "loop": loop}, tree)

    def inline(self, statement: str) -> Schedule:
        """Replace every read of the local buffer ``statement`` stores to by its expression,
        and remove ``statement``."""
        self._whole("inline", statement)
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

    def _whole(self, primitive: str, statement: str) -> None:
        self._model.statement(statement)
        if is_split(self._tree, statement):
            raise ScheduleError(f"{primitive}: statement {statement} runs in pieces after split_at; {primitive} "
                                f"moves whole statements -- apply it before split_at")

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

    def loop_instances(self, loop: str, params: dict[str, int]) -> set[tuple[str, tuple[int, ...]]]:
        """For fixed size parameters, the statement instances that run inside ``loop`` (after
        ``split_at``, only the pieces below it)."""
        _, path = tree_ops.find_band(self._tree, loop, "loop_instances")
        out: set[tuple[str, tuple[int, ...]]] = set()
        for leaf, leaf_path in leaves(self._tree):
            if leaf_path[:len(path)] != path:
                continue
            dom = self._model.statements[leaf.stmt].domain if leaf.domain is None else leaf.domain
            fixed = _fix_params(dom, params)
            n = fixed.dim(isl.dim_type.set)

            def add(pt: isl.Point, stmt=leaf.stmt, n=n) -> None:
                out.add((stmt, tuple(pt.get_coordinate_val(isl.dim_type.set, i).to_python() for i in range(n))))

            fixed.foreach_point(add)
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
    def replay(cls, program: Program, trace: list[dict[str, Any]] | str, check: bool = True,
               ranges: dict[str, tuple[int, int]] | None = None) -> Schedule:
        """A new schedule of ``program`` with the steps of ``trace`` (a list or its JSON) applied
        (each checked over ``ranges``, as in the constructor)."""
        steps = json.loads(trace) if isinstance(trace, str) else trace
        s = cls(program, check=check, ranges=ranges)
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


def _fix_params(m: isl.Map | isl.Set, params: dict[str, int]) -> isl.Map | isl.Set:
    n = m.dim(isl.dim_type.param)
    for i in range(n):
        name = m.get_dim_name(isl.dim_type.param, i)
        if plain_name(name) not in params:
            raise ValueError(f"no value for size parameter '{plain_name(name)}'")
        m = m.fix_val(isl.dim_type.param, i, isl.Val(int(params[plain_name(name)])))
    return m
