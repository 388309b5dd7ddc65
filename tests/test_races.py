"""The race checker of GPU kernels: racy kernels are refused with the two workers, the cell
and the statements named; barrier-separated, double-buffered, shuffle, warp-synchronous and
cp.async-pipelined kernels pass.  Also the kernel side of the polyhedral model."""

from __future__ import annotations

import time

import pytest

from kiln.ir.errors import ScheduleError, VerificationError
from kiln.ir.loops import (
    Annotation, Barrier, Binary, Buffer, Const, CopyCommit, CopyWait, If, Load, Loop, Program, Reduce, Store, Var,
    VectorCopy, parse_program,
)
from kiln.ir.poly import build_model
from kiln.ir.types import DType
from kiln.mapping import RaceError, auto_map, check_races, repeat, spatial

F32 = DType.float32


def kernel(body: str, buffers: str, threads: int = 8, blocks: int = 1) -> Program:
    """A one-dimensional kernel: ``b`` over blocks, ``t`` over threads."""
    lines = "\n".join("      " + line for line in body.strip().splitlines())
    return parse_program(f"""
program k() {{
{buffers}
  for b in [0, {blocks}) @mapped("blockIdx.x") {{
    for t in [0, {threads}) @mapped("threadIdx.x") {{
{lines}
    }}
  }}
}}""")


def race(program: Program) -> RaceError:
    with pytest.raises(RaceError) as e:
        check_races(program)
    assert isinstance(e.value, ScheduleError)
    return e.value


SHIFT = """
  buffer x: f32[8]
  buffer y: f32[8]
  buffer s: f32[9] shared"""


def test_a_racy_kernel_is_refused_naming_workers_cell_and_statements():
    e = race(kernel("""
W: s[t] = x[t]
R: y[t] = s[t + 1]""", SHIFT))
    assert str(e) == ("race in kernel 'k': W in block (0,) thread (1,) writes s[1] and R in block (0,) thread (0,) "
                      "reads s[1] in the same barrier phase; put a barrier between them or give each thread its "
                      "own cell")
    assert (e.buffer, e.cell, e.same_block) == ("s", (1,), True)
    assert (e.first.statement, e.first.worker.thread, e.second.statement, e.second.worker.thread) == \
        ("W", (1,), "R", (0,))


def test_a_barrier_between_producer_and_consumer_makes_it_race_free():
    check_races(kernel("""
W: s[t] = x[t]
barrier
R: y[t] = s[t + 1]""", SHIFT))
    # each thread reading its own cell needs no barrier either
    check_races(kernel("""
W: s[t] = x[t]
R: y[t] = s[t]""", SHIFT))


def tree_reduction(barrier: str) -> Program:
    return kernel(f"""
S0: s[t] = x[b * 8 + t]
barrier
if (t < 4) {{
  S1: s[t] += s[t + 4]
}}
{barrier}
if (t < 2) {{
  S2: s[t] += s[t + 2]
}}
barrier
if (t < 1) {{
  S3: s[t] += s[t + 1]
}}
barrier
if (t == 0) {{
  S4: y[b] = s[0]
}}""", """
  buffer x: f32[32]
  buffer y: f32[4]
  buffer s: f32[8] shared""", blocks=4)


def test_a_missing_barrier_in_a_shared_memory_reduction_is_caught():
    check_races(tree_reduction("barrier"))
    e = race(tree_reduction(""))
    assert "S1 in block (0,) thread (2,) accumulates into s[2] and S2 in block (0,) thread (0,) reads s[2]" in str(e)


def test_blocks_never_synchronize_and_reductions_are_not_atomic():
    e = race(kernel("S0: y[t] = 1.0", "  buffer y: f32[8]", blocks=2))
    assert str(e).startswith("race in kernel 'k': S0 in block (0,) thread (0,) writes y[0] and S0 in block (1,) "
                             "thread (0,) writes y[0]; blocks never synchronize")
    assert not e.same_block
    # a barrier does not help across blocks
    e = race(kernel("S0: y[0] = x[t]\nbarrier", "  buffer x: f32[8]\n  buffer y: f32[8]", threads=1, blocks=2))
    assert "block (1,)" in str(e)
    e = race(kernel("S0: y[b] += x[t]", "  buffer x: f32[8]\n  buffer y: f32[2]", blocks=2))
    assert "S0 in block (0,) thread (0,) accumulates into y[0] and S0 in block (0,) thread (1,) accumulates " \
           "into y[0] in the same barrier phase; there are no atomics" in str(e)
    # shared memory is per block; registers per thread
    check_races(kernel("S0: s[0] = x[b]\nbarrier\nS1: y[b] = s[0]",
                       "  buffer x: f32[8]\n  buffer y: f32[8]\n  buffer s: f32[1] shared", threads=1, blocks=8))
    check_races(kernel("S0: r[0] = x[t]\nS1: r[0] += 1.0\nS2: y[b * 8 + t] = r[0]",
                       "  buffer x: f32[8]\n  buffer y: f32[16]\n  buffer r: f32[1] register", blocks=2))


def test_the_last_statements_of_one_iteration_share_a_phase_with_the_first_of_the_next():
    loop = """
for k in [0, 4) {{
  R: y[t] += s[t + 1]
  barrier
  W: s[t] = x[k * 8 + t]
  {end}
}}"""
    bufs = "  buffer x: f32[32]\n  buffer y: f32[8]\n  buffer s: f32[9] shared"
    e = race(kernel(loop.format(end=""), bufs))
    assert "W (k=0) in block (0,) thread (1,) writes s[1] and R (k=1) in block (0,) thread (0,) reads s[1]" in str(e)
    check_races(kernel(loop.format(end="barrier"), bufs))


def test_double_buffered_tiles_pass_with_one_barrier_per_iteration():
    body = """
L0: s[0, t] = a[0, t]
barrier
for k in [0, 16) {{
  if (k + 1 < 16) {{
    L1: s[floormod({next}, 2), t] = a[k + 1, t]
  }}
  C: acc[0] += s[floormod(k, 2), 7 - t]
  barrier
}}
Y: y[t] = acc[0]"""
    bufs = "  buffer a: f32[16, 8]\n  buffer y: f32[8]\n  buffer s: f32[2, 8] shared\n  buffer acc: f32[1] register"
    check_races(kernel(body.format(next="k + 1"), bufs))
    e = race(kernel(body.format(next="k"), bufs))  # overwrites the tile being read
    assert "L1 (k=0) in block (0,) thread (0,) writes s[0, 0] and C (k=0) in block (0,) thread (7,) reads s[0, 0]" \
        in str(e)


def test_shuffles_and_warp_barriers():
    # a warp reduction through shuffles of registers: nothing shared, no race
    check_races(kernel("""
S0: r[0] = x[b * 32 + t]
S1: r[0] = shfl_xor(r[0], 16, 32)
S2: r[0] = shfl_xor(r[0], 8, 32)
if (t == 0) {
  S3: y[b] = r[0]
}""", "  buffer x: f32[64]\n  buffer y: f32[2]\n  buffer r: f32[1] register", threads=32, blocks=2))
    # a shuffle writing shared memory is an ordinary write
    e = race(kernel("S0: s[0] = shfl_down(x[t], 1, 32)", "  buffer x: f32[32]\n  buffer s: f32[1] shared", threads=32))
    assert "S0 in block (0,) thread (0,) writes s[0] and S0 in block (0,) thread (1,) writes s[0]" in str(e)
    swap = """
W: s[t] = x[t]
barrier warp
R: y[t] = s[{other}]"""
    bufs = "  buffer x: f32[64]\n  buffer y: f32[64]\n  buffer s: f32[64] shared"
    check_races(kernel(swap.format(other="floordiv(t, 2) * 2 + 1 - floormod(t, 2)"), bufs, threads=64))
    e = race(kernel(swap.format(other="floormod(t + 32, 64)"), bufs, threads=64))  # the other warp
    assert "W in block (0,) thread (0,) writes s[0] and R in block (0,) thread (32,) reads s[0]" in str(e)


def pipeline(wait: bool = True, pending: int = 1, barrier_after_wait: bool = True) -> Program:
    """A cp.async pipeline: stage k+1 is copied while stage k is read."""
    t, k, kk, bx = Var("t"), Var("k"), Var("kk"), Var("bx")

    def copy(stage, tile):
        return spatial(64, 4).on(t).loop(["i", "j"], [VectorCopy(
            "sa", (stage, Var("i"), Var("j") * 4), "A", (Var("i"), tile * 16 + Var("j") * 4), 4, asynchronous=True)])

    step = [If(Binary("<", k + 1, Const(4)), [copy((k + 1) % 2, k + 1)]), CopyCommit()]
    step += [CopyWait(pending)] if wait else []
    step += [Barrier()] if barrier_after_wait else []
    step += [Loop("kk", 0, 16, [Reduce("acc", (0,), "+", Load("sa", (k % 2, t % 64, kk)))]), Barrier()]
    body = [Store("acc", (0,), Const(0.0, F32)), copy(0, 0), CopyCommit(), Loop("k", 0, 4, step),
            Store("Y", (bx * 64 + t % 64, t // 64), Load("acc", (0,)))]
    threads = Loop("t", 0, 256, body, annotation=Annotation("mapped", axis="threadIdx.x"))
    return Program("pipe", (), (Buffer("A", (64, 64), F32), Buffer("Y", (128, 4), F32),
                                Buffer("sa", (2, 64, 16), F32, "shared"), Buffer("acc", (1,), F32, "register")),
                   [Loop("bx", 0, 2, [threads], annotation=Annotation("mapped", axis="blockIdx.x"))])


def test_asynchronous_copies_complete_at_their_wait():
    check_races(pipeline())
    check_races(pipeline(pending=0))
    for bad in (pipeline(wait=False), pipeline(pending=2), pipeline(barrier_after_wait=False)):
        e = race(bad)
        assert "S1 in block (0,) thread (0,) copies asynchronously into sa[0, 0, 0] and S3 (k=0, kk=0) in block " \
               "(0,) thread (64,) reads sa[0, 0, 0] while the asynchronous copy S1 may still be in flight" in str(e)


def matmul(BK: int = 8, second_barrier: bool = True) -> Program:
    """A 128x128x64 matmul: 2x2 blocks of 256 threads, 64x64 tiles, 4x4 register tiles."""
    bx, by, t, k = Var("bx"), Var("by"), Var("t"), Var("k")
    i, j, kk = Var("i"), Var("j"), Var("kk")
    tile = spatial(16, 16) * repeat(4, 4)
    loads = [auto_map(64, BK, workers=256).on(t).loop(["i", "j"], [
                 Store("sa", (i, j), Load("A", (by * 64 + i, k * BK + j)))]),
             auto_map(BK, 64, workers=256).on(t).loop(["i", "j"], [
                 Store("sb", (i, j), Load("B", (k * BK + i, bx * 64 + j)))])]
    compute = tile.on(t).loop(["i", "j"], [Loop("kk", 0, BK, [
        Reduce("acc", (i % 4, j % 4), "+", Load("sa", (i, kk)) * Load("sb", (kk, j)))])])
    steps = loads + [Barrier(), compute] + ([Barrier()] if second_barrier else [])
    body = [tile.on(t).loop(["i", "j"], [Store("acc", (i % 4, j % 4), Const(0.0, F32))]),
            Loop("k", 0, 64 // BK, steps),
            tile.on(t).loop(["i", "j"], [Store("C", (by * 64 + i, bx * 64 + j), Load("acc", (i % 4, j % 4)))])]
    threads = Loop("t", 0, 256, body, annotation=Annotation("mapped", axis="threadIdx.x"))
    blocks = Loop("by", 0, 2, [Loop("bx", 0, 2, [threads], annotation=Annotation("mapped", axis="blockIdx.x"))],
                  annotation=Annotation("mapped", axis="blockIdx.y"))
    return Program("matmul", (), (Buffer("A", (128, 64), F32), Buffer("B", (64, 128), F32),
                                  Buffer("C", (128, 128), F32), Buffer("sa", (64, BK), F32, "shared"),
                                  Buffer("sb", (BK, 64), F32, "shared"), Buffer("acc", (4, 4), F32, "register")),
                   [blocks])


def test_a_256_thread_matmul_is_checked_quickly():
    start = time.perf_counter()
    check_races(matmul())
    assert time.perf_counter() - start < 2.0
    e = race(matmul(second_barrier=False))
    # the loads of iteration k + 1 overwrite the tile the threads still read in iteration k
    assert "S1 (k=1, i_r_1=0) in block (0, 0) thread (0,) writes sa[0, 0] and S3 (k=0, i_r_3=0, j_r_1=0, kk=0) in " \
           "block (0, 0) thread (1,) reads sa[0, 0]" in str(e)


def test_divergent_barriers_and_malformed_kernels_are_refused():
    with pytest.raises(VerificationError, match=r"a barrier sits under if \(t < 4\), which depends on thread "
                                                r"iterator\(s\) t; every thread of the block must reach it"):
        check_races(kernel("if (t < 4) {\n  barrier\n}", "  buffer y: f32[8]"))
    with pytest.raises(VerificationError, match="sits under loop 'k', which depends on thread iterator"):
        check_races(kernel("for k in [0, t) {\n  barrier\n}", "  buffer y: f32[8]"))
    # a task loop wider than the launch leaves a thread guard around its barrier
    guarded = Program("g", (), (Buffer("y", (8,), F32),), [Loop("t", 0, 16, [spatial(8).on(Var("t")).loop(
        ["i"], [Store("y", (Var("i"),), 1.0), Barrier()])], annotation=Annotation("mapped", axis="threadIdx.x"))])
    with pytest.raises(VerificationError, match=r"under if \(t < 8\)"):
        check_races(guarded)
    twice = parse_program("""
program k() {
  buffer y: f32[8]
  for a in [0, 2) @mapped("threadIdx.x") {
    for c in [0, 2) @mapped("threadIdx.x") {
      S0: y[a] = 1.0
    }
  }
}""")
    with pytest.raises(VerificationError, match="maps a second loop to threadIdx.x"):
        check_races(twice)


def test_multi_dimensional_workers_are_named_x_first():
    p = parse_program("""
program k() {
  buffer y: f32[4]
  for by in [0, 2) @mapped("blockIdx.y") {
    for bx in [0, 3) @mapped("blockIdx.x") {
      for ty in [0, 2) @mapped("threadIdx.y") {
        for tx in [0, 4) @mapped("threadIdx.x") {
          S0: y[tx] = 1.0
        }
      }
    }
  }
}""")
    e = race(p)
    assert "S0 in block (0, 0) thread (0, 0) writes y[0] and S0 in block (0, 0) thread (0, 1) writes y[0]" in str(e)


def test_the_model_reads_kernels():
    p = kernel("""
for (i) in spatial(8) on t {
  V: s[0, i * 4] = vec4(x[b, i * 4])
}
barrier
H: r[0] = shfl_xor(s[0, t], 1, 8)""", """
  buffer x: f32[2, 32]
  buffer s: f32[1, 32] shared
  buffer r: f32[1] register""", blocks=2)
    model = build_model(p)
    assert "lane" not in str(model.program) and set(model.statements) == {"V", "H"}
    v = model.statement("V")
    dst = next(a for a in v.accesses if a.is_write)
    assert dst.relation.range().count_val().to_python() == 32 and dst.exact  # 8 threads x 4 lanes
    h = model.statement("H")
    assert [(a.array, a.is_write) for a in h.accesses] == [("r", True), ("s", False)]
    synced = build_model(p, syncs=True)
    assert [n for n, ps in synced.statements.items() if ps.is_sync] == ["barrier0"]
    check_races(p)


# ----------------------------------------------------------------------------- against brute force
def _eval(e, env):
    from kiln.ir.loops import Binary as Bin, Const as C, Unary, Var as V

    if isinstance(e, C):
        return e.value
    if isinstance(e, V):
        return env[e.name]
    if isinstance(e, Unary):
        v = _eval(e.operand, env)
        return -v if e.op == "-" else not v
    assert isinstance(e, Bin), e
    a, b = _eval(e.lhs, env), _eval(e.rhs, env)
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "floordiv": lambda: a // b,
            "floormod": lambda: a % b, "<": lambda: a < b, "<=": lambda: a <= b, "==": lambda: a == b,
            "&&": lambda: a and b, "||": lambda: a or b}[e.op]()


def brute_force_races(program: Program) -> set[tuple]:
    """Every racing pair of accesses, found by running each thread and counting barriers:
    ``frozenset({(stmt, block, thread, write), ...})`` with the cell."""
    from kiln.ir.loops import Shuffle

    blocks, threads = program.body[0], program.body[0].body[0]
    scopes = {buf.name: buf.scope for buf in program.buffers}
    events = []

    def walk(nodes, env, counts):
        for n in nodes:
            if isinstance(n, Loop):
                for v in range(_eval(n.lower, env), _eval(n.upper, env)):
                    walk(n.body, {**env, n.iterator: v}, counts)
            elif isinstance(n, If):
                walk(n.then if _eval(n.cond, env) else n.orelse, env, counts)
            elif isinstance(n, Barrier):
                counts[1] += 1
                counts[0] += n.scope == "block"
            else:
                refs = [(n.target, True)] + ([(n.target, False)] if isinstance(n, Reduce) else [])
                refs += [(ld, False) for ld in _loads(n.value)]
                if isinstance(n, Shuffle):
                    refs += [(ld, False) for ld in _loads(n.offset)]
                for ref, write in refs:
                    cell = tuple(_eval(i, env) for i in ref.indices)
                    events.append((ref.buffer, cell, write, n.name, env["b"], env["t"], *counts))

    for b in range(blocks.upper.value):
        for t in range(threads.upper.value):
            walk(threads.body, {"b": b, "t": t}, [0, 0])
    by_cell: dict = {}
    for ev in events:
        if scopes[ev[0]] != "register":
            by_cell.setdefault(ev[:2], []).append(ev)
    races = set()
    for (buf, cell), evs in by_cell.items():
        for x in evs:
            for y in evs:
                if not (x[2] or y[2]):
                    continue
                if x[4] == y[4] and x[5] != y[5] and x[6] == y[6] and (x[5] // 32 != y[5] // 32 or x[7] == y[7]):
                    races.add((buf, cell, frozenset({(x[3], x[4], x[5]), (y[3], y[4], y[5])})))
                elif x[4] != y[4] and scopes[buf] == "global":
                    races.add((buf, cell, frozenset({(x[3], x[4], x[5]), (y[3], y[4], y[5])})))
    return races


def _loads(e):
    from kiln.ir.loops import loads_of

    return loads_of(e)


def random_kernel(rng, threads: int, blocks: int) -> Program:
    from kiln.ir.loops import Shuffle

    t, b = Var("t"), Var("b")
    size = max(8, threads)
    counter = iter(range(1000))

    def index(iters):
        e = Const(rng.choice([0, 1, 2])) * t + Const(rng.randrange(size))
        for it in iters:
            e = e + Const(rng.choice([0, 1, 3])) * Var(it)
        if rng.random() < 0.3:
            e = e + Const(rng.choice([1, 2])) * b
        return Binary("floormod", e, Const(size))

    def statement(iters, uniform):
        buf = rng.choice(["s", "s", "g", "r"])
        src = Load(rng.choice(["s", "g", "r"]), (index(iters),))
        name = f"S{next(counter)}"
        kind = rng.random()
        if kind < 0.15 and uniform:  # a collective: only where every thread gets
            return Shuffle(buf, (index(iters),), src, "xor", 1, 2, name=name)
        if kind < 0.35:
            return Reduce(buf, (index(iters),), "+", src, name=name)
        return Store(buf, (index(iters),), src, name=name)

    def nodes(depth, iters, uniform):
        out = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if r < 0.25 and uniform:
                out.append(Barrier("warp" if rng.random() < 0.25 else "block"))
            elif r < 0.4 and depth < 2:
                it = f"k{depth}"
                out.append(Loop(it, 0, rng.choice([2, 3]), nodes(depth + 1, iters + [it], uniform)))
            elif r < 0.5 and depth < 3:
                on_thread = rng.random() < 0.6 or not iters
                cond = Binary("<", t if on_thread else Var(iters[-1]), Const(rng.randrange(1, threads)))
                out.append(If(cond, nodes(depth + 1, iters, uniform and not on_thread)))
            else:
                out.append(statement(iters, uniform))
        return out

    body = nodes(0, [], True)
    bufs = (Buffer("s", (size,), F32, "shared"), Buffer("g", (size,), F32), Buffer("r", (size,), F32, "register"))
    inner = Loop("t", 0, threads, body, annotation=Annotation("mapped", axis="threadIdx.x"))
    return Program("rand", (), bufs, [Loop("b", 0, blocks, [inner], annotation=Annotation("mapped", axis="blockIdx.x"))])


def _agree(seed: int) -> None:
    import random

    rng = random.Random(seed)
    p = random_kernel(rng, rng.choice([2, 4, 8, 64]), rng.choice([1, 2]))
    expected = brute_force_races(p)
    try:
        check_races(p)
    except RaceError as e:
        assert expected, f"seed {seed}: no race, but check_races says {e}\n{p}"
        reported = (e.buffer, e.cell, frozenset({(e.first.statement, e.first.worker.block[0], e.first.worker.thread[0]),
                                                  (e.second.statement, e.second.worker.block[0],
                                                   e.second.worker.thread[0])}))
        assert reported in expected, f"seed {seed}: {e} is not a race of the program\n{p}"
    else:
        assert not expected, f"seed {seed}: check_races missed {sorted(expected, key=str)[0]}\n{p}"


@pytest.mark.parametrize("seed", range(12))
def test_check_races_agrees_with_brute_force(seed):
    _agree(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12, 400))
def test_check_races_agrees_with_brute_force_sweep(seed):
    _agree(seed)
