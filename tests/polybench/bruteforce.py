"""A brute-force legality oracle, independent of isl.

It walks the original program on concrete sizes, recording every statement instance in
execution order with the array cells it reads and writes.  A *conflicting pair* is two
distinct instances touching one cell, at least one writing it, the first running first.
Given the time of every instance under a new schedule, the schedule is legal iff every
conflicting pair keeps its order, and a loop at time position ``k`` may run in parallel iff
no conflicting pair between two statements inside it has equal times before ``k`` and
different times at ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.loops import Binary, Const, Expr, If, Load, Loop, Program, Reduce, Select, Unary, Var, loads_of

Key = tuple[str, tuple[int, ...]]


def evaluate(e: Expr, env: dict[str, int]) -> int:
    """Integer value of an index, bound or condition (no loads)."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Unary):
        v = evaluate(e.operand, env)
        return -v if e.op == "-" else (not v)
    if isinstance(e, Select):
        return evaluate(e.if_true, env) if evaluate(e.cond, env) else evaluate(e.if_false, env)
    assert isinstance(e, Binary), f"cannot evaluate {e}"
    a, b = evaluate(e.lhs, env), evaluate(e.rhs, env)
    ops = {
        "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "floordiv": lambda: a // b,
        "floormod": lambda: a % b, "min": lambda: min(a, b), "max": lambda: max(a, b),
        "/": lambda: int(a / b), "%": lambda: a - b * int(a / b), "<": lambda: a < b, "<=": lambda: a <= b,
        ">": lambda: a > b, ">=": lambda: a >= b, "==": lambda: a == b, "!=": lambda: a != b,
        "&&": lambda: a and b, "||": lambda: a or b,
    }
    return ops[e.op]()


@dataclass
class Access:
    instance: Key
    order: int
    write: bool


def trace(program: Program, params: dict) -> tuple[list[Key], dict[tuple, list[Access]]]:
    """Instances in execution order, and for every cell its accesses in order."""
    env = {p.name: int(params[p.name]) for p in program.params if p.dtype.is_integer}
    instances: list[Key] = []
    cells: dict[tuple, list[Access]] = {}
    iterators: list[str] = []

    def cell(ld: Load) -> tuple:
        return (ld.buffer, tuple(evaluate(i, env) for i in ld.indices))

    def visit(nodes) -> None:
        for n in nodes:
            if isinstance(n, Loop):
                iterators.append(n.iterator)
                for v in range(evaluate(n.lower, env), evaluate(n.upper, env), n.step):
                    env[n.iterator] = v
                    visit(n.body)
                env.pop(n.iterator, None)
                iterators.pop()
            elif isinstance(n, If):
                visit(n.then if evaluate(n.cond, env) else n.orelse)
            else:
                key = (n.name, tuple(env[i] for i in iterators))
                order = len(instances)
                instances.append(key)
                reads = [ld for e in (n.value, *n.indices) for ld in loads_of(e)]
                if isinstance(n, Reduce):
                    reads.append(n.target)
                for ld in reads:
                    cells.setdefault(cell(ld), []).append(Access(key, order, False))
                cells.setdefault(cell(n.target), []).append(Access(key, order, True))

    visit(program.body)
    return instances, cells


def conflicting_pairs(cells: dict[tuple, list[Access]]) -> dict[tuple[Key, Key], set[tuple[str, tuple]]]:
    """``(source, sink) -> {(kind, cell)}`` for every ordered conflicting pair."""
    out: dict[tuple[Key, Key], set[tuple[str, tuple]]] = {}
    for c, accesses in cells.items():
        for x in range(len(accesses)):
            a = accesses[x]
            for y in range(x + 1, len(accesses)):
                b = accesses[y]
                if a.instance == b.instance or not (a.write or b.write) or a.order >= b.order:
                    continue
                kind = "output" if a.write and b.write else "flow" if a.write else "anti"
                out.setdefault((a.instance, b.instance), set()).add((kind, c))
    return out


@dataclass
class BruteVerdict:
    legal: bool
    order_violations: set[tuple[Key, Key]]
    parallel_violations: dict[str, set[tuple[Key, Key]]]
    pairs: dict[tuple[Key, Key], set[tuple[str, tuple]]]


def judge(program: Program, schedule, params: dict) -> BruteVerdict:
    """The brute-force verdict of ``schedule`` (a ``kiln.loops.Schedule``) on ``params``."""
    instances, cells = trace(program, params)
    times = schedule.instance_times(params)
    flat = {(s, pt): t for s, pts in times.items() for pt, t in pts.items()}
    missing = [k for k in instances if k not in flat]
    assert not missing, f"schedule has no time for instances {missing[:3]}"
    assert len(flat) == len(instances), "schedule times instances the program does not run"
    pairs = conflicting_pairs(cells)
    order = {p for p in pairs if flat[p[0]] >= flat[p[1]]}
    parallel: dict[str, set] = {}
    for loop, k in schedule.parallel_loops().items():
        inside = set(schedule.loop_statements(loop))
        parallel[loop] = {p for p in pairs if p[0][0] in inside and p[1][0] in inside
                          and flat[p[0]][:k] == flat[p[1]][:k] and flat[p[0]][k] != flat[p[1]][k]}
    legal = not order and not any(parallel.values())
    return BruteVerdict(legal, order, parallel, pairs)
