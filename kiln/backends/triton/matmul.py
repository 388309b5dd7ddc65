"""The matmul / batched-matmul template with its fused epilogue.

:func:`match_matmul` recognizes a lowered program of one phase whose band body is::

    acc[band] = c                           # a constant
    for k... { acc[band] += A(...) * B(...) }   # a perfect nest of constant reduction loops
    <epilogue>                              # statements without loops, reading acc[band]

where ``acc`` is a register.  Band iterators that only ``A`` uses are the rows (``M``),
those only ``B`` uses the columns (``N``), the others batch axes; the reduction iterators
are the contraction (``K``).  Several iterators of one role are flattened (``[2, 16, 128] @
[128, 1000]`` has ``M = 32``).  ``A`` and ``B`` are any element expressions -- absorbed
transposes and slices are index arithmetic in them.

:func:`matmul_source` emits one ``@triton.jit`` kernel: a ``BLOCK_M x BLOCK_N`` output tile
per program (tiles ordered in ``GROUP_M``-row groups so neighbouring programs share
operand tiles in cache; batches follow one another on the same grid axis), a loop over
``BLOCK_K`` chunks of the contraction accumulating ``tl.dot`` in float32 (float64 for
float64; float16/bfloat16 operands go into ``tl.dot`` as they are, with a float32
accumulator), then the epilogue on the accumulator tile, stored with the output masks.
Operand loads are masked only when the sizes do not divide the blocks (``EVEN_K``,
``EVEN_MN`` are ``constexpr``: the unmasked variant is compiled when they hold).
``float32`` products use ``input_precision="ieee"`` unless the backend's ``tf32`` option
allows TF32 tensor cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.loops import Expr, Loop, Program, loads_of
from kiln.ir.loops.expr import Binary, Cast, Const, free_vars
from kiln.ir.loops.program import Reduce, Store
from kiln.ir.types import DType

from .analysis import Phase, accesses, constant_trips, has_loops, product
from .printer import TL_DTYPES, ExprPrinter, Scope, conj
from .rows import RowKernel, _Ctx, python_name
from .source import PLACEHOLDER, launch_function

_HALF = (DType.float16, DType.bfloat16)


@dataclass
class MatmulMatch:
    """The parts of a matched program (module docstring)."""

    phase: Phase
    acc: str
    init: Store
    loops: list[Loop]
    a: Expr
    b: Expr
    m: list[Loop]
    n: list[Loop]
    batch: list[Loop]
    epilogue: tuple
    stored: bool = False
    """The accumulator is a result buffer (a plain matmul): the tile is stored into it."""


def _vars(e: Expr) -> set[str]:
    found = set(free_vars(e))
    for ld in loads_of(e):
        for i in ld.indices:
            found |= free_vars(i)
    return found


def match_matmul(program: Program, phases: list[Phase], scratch: set[str]) -> MatmulMatch | None:
    """The matmul structure of ``program``, or ``None`` (module docstring)."""
    if len(phases) != 1 or scratch:
        return None
    phase = phases[0]
    body = phase.body
    if not phase.band or len(body) < 2 or not isinstance(body[0], Store) or not isinstance(body[1], Loop):
        return None
    init, nest = body[0], body[1]
    if not isinstance(init.value, Const):
        return None
    stored = init.buffer not in phase.registers
    if stored:  # accumulating into a result: it must be one cell per band iteration
        band = {lp.iterator for lp in phase.band}
        uses = [a for a in accesses(body) if a.buffer == init.buffer]
        if (any(a.indices != init.indices for a in uses) or program.buffer(init.buffer).scope != "global"
                or any(not free_vars(e) <= band or loads_of(e) for e in init.indices)):
            return None
    loops = [nest]
    while len(loops[-1].body) == 1 and isinstance(loops[-1].body[0], Loop):
        loops.append(loops[-1].body[0])
    inner = loops[-1].body
    if (len(inner) != 1 or not isinstance(inner[0], Reduce) or inner[0].combiner != "+"
            or inner[0].buffer != init.buffer or not isinstance(inner[0].value, Binary) or inner[0].value.op != "*"):
        return None
    if any(not (isinstance(lp.lower, Const) and isinstance(lp.upper, Const)) or constant_trips(lp) == 0
           for lp in loops):
        return None
    epilogue = body[2:]
    if has_loops(epilogue):
        return None
    a, b = inner[0].value.lhs, inner[0].value.rhs
    va, vb = _vars(a), _vars(b)
    ks = {lp.iterator for lp in loops}
    if not ks <= va | vb or init.buffer in {ld.buffer for ld in loads_of(a) + loads_of(b)}:
        return None
    m = [lp for lp in phase.band if lp.iterator in va and lp.iterator not in vb]
    n = [lp for lp in phase.band if lp.iterator in vb and lp.iterator not in va]
    batch = [lp for lp in phase.band if lp not in m and lp not in n]
    if not m and not n:
        return None
    return MatmulMatch(phase, init.buffer, init, loops, a, b, m, n, batch, tuple(epilogue), stored)


def _half_operand(e: Expr, dtypes: dict[str, DType]) -> tuple[Expr, DType] | None:
    """``x`` when ``e`` is ``f32(x)`` of a float16/bfloat16 load (tensor cores read it as is)."""
    if isinstance(e, Cast) and e.dtype == DType.float32 and loads_of(e.operand):
        inner = e.operand
        top = loads_of(inner)[0]
        if inner == top and dtypes.get(top.buffer) in _HALF:
            return inner, dtypes[top.buffer]
    return None


def _decompose(loops: list[Loop], flat: str, lines: list[str], indent: str, suffix: str = "") -> dict[str, str]:
    """Iterators of ``loops`` (outermost first) recovered from the flat index text ``flat``
    (their variables named after them, plus ``suffix``)."""
    names: dict[str, str] = {}
    inner = 1
    for j, lp in reversed(list(enumerate(loops))):
        trips = constant_trips(lp)
        part = flat if inner == 1 else f"({flat}) // {inner}"
        if j:
            part = f"({part}) % {trips}"
        lower = int(lp.lower.value)
        value = part if lp.step == 1 else f"{lp.step} * ({part})"
        value = value if lower == 0 else f"{lower} + {value}"
        var = python_name(lp.iterator + suffix, "it_")
        lines.append(f"{indent}{var} = {value}")
        names[lp.iterator] = var
        inner *= trips
    return names


def matmul_source(program: Program, match: MatmulMatch, printer: ExprPrinter, pointers: dict[str, str], *,
                  tf32: bool = False) -> tuple[str, dict]:
    """The kernel text and launch function of a matched program, and its extents."""
    buffers = {b.name: b for b in program.buffers}
    dtypes = {name: b.dtype for name, b in buffers.items()}
    M = product(constant_trips(lp) for lp in match.m)
    N = product(constant_trips(lp) for lp in match.n)
    K = product(constant_trips(lp) for lp in match.loops)
    B = product(constant_trips(lp) for lp in match.batch)
    acc_dtype = buffers[match.acc].dtype
    acc_tl = TL_DTYPES[acc_dtype]
    a, b = match.a, match.b
    ha, hb = _half_operand(a, dtypes), _half_operand(b, dtypes)
    if ha and hb and ha[1] == hb[1]:
        a, b = ha[0], hb[0]
    lines = [
        "@triton.jit",
        f"def {PLACEHOLDER}_mm({', '.join(pointers.values())}, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, "
        "BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_MN: tl.constexpr):",
        f"    # C[{M} x {N}] = A[{M} x {K}] @ B[{K} x {N}], {B} batch(es), then the epilogue",
        "    pid = tl.program_id(0)",
        f"    num_pid_m = ({M} + BLOCK_M - 1) // BLOCK_M",
        f"    num_pid_n = ({N} + BLOCK_N - 1) // BLOCK_N",
        "    tiles = num_pid_m * num_pid_n",
        "    bidx = pid // tiles",
        "    pid = pid % tiles",
        "    group = GROUP_M * num_pid_n",
        "    first_m = (pid // group) * GROUP_M",
        "    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)",
        "    pid_m = first_m + (pid % group) % group_m",
        "    pid_n = (pid % group) // group_m",
        "    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "    offs_k = tl.arange(0, BLOCK_K)",
    ]
    batch_vars = _decompose(match.batch, "bidx", lines, "    ")
    uniform = {k: (v, 0) for k, v in batch_vars.items()}
    ranges = match.phase.band_ranges()
    # operand tiles: A is [BLOCK_M, BLOCK_K], B is [BLOCK_K, BLOCK_N]
    lines.append(f"    acc = tl.full([BLOCK_M, BLOCK_N], {printer.expr(match.init.value, _empty_scope(buffers)).text}, "
                 f"{acc_tl})")
    lines.append("    za = tl.full([BLOCK_M, BLOCK_K], 0, tl.int32)")
    lines.append("    zb = tl.full([BLOCK_K, BLOCK_N], 0, tl.int32)")
    lines.append(f"    for k0 in range(0, {K}, BLOCK_K):")
    ind = "        "
    lines.append(f"{ind}am = offs_m[:, None] + za")
    lines.append(f"{ind}ak = k0 + offs_k[None, :] + za")
    lines.append(f"{ind}bk = k0 + offs_k[:, None] + zb")
    lines.append(f"{ind}bn = offs_n[None, :] + zb")
    a_vars = {**uniform, **{k: (v, 2) for k, v in _decompose(match.m, "am", lines, ind).items()}}
    k_a = _decompose(match.loops, "ak", lines, ind)
    a_vars.update({k: (v, 2) for k, v in k_a.items()})
    b_vars = {**uniform, **{k: (v, 2) for k, v in _decompose(match.n, "bn", lines, ind).items()}}
    b_vars.update({k: (v, 2) for k, v in _decompose(match.loops, "bk", lines, ind, suffix="_b").items()})
    mask_a = conj(f"am < {M}", f"ak < {K}")
    mask_b = conj(f"bk < {K}", f"bn < {N}")
    pads_a = {1: "za", 2: "za"}
    pads_b = {1: "zb", 2: "zb"}
    ranges_in = {**ranges, **{lp.iterator: (int(lp.lower.value), int(lp.lower.value) + lp.step * (constant_trips(lp) - 1))
                              for lp in match.loops}}
    scope_a = Scope(a_vars, buffers, pointers, ranges=ranges_in, pads=pads_a)
    scope_b = Scope(b_vars, buffers, pointers, ranges=ranges_in, pads=pads_b)
    dot_dtype = ha[1] if ha and hb and ha[1] == hb[1] else acc_dtype
    texts = {}
    for even in (True, False):
        ta = printer.cast(printer.expr(a, scope_a if even else scope_a.child(lane_mask=mask_a, mask=mask_a)), dot_dtype)
        tb = printer.cast(printer.expr(b, scope_b if even else scope_b.child(lane_mask=mask_b, mask=mask_b)), dot_dtype)
        texts[even] = (ta.text if not ta.is_literal else f"tl.full([BLOCK_M, BLOCK_K], {ta.text}, {TL_DTYPES[dot_dtype]})",
                       tb.text if not tb.is_literal else f"tl.full([BLOCK_K, BLOCK_N], {tb.text}, {TL_DTYPES[dot_dtype]})")
    lines.append(f"{ind}if EVEN_K and EVEN_MN:")
    lines.append(f"{ind}    a = {texts[True][0]}")
    lines.append(f"{ind}    b = {texts[True][1]}")
    lines.append(f"{ind}else:")
    lines.append(f"{ind}    a = tl.where({mask_a}, {texts[False][0]}, 0)")
    lines.append(f"{ind}    b = tl.where({mask_b}, {texts[False][1]}, 0)")
    precision = ", input_precision=\"ieee\"" if dot_dtype == DType.float32 and not tf32 else ""
    if dot_dtype == DType.float64:
        precision = ""
    lines.append(f"{ind}acc = tl.dot(a, b, acc{precision}, out_dtype={acc_tl})")
    # the epilogue on the [BLOCK_M, BLOCK_N] accumulator tile
    lines.append("    ze = tl.full([BLOCK_M, BLOCK_N], 0, tl.int32)")
    lines.append("    em = offs_m[:, None] + ze")
    lines.append("    en = offs_n[None, :] + ze")
    lines.append(f"    emask = (em < {M}) & (en < {N})")
    e_vars = {**uniform}
    e_vars.update({k: (v, 1) for k, v in _decompose(match.m, "em", lines, "    ").items()})
    e_vars.update({k: (v, 1) for k, v in _decompose(match.n, "en", lines, "    ").items()})
    registers = {name: python_name(f"reg_{name}", "_") for name in match.phase.registers}
    registers[match.acc] = "acc"
    for name, var in registers.items():
        if name != match.acc:
            lines.append(f"    {var} = tl.full([BLOCK_M, BLOCK_N], 0, {TL_DTYPES[buffers[name].dtype]})")
    emitter = RowKernel(program, printer, PLACEHOLDER, pointers)
    emitter.lanes = "[BLOCK_M, BLOCK_N]"
    scope = Scope(e_vars, buffers, pointers, registers, {}, lane_mask="emask", mask="emask",
                  pads={1: "ze"}, ranges=ranges)
    if match.stored:
        ptr, mask, _ = printer.access(match.acc, match.init.indices, scope, None)
        out_dtype = TL_DTYPES[buffers[match.acc].dtype]
        lines.append(f"    tl.store({ptr}, acc.to({out_dtype}), mask={mask})")
    emitter.nodes(match.epilogue, _Ctx(scope, None, 1, dict(ranges), set(match.phase.band_vars)))
    lines += emitter.lines
    launch = [
        f"BLOCK_M = _dot_block(cfg['BLOCK_M'], {M})",
        f"BLOCK_N = _dot_block(cfg['BLOCK_N'], {N})",
        f"BLOCK_K = _dot_block(cfg['BLOCK_K'], {K})",
        f"grid = (triton.cdiv({M}, BLOCK_M) * triton.cdiv({N}, BLOCK_N) * {B},)",
        f"{PLACEHOLDER}_mm[grid](*ptrs, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=cfg['GROUP_M'], "
        f"EVEN_K={K} % BLOCK_K == 0, EVEN_MN={M} % BLOCK_M == 0 and {N} % BLOCK_N == 0, "
        "num_warps=cfg['num_warps'], num_stages=cfg['num_stages'])",
    ]
    text = "\n".join(lines) + "\n\n\n" + launch_function(launch)
    return text, {"m": M, "n": N, "k": K, "batch": B}


def _empty_scope(buffers) -> Scope:
    return Scope({}, buffers, {})


__all__ = ["MatmulMatch", "match_matmul", "matmul_source"]
