"""Triton kernels for pointwise, reduction and general loop programs (one per phase).

Each phase of a lowered program (:func:`.analysis.phases`) becomes one ``@triton.jit``
function:

* the phase's band is flattened into ``XNUMEL`` lanes; program ``p`` runs lanes
  ``[p * XBLOCK, (p + 1) * XBLOCK)`` (``xmask`` masks the ragged tail) and recovers each band
  iterator from the flat lane index by ``//`` and ``%`` of the static extents;
* a phase without inner loops is **pointwise**: every statement is one masked vector
  operation over ``[XBLOCK]`` lanes;
* otherwise lanes are ``[XBLOCK, 1]`` and every vector nest (:func:`.analysis.vector_nest`) is
  a second block axis of ``R<k>_BLOCK`` lanes: **persistent** when ``R<k>_BLOCK`` covers the
  nest's extent (one block, row reductions with ``tl.sum``/``tl.max``/``tl.min`` over axis
  1), **looped** otherwise (an ``[XBLOCK, R<k>_BLOCK]`` accumulator combined chunk by chunk,
  reduced once after the loop).  Both variants are in the source behind a ``constexpr``
  test, so the configuration picks one at launch.  Nested loops are flattened into the
  nest's axis; bounds that vary per lane are masked;
* loops that are not vector nests run **sequentially** (a Triton ``for`` over the
  iterator, every lane at once): the general fallback for programs matching no template.

Registers are loop-carried Triton variables initialized at the top of the kernel; scratch
buffers are pointer arguments like the kernel's own buffers.  Memory written in a phase and
read again later in it is fenced with ``tl.debug_barrier()`` (lanes of a block may live in
different threads), at the top of every sequential iteration that reads and writes memory.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field

from kiln.ir.loops import If, Loop, Program
from kiln.ir.loops.expr import Binary, Const
from kiln.ir.loops.program import Reduce, Store
from kiln.ir.ops.compute import simplify_index
from kiln.ir.types import DType

from .analysis import (
    Phase,
    UnsupportedProgram,
    VectorNest,
    accesses,
    has_loops,
    loop_extent,
    product,
    read_buffers,
    statements,
    vector_nest,
    written_buffers,
)
from .printer import TL_DTYPES, ExprPrinter, Guard, Printed, Scope, as_tensor, conj, guard_and, literal_text

INT32_LIMIT = 2**31 - 1


@dataclass
class JitKernel:
    """One ``@triton.jit`` function and the statements of the launch function that run it
    (``ptrs`` names its pointer arguments, ``cfg`` the chosen configuration)."""

    name: str
    text: str
    launch: list[str]
    kind: str
    blocks: dict[str, int] = field(default_factory=dict)
    """Extents the launch clamps blocks to (``XBLOCK`` -> lanes, ``R0_BLOCK`` -> nest extent)."""


def python_name(name: str, prefix: str) -> str:
    """``name`` usable as a Python variable (keywords and dunder-like names get ``prefix``)."""
    if keyword.iskeyword(name) or name.startswith("_") or name in ("tl", "triton", "libdevice"):
        return f"{prefix}{name}"
    return name


@dataclass
class _Ctx:
    scope: Scope
    cond: Guard
    indent: int
    ranges: dict[str, tuple[int, int]]
    outer: set[str]


class RowKernel:
    """Emits the kernels of one program's phases (module docstring).  ``pointers`` maps
    every global and scratch buffer to its pointer parameter, in parameter order."""

    def __init__(self, program: Program, printer: ExprPrinter, name: str, pointers: dict[str, str]):
        self.program = program
        self.printer = printer
        self.name = name
        self.pointers = pointers
        self.buffers = {b.name: b for b in program.buffers}
        self.lines: list[str] = []
        self.temp = 0
        self.nests = 0
        self.dirty: set[str] = set()
        self.lanes = "[XBLOCK]"
        self.blocks: dict[str, int] = {}
        self.sequential = 0

    # ------------------------------------------------------------------ helpers
    def emit(self, ctx_or_indent, text: str) -> None:
        indent = ctx_or_indent if isinstance(ctx_or_indent, int) else ctx_or_indent.indent
        self.lines.append("    " * indent + text)

    def fresh(self, hint: str = "t") -> str:
        self.temp += 1
        return f"_{hint}{self.temp}"

    def begin(self) -> None:
        self.printer.begin_statement()

    def flush(self, ctx_or_indent) -> None:
        """Emit the loads hoisted out of the statement being printed (one per distinct cell)."""
        for var, text in self.printer.end_statement():
            self.emit(ctx_or_indent, f"{var} = {text}")

    def fence(self, ctx: _Ctx, nodes) -> None:
        """A barrier before ``nodes`` when they read memory written earlier in the phase."""
        if self.dirty & read_buffers(nodes):
            self.emit(ctx, "tl.debug_barrier()")
            self.dirty.clear()

    # ------------------------------------------------------------------ a phase
    def phase(self, phase: Phase, registers: dict[str, str]) -> JitKernel:
        self.lines, self.dirty, self.nests, self.blocks = [], set(), 0, {}
        two_d = has_loops(phase.body)
        self.lanes = "[XBLOCK, 1]" if two_d else "[XBLOCK]"
        xnumel = phase.xnumel
        name = f"{self.name}_{phase.index}"
        params = ", ".join(self.pointers.values())
        self.sequential = 0
        band = ", ".join(f"{lp.iterator} in [{lp.lower}, {lp.upper})" for lp in phase.band) or "none"
        self.emit(0, f"# phase {phase.index}: band {band}, {xnumel} lanes")
        header_at = len(self.lines)
        self.emit(1, "xoffset = tl.program_id(0) * XBLOCK")
        arange = "tl.arange(0, XBLOCK)[:, None]" if two_d else "tl.arange(0, XBLOCK)"
        self.emit(1, f"xindex = xoffset + {arange}")
        if self._needs_int64():
            self.emit(1, "xindex = xindex.to(tl.int64)")
        self.emit(1, f"xmask = xindex < {xnumel}")
        vars_: dict[str, tuple[str, int]] = {}
        inner = 1
        for lp in reversed(phase.band):
            trips = (int(lp.upper.value) - int(lp.lower.value) + lp.step - 1) // lp.step
            flat = "xindex" if inner == 1 else f"(xindex // {inner})"
            value = flat if lp is phase.band[0] else f"{flat} % {trips}"
            lower = int(lp.lower.value)
            if lp.step != 1:
                value = f"{lp.step} * ({value})"
            if lower:
                value = f"{lower} + {value}"
            var = python_name(lp.iterator, "it_")
            self.emit(1, f"{var} = {value}")
            vars_[lp.iterator] = (var, 1)
            inner *= trips
        self.emit(1, f"xzero = tl.full({self.lanes}, 0, tl.int32)")
        zero_at = len(self.lines) - 1
        for buf, var in registers.items():
            if not _stored_first(phase.body, buf):  # else its first store defines it
                self.emit(1, f"{var} = tl.full({self.lanes}, 0, {TL_DTYPES[self.buffers[buf].dtype]})")
        scope = Scope(vars_, self.buffers, self.pointers, registers, {}, lane_mask="xmask", mask=None,
                      pads={1: "xzero"}, ranges=phase.band_ranges())
        ctx = _Ctx(scope, None, 1, phase.band_ranges(), set(phase.band_vars))
        self.nodes(phase.body, ctx)
        if not any("xzero" in line for line in self.lines[zero_at + 1:]):
            del self.lines[zero_at]
        kind = "pointwise" if not two_d else ("reduction" if self.sequential == 0 else "general")
        constexprs = ", ".join(["XBLOCK: tl.constexpr", *(f"{b}: tl.constexpr" for b in self.blocks)])
        self.lines.insert(header_at, f"def {name}({params}, {constexprs}):")
        self.lines.insert(header_at, "@triton.jit")
        launch = [f"{b} = _rblock(cfg, {extent})" for b, extent in self.blocks.items()]
        launch.append(f"XBLOCK = _xblock(cfg, {xnumel}, ({''.join(b + ', ' for b in self.blocks)}))")
        blocks = ", ".join(["XBLOCK=XBLOCK", *(f"{b}={b}" for b in self.blocks)])
        launch.append(f"{name}[(triton.cdiv({xnumel}, XBLOCK),)](*ptrs, {blocks}, num_warps=cfg['num_warps'])")
        return JitKernel(name, "\n".join(self.lines), launch, kind, {"XBLOCK": xnumel, **self.blocks})

    def _needs_int64(self) -> bool:
        return any(product(int(d.value) for d in b.shape) > INT32_LIMIT for b in self.program.buffers)

    # ------------------------------------------------------------------ nodes (lane context)
    def nodes(self, nodes, ctx: _Ctx) -> None:
        for node in nodes:
            self.fence(ctx, [node])
            if isinstance(node, Loop):
                nest = vector_nest(node, ctx.outer, ctx.scope.registers)
                if nest is not None:
                    self.vector(nest, ctx)
                else:
                    self.sequential_loop(node, ctx)
            elif isinstance(node, If):
                self.begin()
                c = self.printer.expr(node.cond, ctx.scope, ctx.cond)
                self.flush(ctx)
                if c.is_literal:
                    self.nodes(node.then if c.literal else node.orelse, ctx)
                    continue
                cond = self.printer.truth(c)
                self.nodes(node.then, _replace(ctx, cond=guard_and(ctx.cond, cond, c.cls)))
                if node.orelse:
                    self.nodes(node.orelse, _replace(ctx, cond=guard_and(ctx.cond, f"({cond}) == 0", c.cls)))
            elif isinstance(node, Store):
                self.store(node, ctx)
            elif isinstance(node, Reduce):
                self.reduce(node, ctx)
            else:
                raise UnsupportedProgram(f"loop node {type(node).__name__} has no Triton translation")

    def value(self, node, ctx: _Ctx) -> Printed:
        """A statement's value converted to its buffer's dtype."""
        return self.printer.cast(self.printer.expr(node.value, ctx.scope, ctx.cond), self.buffers[node.buffer].dtype)

    def lane_value(self, p: Printed, dtype: DType) -> str:
        """``p`` (of ``dtype``) as a tensor of the lane shape."""
        if p.is_literal:
            return f"tl.full({self.lanes}, {p.text}, {TL_DTYPES[dtype]})"
        return p.text if p.cls >= 1 else f"({p.text} + tl.full({self.lanes}, 0, {TL_DTYPES[dtype]}))"

    def store(self, node: Store, ctx: _Ctx) -> None:
        dtype = self.buffers[node.buffer].dtype
        self.begin()
        value = self.value(node, ctx)
        reg = ctx.scope.registers.get(node.buffer)
        if reg is not None:
            self.flush(ctx)
            text = self.lane_value(value, dtype)
            self.emit(ctx, f"{reg} = {text}" if ctx.cond is None else f"{reg} = tl.where({ctx.cond[0]}, {text}, {reg})")
            return
        ptr, mask, _ = self.printer.access(node.buffer, node.indices, ctx.scope, ctx.cond)
        self.flush(ctx)
        self.emit(ctx, _store(ptr, as_tensor(value, self.lanes), mask))
        self.dirty.add(node.buffer)

    def reduce(self, node: Reduce, ctx: _Ctx) -> None:
        self.begin()
        value = self.value(node, ctx)
        reg = ctx.scope.registers.get(node.buffer)
        if reg is not None:
            self.flush(ctx)
            combined = combine(node.combiner, reg, value.text)
            self.emit(ctx, f"{reg} = {combined}" if ctx.cond is None
                      else f"{reg} = tl.where({ctx.cond[0]}, {combined}, {reg})")
            return
        ptr, mask, _ = self.printer.access(node.buffer, node.indices, ctx.scope, ctx.cond)
        self.flush(ctx)
        old = self.fresh("old")
        self.emit(ctx, f"{old} = tl.load({ptr}{'' if mask is None else f', mask={mask}, other=0'})")
        self.emit(ctx, _store(ptr, combine(node.combiner, old, as_tensor(value, self.lanes)), mask))
        self.dirty.add(node.buffer)

    # ------------------------------------------------------------------ sequential loops
    def sequential_loop(self, loop: Loop, ctx: _Ctx) -> None:
        self.sequential += 1
        lo_min, hi_max, trips = loop_extent(loop, ctx.ranges)
        if trips == 0:
            return
        var = python_name(loop.iterator, "it_")
        constant = isinstance(loop.lower, Const) and isinstance(loop.upper, Const)
        body_ranges = {**ctx.ranges, loop.iterator: (lo_min, max(lo_min, hi_max - 1))}
        scope = ctx.scope.child(vars=dict(ctx.scope.vars), ranges=body_ranges, forwarded={})
        cond = ctx.cond
        if constant:
            self.emit(ctx, f"for {var} in range({lo_min}, {hi_max}{'' if loop.step == 1 else f', {loop.step}'}):")
            scope.vars[loop.iterator] = (var, 0)
        else:
            k = self.fresh("k")
            self.emit(ctx, f"for {k} in range(0, {trips}):")
            lower = self.printer.expr(loop.lower, ctx.scope, ctx.cond)
            upper = self.printer.expr(loop.upper, ctx.scope, ctx.cond)
            self.emit(ctx.indent + 1, f"{var} = {lower.text} + {loop.step} * {k}" if loop.step != 1
                      else f"{var} = {lower.text} + {k}")
            scope.vars[loop.iterator] = (var, lower.cls)
            cond = guard_and(cond, f"{var} < {upper.text}", max(lower.cls, upper.cls))
        inner = _Ctx(scope, cond, ctx.indent + 1, body_ranges, ctx.outer | {loop.iterator})
        if written_buffers(loop.body) - set(ctx.scope.registers) & read_buffers(loop.body):
            self.emit(inner, "tl.debug_barrier()")
        self.dirty.clear()
        before = len(self.lines)
        self.nodes(loop.body, inner)
        self.dirty |= written_buffers(loop.body) - set(ctx.scope.registers)
        if len(self.lines) == before:
            self.emit(inner, "pass")

    # ------------------------------------------------------------------ vector nests
    def vector(self, nest: VectorNest, ctx: _Ctx) -> None:
        bounds = [loop_extent(lp, ctx.ranges) for lp in nest.loops]
        trips = [t for _, _, t in bounds]
        extent = product(trips)
        if extent == 0:
            return
        k = self.nests
        self.nests += 1
        block = f"R{k}_BLOCK"
        self.blocks[block] = extent
        self.emit(ctx, f"# vector nest {' x '.join(f'{lp.iterator} ({t})' for lp, t in zip(nest.loops, trips))}")
        self.emit(ctx, f"if {block} >= {extent}:  # persistent: the whole extent in one block")
        self.nest_body(nest, ctx, block, extent, trips, bounds, looped=False)
        self.emit(ctx, "else:  # looped: accumulate block by block")
        self.nest_body(nest, ctx, block, extent, trips, bounds, looped=True)
        self.dirty |= written_buffers(nest.body) - set(ctx.scope.registers)

    def nest_body(self, nest: VectorNest, ctx: _Ctx, block: str, extent: int, trips: list[int],
                  bounds: list[tuple[int, int, int]], looped: bool) -> None:
        indent = ctx.indent + 1
        rows = [s for s in statements(nest.body) if nest.reductions.get(id(s))]
        accs: dict[int, str] = {}
        tile = f"[XBLOCK, {block}]"
        if looped:
            for s in rows:
                acc = self.fresh("acc")
                accs[id(s)] = acc
                dt = self.buffers[s.buffer].dtype
                self.emit(indent, f"{acc} = tl.full({tile}, {literal_text(s.identity(dt), dt)}, {TL_DTYPES[dt]})")
            start = self.fresh("roffset")
            self.emit(indent, f"for {start} in range(0, {extent}, {block}):")
            indent += 1
            self.emit(indent, f"rindex = {start} + tl.arange(0, {block})[None, :]")
        else:
            self.emit(indent, f"rindex = tl.arange(0, {block})[None, :]")
        self.emit(indent, f"rmask = rindex < {extent}")
        vars_ = dict(ctx.scope.vars)
        ranges = dict(ctx.ranges)
        masks = ["rmask"]
        inner = 1
        for lp, (lo_min, hi_max, t), j in reversed(list(zip(nest.loops, bounds, range(len(trips))))):
            flat = "rindex" if inner == 1 else f"(rindex // {inner})"
            idx = flat if j == 0 else f"{flat} % {t}"
            lower = self.printer.expr(lp.lower, ctx.scope.child(vars=vars_), ctx.cond)
            value = idx if lp.step == 1 else f"{lp.step} * ({idx})"
            value = value if lower.literal == 0 else f"{lower.text} + {value}"
            var = python_name(lp.iterator, "it_")
            self.emit(indent, f"{var} = {value}")
            vars_[lp.iterator] = (var, 2)
            ranges[lp.iterator] = (lo_min, max(lo_min, hi_max - 1))
            span = simplify_index(Binary("-", lp.upper, lp.lower))
            if not (isinstance(span, Const) and int(span.value) == t * lp.step):
                upper = self.printer.expr(lp.upper, ctx.scope.child(vars=vars_), ctx.cond)
                masks.append(f"({var} < {upper.text})")
            inner *= t
        nest_mask = conj(*masks)
        scope = ctx.scope.child(vars=vars_, ranges=ranges, forwarded={}, mask=conj("xmask", nest_mask),
                                pads={1: "xzero", 2: f"tl.full({tile}, 0, tl.int32)"})
        tctx = _Ctx(scope, ctx.cond, indent, ranges, ctx.outer | {lp.iterator for lp in nest.loops})
        self.nest_nodes(nest, nest.body, tctx, nest_mask, accs, tile)
        if looped:
            for s in rows:
                total = f"{self.reducer(s.combiner, accs[id(s)])}[:, None]"
                self.row_result(s, total, _Ctx(ctx.scope, None, indent - 1, ctx.ranges, ctx.outer))

    def nest_nodes(self, nest: VectorNest, nodes, ctx: _Ctx, nest_mask: str, accs: dict[int, str], tile: str) -> None:
        for node in nodes:
            if isinstance(node, If):
                self.begin()
                c = self.printer.expr(node.cond, ctx.scope, ctx.cond)
                self.flush(ctx)
                if c.is_literal:
                    self.nest_nodes(nest, node.then if c.literal else node.orelse, ctx, nest_mask, accs, tile)
                    continue
                cond = self.printer.truth(c)
                self.nest_nodes(nest, node.then, _replace(ctx, cond=guard_and(ctx.cond, cond, c.cls)), nest_mask,
                                accs, tile)
                if node.orelse:
                    self.nest_nodes(nest, node.orelse, _replace(ctx, cond=guard_and(ctx.cond, f"({cond}) == 0", c.cls)),
                                    nest_mask, accs, tile)
                continue
            dt = self.buffers[node.buffer].dtype
            self.begin()
            value = self.value(node, ctx)
            if nest.reductions.get(id(node)):  # a row reduction
                self.flush(ctx)
                keep = conj(nest_mask, ctx.cond[0] if ctx.cond else None)
                ident = literal_text(node.identity(dt), dt)
                masked = f"tl.where({keep}, {value.text}, {ident})"
                if id(node) in accs:
                    acc = accs[id(node)]
                    self.emit(ctx, f"{acc} = {combine(node.combiner, acc, masked)}")
                else:
                    self.row_result(node, f"{self.reducer(node.combiner, masked)}[:, None]",
                                    _Ctx(ctx.scope.child(mask=None), None, ctx.indent, ctx.ranges, ctx.outer))
                continue
            ptr, mask, _ = self.printer.access(node.buffer, node.indices, ctx.scope, ctx.cond)
            self.flush(ctx)
            if isinstance(node, Reduce):  # one cell per iteration: read, combine, write
                old = ctx.scope.forwarded.get((node.buffer, node.indices))
                if old is None:
                    old = self.fresh("old")
                    self.emit(ctx, f"{old} = tl.load({ptr}, mask={mask}, other=0)")
                text = combine(node.combiner, old, value.text)
            else:
                text = as_tensor(value, tile)
            var = self.fresh()
            self.emit(ctx, f"{var} = {text}")
            self.emit(ctx, _store(ptr, var, mask))
            ctx.scope.forwarded[(node.buffer, node.indices)] = var

    def reducer(self, combiner: str, x: str) -> str:
        """``x`` (a block) reduced over its second axis by ``combiner``."""
        if combiner == "*":
            self.printer.helpers.add("_kiln_mul")
        return _REDUCERS[combiner](x)

    def row_result(self, node: Reduce, total: str, ctx: _Ctx) -> None:
        """Combine a row reduction's result (one value per lane) into its target."""
        reg = ctx.scope.registers.get(node.buffer)
        if reg is not None:
            self.emit(ctx, f"{reg} = {combine(node.combiner, reg, total)}")
            return
        ptr, mask, _ = self.printer.access(node.buffer, node.indices, ctx.scope, None)
        old = self.fresh("old")
        self.emit(ctx, f"{old} = tl.load({ptr}{'' if mask is None else f', mask={mask}, other=0'})")
        self.emit(ctx, _store(ptr, combine(node.combiner, old, total), mask))


def _stored_first(body, buffer: str) -> bool:
    """Whether the first node of ``body`` touching ``buffer`` is a plain store to it, at the
    top of the body (outside loops and conditions): that store can define the register."""
    for node in body:
        touched = any(a.buffer == buffer for a in accesses([node]))
        if touched:
            return isinstance(node, Store) and node.buffer == buffer and \
                not any(a.buffer == buffer for a in accesses([node]) if not a.write)
    return False


_REDUCERS = {
    "+": lambda x: f"tl.sum({x}, 1)", "max": lambda x: f"tl.max({x}, 1)", "min": lambda x: f"tl.min({x}, 1)",
    "*": lambda x: f"tl.reduce({x}, 1, _kiln_mul)",
}


def combine(combiner: str, a: str, b: str) -> str:
    """``a`` combined with ``b`` by a reduction's combiner."""
    if combiner == "+":
        return f"{a} + {b}"
    if combiner == "*":
        return f"{a} * ({b})"
    return f"tl.{'maximum' if combiner == 'max' else 'minimum'}({a}, {b})"


def _store(ptr: str, value: str, mask: str | None) -> str:
    return f"tl.store({ptr}, {value})" if mask is None else f"tl.store({ptr}, {value}, mask={mask})"


def _replace(ctx: _Ctx, **changes) -> _Ctx:
    return _Ctx(**{**ctx.__dict__, **changes})


def scratch_and_registers(program: Program, phases: list[Phase], scratch: set[str]) -> dict[int, dict[str, str]]:
    """Per phase: register local -> its variable name."""
    return {ph.index: {name: python_name(f"reg_{name}", "_") for name in ph.registers} for ph in phases}


def uses_product_reduction(program: Program) -> bool:
    return any(isinstance(n, Reduce) and n.combiner == "*" for n, _ in program.walk())


def check_program(program: Program) -> None:
    """Refuse what the generator cannot translate, before any text is made."""
    for b in program.buffers:
        if not all(isinstance(d, Const) for d in b.shape):
            raise UnsupportedProgram(f"buffer '{b.name}' has a symbolic shape; Triton kernels need static shapes")
    if program.params:
        raise UnsupportedProgram(f"program '{program.name}' has parameters; Triton kernels need static sizes")
    list(accesses(program.body))


__all__ = ["JitKernel", "RowKernel", "check_program", "combine", "python_name", "scratch_and_registers",
           "uses_product_reduction"]
