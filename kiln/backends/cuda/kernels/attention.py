"""The attention kind: ``scaled_dot_product_attention`` nodes as one tiled online-softmax
kernel (FlashAttention's recurrence).

The node's attributes define the computation (``is_causal``, ``scale``, an optional bool
mask -- keep where true -- or float mask -- added), exactly as the op's compute rule does;
the lowered program supplies the buffers (``lowered.inputs``: q, k, v[, mask];
``lowered.outputs[0]``).  Batch axes broadcast as numpy does.

Launch: grid ``(ceil(L / BQ), batch)``, 128 threads.  Per block, ``BQ`` query rows stay in
shared memory (``Qs``); for each tile of ``BK`` keys:

1. the threads load ``Ks`` and ``Vs`` (coalesced along the embedding; keys past the end load
   as zero), barrier;
2. ``S = Q K^T * scale`` (+ float mask) for the tile, masked entries (past the last key,
   above the diagonal when causal, false in a bool mask) set to ``-inf``, into ``Ss``;
   barrier;
3. one thread per query row: ``m' = max(m, rowmax S)``, ``P = exp(S - m'')`` in place (with
   ``m'' = 0`` while ``m'`` is ``-inf``), ``alpha = exp(m - m'')``, ``l = alpha l + rowsum P``;
   barrier;
4. ``O = alpha O + P V`` with ``O`` in registers (each thread a fixed set of cells); barrier.

Finally ``out = O / l``, and ``0`` for a row whose every key is masked (``l = 0``), not NaN.
Tile sizes shrink (32, 16, 8 rows/keys) until the shared tiles fit in 48 KiB.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir.loops import (
    Barrier, Binary, Buffer, Call, Cast, Const, Expr, If, Load, Loop, Node, Reduce, Select, Store, Var, spatial,
)
from kiln.ir.ops.compute import compute_dtype
from kiln.ir.types import DType

from .common import PlanContext, band_coordinates
from .plan import GpuKernel
from .tiles import expand, tile_mapping

THREADS = 128
SHARED_BUDGET = 48 * 1024


def attention_kernels(ctx: PlanContext, node, inputs: Sequence[str], outputs: Sequence[str],
                      ) -> list[GpuKernel] | None:
    """The attention kernel of a ``scaled_dot_product_attention`` node's lowered program
    (``inputs``/``outputs``: its buffers per operand and result), or ``None`` for other
    nodes and for shapes the launch cannot hold (more than 65535 batch entries)."""
    if getattr(node, "op_name", None) != "scaled_dot_product_attention":
        return None
    program = ctx.program
    names = list(inputs)
    if len(names) not in (3, 4) or len(outputs) != 1:
        return None
    shapes = {b.name: tuple(int(d.value) for d in b.shape) for b in program.buffers}
    out = outputs[0]
    out_shape = shapes[out]
    q, k, v = names[:3]
    mask = names[3] if len(names) == 4 else None
    if min(len(shapes[q]), len(shapes[k]), len(shapes[v])) < 2:
        return None
    length, emb = shapes[q][-2:]
    keys = shapes[k][-2]
    ev = shapes[v][-1]
    batch_shape = out_shape[:-2]
    batch = math.prod(batch_shape)
    if batch > 65535 or 0 in out_shape or keys == 0 or emb == 0:
        return None
    attrs = node.attrs
    scale = attrs.get("scale")
    scale = 1.0 / math.sqrt(emb) if scale is None else float(scale)
    dtype = program.buffer(q).dtype
    t = compute_dtype(dtype)
    bq = ctx.options.attention_block
    while bq > 8 and _shared(bq, emb, ev, t) > SHARED_BUDGET:
        bq //= 2
    if _shared(bq, emb, ev, t) > SHARED_BUDGET:
        return None
    spec = _Spec(q, k, v, mask, out, shapes, batch_shape, length, keys, emb, ev, scale,
                 bool(attrs.get("is_causal", False)), t, bq)
    return [_build(ctx, spec)]


def _shared(bq: int, emb: int, ev: int, t: DType) -> int:
    bk = bq
    cells = bq * (emb + 1) + bk * (emb + 1) + bk * ev + bq * (bk + 1) + 3 * bq
    return cells * t.itemsize


@dataclass(frozen=True)
class _Spec:
    """One attention: buffer names, shapes, sizes (``length`` queries, ``keys``, embedding
    ``emb``, value width ``ev``), the scale, causality, compute dtype ``t``, tile ``bq``."""

    q: str
    k: str
    v: str
    mask: str | None
    out: str
    shapes: dict[str, tuple[int, ...]]
    batch_shape: tuple[int, ...]
    length: int
    keys: int
    emb: int
    ev: int
    scale: float
    causal: bool
    t: DType
    bq: int


def _broadcast(coords: Sequence[Expr], shape: Sequence[int]) -> list[Expr]:
    """The batch index of an operand whose batch axes are ``shape`` (aligned right)."""
    lead = len(coords) - len(shape)
    return [Const(0) if n == 1 else coords[lead + d] for d, n in enumerate(shape)]


def _and(conds: list[Expr]) -> Expr | None:
    out = None
    for c in conds:
        out = c if out is None else Binary("&&", out, c)
    return out


def _build(ctx: PlanContext, s: _Spec) -> GpuKernel:
    bq = bk = s.bq
    t = s.t
    frame = ctx.frame((-(-s.length // bq), math.prod(s.batch_shape)), (THREADS,))
    tid = frame.t("x")
    fresh = ctx.fresh
    q0 = Binary("*", frame.b("x"), Const(bq)) if s.length > bq else Const(0)
    if s.batch_shape:
        loops = [Loop(f"_b{d}", 0, n, ()) for d, n in enumerate(s.batch_shape)]
        env = band_coordinates(loops, frame.b("y"))
        bcoords = [env[f"_b{d}"] for d in range(len(s.batch_shape))]
    else:
        bcoords = []

    def operand(name: str, row: Expr, col: Expr) -> Expr:
        shape = s.shapes[name]
        ld = Load(name, (*_broadcast(bcoords, shape[:-2]), row, col))
        return ld if ctx.program.buffer(name).dtype == t else Cast(t, ld)

    Qs, Ks, Vs, Ss = fresh("Qs"), fresh("Ks"), fresh("Vs"), fresh("Ss")  # noqa: N806
    m_s, l_s, a_s = fresh("m_s"), fresh("l_s"), fresh("alpha_s")
    o_r, acc, mx, tot = fresh("o"), fresh("dot"), fresh("mx"), fresh("total")
    zero, ninf = Const(0.0, t), Const(-math.inf, t)
    lt = lambda a, n: Binary("<", a, Const(n))  # noqa: E731
    body: list[Node] = []

    # per-row state, output accumulators, the query tile
    ri = fresh("i")
    rows = spatial(bq).on(tid).loop([ri], [Store(m_s, (Var(ri),), ninf), Store(l_s, (Var(ri),), zero)])
    body.append(rows)
    eo = expand(tile_mapping((bq, s.ev), THREADS, 1), tid, fresh, "o", workers=THREADS)
    body += eo.wrap([Store(o_r, (eo.register(),), zero)])
    qi, qe = fresh("qi"), fresh("qe")
    row = Binary("+", q0, Var(qi))
    qval = operand(s.q, row, Var(qe))
    if s.length % bq:
        qval = Select(lt(row, s.length), qval, zero)
    body.append(tile_mapping((bq, s.emb), THREADS, 1).on(tid).loop([qi, qe], [Store(Qs, (Var(qi), Var(qe)), qval)]))

    kt = fresh("kt")
    k0 = Binary("*", Var(kt), Const(bk))
    step: list[Node] = []
    kj, ke, vj, ve = fresh("kj"), fresh("ke"), fresh("vj"), fresh("ve")
    key = Binary("+", k0, Var(kj))
    kval = operand(s.k, key, Var(ke))
    vkey = Binary("+", k0, Var(vj))
    vval = operand(s.v, vkey, Var(ve))
    if s.keys % bk:
        kval = Select(lt(key, s.keys), kval, zero)
        vval = Select(lt(vkey, s.keys), vval, zero)
    step.append(tile_mapping((bk, s.emb), THREADS, 1).on(tid).loop([kj, ke], [Store(Ks, (Var(kj), Var(ke)), kval)]))
    step.append(tile_mapping((bk, s.ev), THREADS, 1).on(tid).loop([vj, ve], [Store(Vs, (Var(vj), Var(ve)), vval)]))
    step.append(Barrier())

    # scores of the tile
    si, sj, se = fresh("si"), fresh("sj"), fresh("se")
    qrow, kcol = Binary("+", q0, Var(si)), Binary("+", k0, Var(sj))
    score: Expr = Binary("*", Load(acc, ()), Const(s.scale, t))
    keep: list[Expr] = []
    if s.keys % bk:
        keep.append(lt(kcol, s.keys))
    if s.causal:
        keep.append(Binary("<=", kcol, qrow))
    valid = ([lt(qrow, s.length)] if s.length % bq else []) + ([lt(kcol, s.keys)] if s.keys % bk else [])
    if s.mask is not None:
        mshape = s.shapes[s.mask]
        idx = tuple(_broadcast([*bcoords, qrow, kcol], mshape))
        mload = Load(s.mask, idx)
        if ctx.program.buffer(s.mask).dtype == DType.bool:
            mcond = mload
            if valid:
                mcond = Select(_and(valid), mload, Const(False, DType.bool))
            keep.append(mcond)
        else:
            madd = mload if ctx.program.buffer(s.mask).dtype == t else Cast(t, mload)
            if valid:
                madd = Select(_and(valid), madd, zero)
            score = Binary("+", score, madd)
    cond = _and(keep)
    value = score if cond is None else Select(cond, score, ninf)
    step.append(tile_mapping((bq, bk), THREADS, 1).on(tid).loop([si, sj], [
        Store(acc, (), zero),
        Loop(se, 0, s.emb, (Reduce(acc, (), "+", Binary("*", Load(Qs, (Var(si), Var(se))),
                                                           Load(Ks, (Var(sj), Var(se))))),)),
        Store(Ss, (Var(si), Var(sj)), value),
    ]))
    step.append(Barrier())

    # online softmax statistics, one thread per query row
    ti, tj = fresh("ti"), fresh("tj")
    i_ = Var(ti)
    shift = Select(Binary("==", Load(mx, ()), ninf), zero, Load(mx, ()))
    p = Call("exp", (Binary("-", Load(Ss, (i_, Var(tj))), shift),))
    step.append(spatial(bq).on(tid).loop([ti], [
        Store(mx, (), Load(m_s, (i_,))),
        Loop(tj, 0, bk, (Reduce(mx, (), "max", Load(Ss, (i_, Var(tj)))),)),
        Store(tot, (), zero),
        Loop(tj, 0, bk, (
            Store(Ss, (i_, Var(tj)), p),
            Reduce(tot, (), "+", Load(Ss, (i_, Var(tj)))),
        )),
        Store(a_s, (i_,), Call("exp", (Binary("-", Load(m_s, (i_,)), shift),))),
        Store(l_s, (i_,), Binary("+", Binary("*", Load(a_s, (i_,)), Load(l_s, (i_,))), Load(tot, ()))),
        Store(m_s, (i_,), Load(mx, ())),
    ]))
    step.append(Barrier())

    # O = alpha O + P V
    oi, oe = eo.coords
    oj = fresh("oj")
    reg = (eo.register(),)
    step += eo.wrap([
        Store(o_r, reg, Binary("*", Load(a_s, (oi,)), Load(o_r, reg))),
        Loop(oj, 0, bk, (Reduce(o_r, reg, "+", Binary("*", Load(Ss, (oi, Var(oj))), Load(Vs, (Var(oj), oe)))),)),
    ])
    step.append(Barrier())
    body.append(Loop(kt, 0, -(-s.keys // bk), tuple(step)))

    # out = O / l, zero for fully masked rows
    orow = Binary("+", q0, oi)
    lv = Load(l_s, (oi,))
    res = Select(Binary(">", lv, zero), Binary("/", Load(o_r, reg), lv), zero)
    out_idx = (*_broadcast(bcoords, s.shapes[s.out][:-2]), orow, oe)
    store: Node = Store(s.out, out_idx, res)
    if s.length % bq:
        store = If(lt(orow, s.length), (store,))
    body += eo.wrap([store])
    extra = [
        Buffer(Qs, (bq, s.emb + 1), t, "shared"), Buffer(Ks, (bk, s.emb + 1), t, "shared"),
        Buffer(Vs, (bk, s.ev), t, "shared"), Buffer(Ss, (bq, bk + 1), t, "shared"),
        Buffer(m_s, (bq,), t, "shared"), Buffer(l_s, (bq,), t, "shared"), Buffer(a_s, (bq,), t, "shared"),
        Buffer(o_r, (eo.registers(),), t, "register"), Buffer(acc, (), t, "register"),
        Buffer(mx, (), t, "register"), Buffer(tot, (), t, "register"),
    ]
    return ctx.kernel(frame, body, "attention", extra)
