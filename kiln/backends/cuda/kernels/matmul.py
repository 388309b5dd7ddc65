"""The matmul kind: tiled, double-buffered contractions with their fused epilogue.

A nest :func:`~.matmul_match.match_matmul` recognizes (``acc = init; acc += X * Y over k;
epilogue``, batch/m/n loops flattened) becomes one kernel:

* grid ``(ceil(N / BN), ceil(M / BM), batch)``, one ``BM x BN`` output tile per block;
* the block's threads compute the tile through one composed task mapping
  ``spatial(wm, wn) * repeat(rm, rn) * spatial(4, 8) * repeat(tm, tn)`` (warps, warp tile
  repeats, the 4 x 8 lanes of a warp, the thread tile), accumulators in registers;
* K runs in steps of ``BK`` through shared tiles ``As[2, BK, BM + pad]`` and
  ``Bs[2, BK, BN + pad]`` (``X``/``Y`` evaluated once per element while loading -- any
  prologue, cast or index arithmetic of the operands included), double-buffered: while the
  block computes on tile ``k % 2`` each thread loads its share of tile ``k + 1`` into
  registers (coalesced: consecutive threads along the operand's contiguous axis) and stores
  it into ``(k + 1) % 2`` afterwards; one barrier per step;
* ragged M, N, K are masked: out-of-range operand elements load as zero (the loads
  themselves are skipped), out-of-range outputs are not stored;
* the epilogue runs per accumulator, in registers, before its store.

:func:`matmul_configs` is the tuning space: configurations pruned by the register and
shared-memory budgets (and, with ``checked=True``, by :func:`kiln.ir.poly.races.check_races`
on a kernel built for the sizes), best first for the given sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from kiln.ir.loops import (
    Annotation, Barrier, Binary, Buffer, Const, Expr, If, Load, Loop, Node, Program, Reduce, Select, Store, Var,
    dtype_of, loads_of, repeat, spatial, substitute,
)
from kiln.ir.types import DType

from .common import PlanContext, band_coordinates, rewrite_loads, subst_nodes
from .matmul_match import MatmulMatch, fast_axis, match_matmul
from .plan import GpuKernel
from .tiles import expand, tile_mapping

LANES = (4, 8)
REGISTER_BUDGET = 160
"""32-bit registers per thread the tiles may use (of 255), leaving room for addresses."""
SHARED_BUDGET = 48 * 1024
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class MatmulConfig:
    """A tile configuration: warps ``(wm, wn)``, warp-tile repeats ``(rm, rn)``, thread tile
    ``(tm, tn)`` and the K step ``bk``; lanes are ``4 x 8`` per warp."""

    warps: tuple[int, int]
    reps: tuple[int, int]
    thread: tuple[int, int]
    bk: int

    @property
    def bm(self) -> int:
        return self.warps[0] * self.reps[0] * LANES[0] * self.thread[0]

    @property
    def bn(self) -> int:
        return self.warps[1] * self.reps[1] * LANES[1] * self.thread[1]

    @property
    def threads(self) -> int:
        return self.warps[0] * self.warps[1] * 32

    def mapping(self):
        """The block's task mapping over its ``bm x bn`` output tile."""
        return spatial(*self.warps) * repeat(*self.reps) * spatial(*LANES) * repeat(*self.thread)

    def registers(self) -> int:
        rows, cols = self.reps[0] * self.thread[0], self.reps[1] * self.thread[1]
        prefetch = -(-(self.bm * self.bk) // self.threads) + -(-(self.bk * self.bn) // self.threads)
        return rows * cols + rows + cols + prefetch

    def shared_bytes(self, itemsize: int = 4) -> int:
        return 2 * self.bk * ((self.bm + 1) + (self.bn + 1)) * itemsize

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk} ({self.mapping()})"


SPACE = (
    MatmulConfig((2, 4), (4, 1), (4, 4), 8),     # 128 x 128, 256 threads
    MatmulConfig((2, 2), (2, 2), (4, 2), 16),    # 64 x 64, 128 threads
    MatmulConfig((2, 2), (1, 1), (4, 4), 16),    # 32 x 64, 128 threads
    MatmulConfig((1, 2), (1, 1), (4, 2), 16),    # 16 x 32, 64 threads
    MatmulConfig((1, 1), (1, 1), (2, 2), 8),     # 8 x 16, 32 threads
)


def fits(cfg: MatmulConfig, itemsize: int = 4) -> bool:
    """The register and shared-memory budgets."""
    return cfg.registers() <= REGISTER_BUDGET and cfg.shared_bytes(itemsize) <= SHARED_BUDGET \
        and cfg.threads <= 1024


def matmul_configs(M: int, N: int, K: int, batch: int = 1, *, itemsize: int = 4,  # noqa: N803
                   checked: bool = False) -> list[MatmulConfig]:
    """The legal configurations for a ``batch x M x N x K`` contraction, best first: those
    giving at least 132 blocks (one wave on an H200), largest tile first, then the rest by
    decreasing block count.  ``checked``: also drop configurations whose kernel (built for
    these sizes) :func:`~kiln.ir.poly.races.check_races` rejects."""
    legal = [c for c in SPACE if fits(c, itemsize)]
    if checked:
        legal = [c for c in legal if _race_free(c, M, N, K)]

    def blocks(c: MatmulConfig) -> int:
        return -(-M // c.bm) * -(-N // c.bn) * batch

    enough = [c for c in legal if blocks(c) >= 132]
    rest = sorted((c for c in legal if blocks(c) < 132), key=lambda c: (-blocks(c), -c.bm * c.bn))
    return enough + rest


@lru_cache(maxsize=128)
def _race_free(cfg: MatmulConfig, M: int, N: int, K: int) -> bool:  # noqa: N803
    from kiln.ir.errors import ScheduleError
    from kiln.ir.poly.races import check_races

    kernel = example_kernel(cfg, M, N, K)
    try:
        check_races(kernel.program)
    except ScheduleError:
        return False
    return True


def example_kernel(cfg: MatmulConfig, M: int, N: int, K: int) -> GpuKernel:  # noqa: N803
    """The kernel of ``C = A @ B`` (f32, ``A: [M, K]``, ``B: [K, N]``) with ``cfg``."""
    from .plan import KernelOptions

    f32 = DType.float32
    body = Loop("i", 0, M, (Loop("j", 0, N, (
        Store("C", ("i", "j"), Const(0.0, f32)),
        Loop("k", 0, K, (Reduce("C", ("i", "j"), "+", Load("A", ("i", "k")) * Load("B", ("k", "j"))),)),
    )),))
    bufs = (Buffer("A", (M, K), f32), Buffer("B", (K, N), f32), Buffer("C", (M, N), f32))
    program = Program("matmul", (), bufs, (body,))
    ctx = PlanContext(program, KernelOptions(matmul=cfg))
    return matmul_kernels(ctx, list(program.body), 0)[0]


# ============================================================================ generation
def matmul_kernels(ctx: PlanContext, group: Sequence[Node], index: int) -> list[GpuKernel] | None:
    """The matmul kernel of ``group``, or ``None`` when it is not a contraction."""
    match = match_matmul(ctx, group)
    if match is None:
        return None
    batch, M, N, K = match.sizes  # noqa: N806
    dt = ctx.program.buffer(match.acc).dtype
    buffers = {b.name: b.dtype for b in ctx.program.buffers}
    x_dt = dtype_of(match.x, {}, buffers)
    y_dt = dtype_of(match.y, {}, buffers)
    itemsize = max(x_dt.itemsize, y_dt.itemsize, dt.itemsize)
    cfg = ctx.options.matmul
    if cfg is None:
        configs = matmul_configs(M, N, K, batch, itemsize=itemsize)
        if not configs:
            return None
        cfg = configs[0]
    if batch > MAX_GRID_YZ or -(-M // cfg.bm) > MAX_GRID_YZ:
        return None
    return [_build(ctx, match, cfg, index, x_dt, y_dt, dt)]


def _build(ctx: PlanContext, mm: MatmulMatch, cfg: MatmulConfig, index: int, x_dt, y_dt, acc_dt) -> GpuKernel:
    batch, M, N, K = mm.sizes  # noqa: N806
    bm, bn, bk, T = cfg.bm, cfg.bn, cfg.bk, cfg.threads  # noqa: N806
    frame = ctx.frame((-(-N // bn), -(-M // bm), batch), (T,))
    tid = frame.t("x")
    m0, n0 = frame.b("y") * bm if M > bm else Const(0), frame.b("x") * bn if N > bn else Const(0)
    fresh = ctx.fresh
    m_vars = {lp.iterator for lp in mm.m_loops}
    n_vars = {lp.iterator for lp in mm.n_loops}
    r_vars = {lp.iterator for lp in mm.r_loops}
    batch_env = band_coordinates(mm.batch, frame.b("z")) if mm.batch else {}

    def at(m: Expr | None, n: Expr | None, k: Expr | None) -> dict[str, Expr]:
        env = dict(batch_env)
        if m is not None:
            env |= band_coordinates(mm.m_loops, m)
        if n is not None:
            env |= band_coordinates(mm.n_loops, n)
        if k is not None:
            env |= band_coordinates(mm.r_loops, k)
        return env

    a_fast = 1 if fast_axis(mm.x, r_vars) or not fast_axis(mm.x, m_vars) else 0
    b_fast = 1 if fast_axis(mm.y, n_vars) or not fast_axis(mm.y, r_vars) else 0
    pad_a, pad_b = (1 if a_fast == 1 else 0), (1 if b_fast == 0 else 0)
    As, Bs = fresh("As"), fresh("Bs")  # noqa: N806
    ra, rb, acc, fa, fb = fresh("ra"), fresh("rb"), fresh("acc"), fresh("fa"), fresh("fb")
    ea = expand(tile_mapping((bm, bk), T, a_fast), tid, fresh, "a", workers=T)
    eb = expand(tile_mapping((bk, bn), T, b_fast), tid, fresh, "b", workers=T)
    ec = expand(cfg.mapping(), tid, fresh, "c", workers=T)
    rows, cols = ec.registers({0}), ec.registers({1})
    kt = fresh("kt")
    steps = -(-K // bk)

    def lt(a: Expr, bound: int) -> Expr:
        return Binary("<", a, Const(bound))

    def conj(conds: list[Expr]) -> Expr | None:
        out = None
        for c in conds:
            out = c if out is None else Binary("&&", out, c)
        return out

    def operand(expr: Expr, env: dict[str, Expr], conds: list[Expr], dtype) -> Expr:
        value = substitute(expr, env)
        cond = conj(conds)
        return value if cond is None else Select(cond, value, Const(0, dtype))

    def load_a(k0: Expr) -> tuple[Expr, Expr]:
        mm_, kk = ea.coords
        m, k = _plus(m0, mm_), _plus(k0, kk)
        conds = ([lt(m, M)] if M % bm else []) + ([lt(k, K)] if K % bk else [])
        return operand(mm.x, at(m, None, k), conds, x_dt), kk

    def load_b(k0: Expr) -> tuple[Expr, Expr]:
        kk, nn = eb.coords
        n, k = _plus(n0, nn), _plus(k0, kk)
        conds = ([lt(n, N)] if N % bn else []) + ([lt(k, K)] if K % bk else [])
        return operand(mm.y, at(None, n, k), conds, y_dt), kk

    def to_shared(buf: Expr, value_a: Expr, value_b: Expr) -> list[Node]:
        return [*ea.wrap([Store(As, (buf, ea.coords[1], ea.coords[0]), value_a)]),
                *eb.wrap([Store(Bs, (buf, eb.coords[0], eb.coords[1]), value_b)])]

    body: list[Node] = []
    # accumulators
    mi, nj = _plus(m0, ec.coords[0]), _plus(n0, ec.coords[1])
    init = mm.init if not _reads(mm.init) else Select(
        conj([lt(mi, M), lt(nj, N)]), mm.init, Const(0, acc_dt))
    body += ec.wrap([Store(acc, (ec.register({0}), ec.register({1})), substitute(init, at(mi, nj, None)))],
                    guard=False)
    # prologue: tile 0 straight into shared buffer 0
    va, _ = load_a(Const(0))
    vb, _ = load_b(Const(0))
    body += to_shared(Const(0), va, vb)
    body.append(Barrier())
    # main loop
    k_next = Binary("*", Binary("+", Var(kt), Const(1)), Const(bk))
    cur = Binary("floormod", Var(kt), Const(2)) if steps > 1 else Const(0)
    nxt = Binary("floormod", Binary("+", Var(kt), Const(1)), Const(2))
    step: list[Node] = []
    if steps > 1:
        va, _ = load_a(k_next)
        vb, _ = load_b(k_next)
        step.append(If(lt(Binary("+", Var(kt), Const(1)), steps),
                       (*ea.wrap([Store(ra, (ea.register(),), va)]), *eb.wrap([Store(rb, (eb.register(),), vb)]))))
    kk = fresh("kk")
    inner: list[Node] = []
    inner += ec.wrap([Store(fa, (ec.register({0}),), Load(As, (cur, Var(kk), ec.coords[0])))], {0}, guard=False)
    inner += ec.wrap([Store(fb, (ec.register({1}),), Load(Bs, (cur, Var(kk), ec.coords[1])))], {1}, guard=False)
    inner += ec.wrap([Reduce(acc, (ec.register({0}), ec.register({1})), "+",
                             Binary("*", Load(fa, (ec.register({0}),)), Load(fb, (ec.register({1}),))))],
                     guard=False)
    step.append(Loop(kk, 0, bk, tuple(inner), annotation=_unrolled(bk)))
    if steps > 1:
        step.append(If(lt(Binary("+", Var(kt), Const(1)), steps),
                       tuple(to_shared(nxt, Load(ra, (ea.register(),)), Load(rb, (eb.register(),))))))
    step.append(Barrier())
    body.append(Loop(kt, 0, steps, tuple(step)))
    # epilogue
    reg = Load(acc, (ec.register({0}), ec.register({1})))
    target = Load(mm.acc, mm.acc_index)
    epi = [*_replace_acc(mm.epilogue, target, reg)]
    if not ctx.private_to(mm.acc, index):
        epi.append(Store(mm.acc, mm.acc_index, reg))
    epi = list(subst_nodes(epi, at(mi, nj, None)))
    guard = conj(([lt(mi, M)] if M % bm else []) + ([lt(nj, N)] if N % bn else []))
    body += ec.wrap(epi if guard is None else [If(guard, tuple(epi))], guard=False)
    extra = [
        Buffer(As, (2, bk, bm + pad_a), x_dt, "shared"), Buffer(Bs, (2, bk, bn + pad_b), y_dt, "shared"),
        Buffer(acc, (rows, cols), acc_dt, "register"),
        Buffer(fa, (rows,), x_dt, "register"), Buffer(fb, (cols,), y_dt, "register"),
    ]
    if steps > 1:
        extra += [Buffer(ra, (ea.registers(),), x_dt, "register"), Buffer(rb, (eb.registers(),), y_dt, "register")]
    return ctx.kernel(frame, body, "matmul", extra)


def _plus(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and a.value == 0:
        return b
    if isinstance(b, Const) and b.value == 0:
        return a
    return Binary("+", a, b)


def _unrolled(n: int) -> Annotation:
    return Annotation("unrolled", factor=n)


def _reads(e: Expr) -> bool:
    return bool(loads_of(e))


def _replace_acc(nodes: Sequence[Node], target: Load, reg: Load) -> tuple[Node, ...]:
    return rewrite_loads(nodes, lambda ld: reg if ld == target else None)
