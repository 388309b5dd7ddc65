"""Latency of checked schedule steps (kiln.loops.Schedule) on a fixed set of cases.

The set: every kernel of ``tests/polybench`` (PolyBench-style, 18 programs) plus four
inline nests, and for each loop of each program the steps below that apply structurally
(a step that raises ``ScheduleError`` is not in the set): interchange with its child,
tiling (one and two loops), strip-mining, skews by enclosing and by enclosed loops,
unimodular transforms, reversal, scaling, shifts (by a constant and by a size parameter),
index-set splitting, fusion, full fusion, fission, full splitting, parallel and vectorize
marks; and two-step sequences (skew then interchange, tile then parallel, split then
parallel, fuse then parallel).  The set is built the same way every run.

Each case times its last step, checked, on a copy of a schedule whose state before the step
has been checked (as in any sequence of checked steps): model and dependences are computed
once per program, and the checker's memo is cleared before each case, so it holds only what
checking that state left in it.  ``cold`` times the same step with the memo empty.  Each
sample is one call timed by :func:`kiln.runtime.timing.best_time`; a case's time is the
median of ``--repeat`` samples, and the table gives the median and the 99th percentile over
the cases.  A *refusal* is a case the checker does not answer (an error other than an
illegal verdict).  ``--brute`` confirms every verdict by brute-force enumeration
(``tests/polybench/bruteforce.py``): a legal verdict must have no violated pair at the test
sizes, an illegal one must name a pair the brute force finds violated.

Usage::

    python3 benchmarks/legality_check.py [--repeat 5] [--brute] [--update-docs docs/loops.md]

``--update-docs`` rewrites the table between the ``legality-benchmark`` markers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import kiln.loops as kl
from kiln.ir.errors import IllegalTransformError, ScheduleError
from kiln.tuning.measure import best_time

POLYBENCH = Path(__file__).resolve().parents[1] / "tests" / "polybench"

INLINE = {
    "matmul": """
for (i = 0; i < N; i++)
  for (j = 0; j < N; j++)
    for (k = 0; k < N; k++)
      C[i][j] += A[i][k] * B[k][j];
""",
    "wavefront": """
double A[N][M];
for (i = 1; i < N; i++)
  for (j = 1; j < M; j++)
    A[i][j] = A[i - 1][j] + A[i][j - 1];
""",
    "three-stage": """
double A[N], B[N], C[N], D[N];
for (i = 1; i < N; i++) {
  B[i] = A[i] * 2.0;
  C[i] = B[i] + B[i - 1];
  D[i] = C[i] * C[i];
}
""",
    "stencil-pipeline": """
double A[N], B[N], C[N];
for (i = 1; i < N - 1; i++) B[i] = A[i - 1] + A[i + 1];
for (i = 1; i < N - 1; i++) C[i] = B[i] * 0.5;
for (i = 1; i < N - 1; i++) A[i] = C[i] - B[i];
""",
}
INLINE_PARAMS = {"matmul": {"N": 4}, "wavefront": {"N": 4, "M": 5}, "three-stage": {"N": 6},
                 "stencil-pipeline": {"N": 7}}

Step = tuple[str, dict]
Case = tuple[str, list[Step]]


def programs() -> dict[str, kl.Program]:
    out = {}
    for path in sorted(POLYBENCH.glob("*.c")):
        ident = path.stem.replace("-", "_")
        out[path.stem] = kl.from_c(path.read_text(), name=ident if not ident[0].isdigit() else "k" + ident)
    for name, source in INLINE.items():
        out[name] = kl.from_c(source, name=name.replace("-", "_"))
    return out


def _steps_at(s: kl.Schedule, loop: str) -> list[Step]:
    """The single steps tried at ``loop`` (before the structural filter)."""
    info = {n.name: n for n in kl.nodes(s) if n.kind == "band"}
    n = info[loop]
    bands = [m for m in kl.nodes(s) if m.kind == "band"]
    child = next((m for m in bands if m.path == n.path + (0,)), None)
    outer = [m for m in bands if len(m.path) < len(n.path) and n.path[:len(m.path)] == m.path]
    inner = [m for m in bands if len(m.path) > len(n.path) and m.path[:len(n.path)] == n.path]
    param = s.model.params[0] if s.model.params else None
    out: list[Step] = []
    if child is not None:
        out += [("interchange", {"a": loop, "b": child.name}),
                ("tile", {"loops": [loop, child.name], "sizes": [4, 4]}),
                ("transform", {"loops": [loop, child.name], "matrix": [[1, 1], [0, 1]]}),
                ("transform", {"loops": [loop, child.name], "matrix": [[1, 0], [1, 1]]}),
                ("transform", {"loops": [loop, child.name], "matrix": [[0, 1], [-1, 0]]})]
    out += [("tile", {"loops": [loop], "sizes": [8]}), ("split", {"loop": loop, "factor": 4})]
    out += [("skew", {"target": loop, "source": m.name, "factor": 1}) for m in outer[-1:]]
    out += [("skew", {"target": loop, "source": m.name, "factor": 1}) for m in inner[:1]]
    out += [("reverse", {"loop": loop}), ("scale", {"loop": loop, "factor": 2}),
            ("split_at", {"loop": loop, "value": 2})]
    if len(n.statements) > 1:
        out.append(("shift", {"loop": loop, "statement": n.statements[-1], "offset": 1}))
    if param is not None:
        out.append(("shift", {"loop": loop, "statement": None, "offset": param}))
    sibling = next((m for m in bands if n.path and m.path == n.path[:-1] + (n.path[-1] + 1,)), None)
    if sibling is not None:
        out += [("fuse", {"a": loop, "b": sibling.name}), ("full_fuse", {"loop": loop})]
    out += [("fission", {"loop": loop, "split_before_child": 1}), ("full_split", {"loop": loop}),
            ("parallel", {"loop": loop}), ("vectorize", {"loop": loop})]
    return out


def _applies(program: kl.Program, steps: list[Step]) -> bool:
    """Whether every step applies structurally and the steps before the last are legal."""
    s = kl.Schedule(program, check=False)
    try:
        for primitive, args in steps:
            s.apply(primitive, **args)
        if len(steps) > 1:
            kl.Schedule.replay(program, [{"primitive": p, "args": a} for p, a in steps[:-1]])
    except (ScheduleError, IllegalTransformError, TypeError):
        return False
    return True


def cases(progs: dict[str, kl.Program]) -> list[Case]:
    """The fixed case set (see the module docstring)."""
    out: list[Case] = []
    for name, program in progs.items():
        s = kl.Schedule(program, check=False)
        for loop in s.loops():
            for step in _steps_at(s, loop):
                if _applies(program, [step]):
                    out.append((name, [step]))
            for first, then in _sequences(s, loop):
                if _applies(program, [first, then]):
                    out.append((name, [first, then]))
    return out


def _sequences(s: kl.Schedule, loop: str) -> list[tuple[Step, Step]]:
    info = [n for n in kl.nodes(s) if n.kind == "band"]
    n = next(m for m in info if m.name == loop)
    child = next((m for m in info if m.path == n.path + (0,)), None)
    out: list[tuple[Step, Step]] = [(("split_at", {"loop": loop, "value": 2}), ("parallel", {"loop": f"{loop}_b"}))]
    if child is not None:
        out += [(("skew", {"target": child.name, "source": loop, "factor": 1}),
                 ("interchange", {"a": loop, "b": child.name})),
                (("tile", {"loops": [loop, child.name], "sizes": [4, 4]}), ("parallel", {"loop": f"{loop}_tile"}))]
    sibling = next((m for m in info if n.path and m.path == n.path[:-1] + (n.path[-1] + 1,)), None)
    if sibling is not None:
        out.append((("fuse", {"a": loop, "b": sibling.name}), ("parallel", {"loop": loop})))
    return out


def _checker(s: kl.Schedule):
    try:
        from kiln.ir.poly.legality import checker_for
    except ImportError:  # the code before the checker had no memo
        return None
    return checker_for(s.model, s.dependences)


def _apply(primitive: str, args: dict) -> Callable[[kl.Schedule], object]:
    def run(trial: kl.Schedule) -> object:
        try:
            trial.apply(primitive, **args)
            return True
        except IllegalTransformError as e:
            return e
    return run


def measure(progs: dict[str, kl.Program], case_list: list[Case], repeat: int) -> list[dict]:
    rows = []
    for name, steps in case_list:
        program = progs[name]
        warm, cold, outcome = [], [], None
        for _ in range(repeat):
            s = kl.Schedule(program)
            checker = _checker(s)
            try:
                for primitive, args in steps[:-1]:
                    s.apply(primitive, **args)
            except Exception as e:  # noqa: BLE001 - the prefix is legal: any error is a refusal
                outcome = f"refused: {type(e).__name__}: {e}"
                break
            s.dependences  # computed once per program, never inside a timed step
            if checker is not None:
                checker.clear()
                s.verify()
            step = _apply(*steps[-1])
            try:
                trial = s.copy()
                warm.append(best_time(lambda: step(trial), repeat=1, warmup=0))
                outcome = step(s.copy())
                if checker is not None:
                    checker.clear()
                trial = s.copy()
                cold.append(best_time(lambda: step(trial), repeat=1, warmup=0))
            except Exception as e:  # noqa: BLE001 - a refusal is any error but an illegal verdict
                outcome = f"refused: {type(e).__name__}: {e}"
                break
        rows.append({"program": name, "steps": steps, "outcome": outcome,
                     "warm": statistics.median(warm) if warm else None,
                     "cold": statistics.median(cold) if cold else None})
    return rows


def brute_check(progs: dict[str, kl.Program], rows: list[dict]) -> tuple[int, int, list[str]]:
    """Verdicts confirmed by brute force at the test sizes: (agreeing, checked, disagreements)."""
    sys.path.insert(0, str(POLYBENCH.parent))
    from polybench import PARAMS  # noqa: PLC0415
    from polybench.bruteforce import judge  # noqa: PLC0415

    sizes = {**PARAMS, **INLINE_PARAMS}
    agree, total, bad = 0, 0, []
    for row in rows:
        if row["outcome"] is None or isinstance(row["outcome"], str):
            continue
        program, steps = progs[row["program"]], row["steps"]
        s = kl.Schedule.replay(program, [{"primitive": p, "args": a} for p, a in steps], check=False)
        total += 1
        if row["outcome"] is True:
            at = sizes[row["program"]]
            brute = judge(program, s, at)
            ok = not brute.order_violations and all(
                not {p for p in pairs if p[0] in inside and p[1] in inside}
                for loop, pairs in brute.parallel_violations.items()
                for inside in [s.loop_instances(loop, at)])
        else:
            v = row["outcome"].violation
            brute = judge(program, s, {**sizes[row["program"]], **dict(v.params)})
            pair = ((v.source.statement, tuple(x for _, x in v.source.point)),
                    (v.sink.statement, tuple(x for _, x in v.sink.point)))
            if v.loop is None:
                ok = pair in brute.order_violations
            else:
                inside = s.loop_instances(v.loop, {**sizes[row["program"]], **dict(v.params)})
                ok = pair in brute.parallel_violations[v.loop] and pair[0] in inside and pair[1] in inside
        agree += ok
        if not ok:
            bad.append(f"{row['program']}: {steps}")
    return agree, total, bad


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def table(rows: list[dict], brute: tuple[int, int, list[str]] | None) -> str:
    done = [r for r in rows if r["warm"] is not None and not isinstance(r["outcome"], str)]
    refused = [r for r in rows if isinstance(r["outcome"], str)]
    lines = ["| set | cases | legal | illegal | refusals | step median (ms) | step p99 (ms) | cold median (ms) "
             "| cold p99 (ms) |", "|---|---|---|---|---|---|---|---|---|"]

    def row(label: str, group: list[dict], refusals: int) -> str:
        if not group:
            return f"| {label} | 0 | - | - | {refusals} | - | - | - | - |"
        w = [r["warm"] * 1e3 for r in group]
        c = [r["cold"] * 1e3 for r in group]
        n_legal = sum(1 for r in group if r["outcome"] is True)
        return (f"| {label} | {len(group)} | {n_legal} | {len(group) - n_legal} | {refusals} | "
                f"{statistics.median(w):.2f} | {_pct(w, 0.99):.2f} | {statistics.median(c):.2f} | "
                f"{_pct(c, 0.99):.2f} |")

    lines.append(row("all", done, len(refused)))
    for primitive in sorted({r["steps"][-1][0] for r in done}):
        group = [r for r in done if r["steps"][-1][0] == primitive]
        lines.append(row(f"last step {primitive}", group, 0))
    lines.append("")
    lines.append(f"Cases measured: {len(done)} of {len(rows)}; refusals: {len(refused)}.")
    by_step: dict[str, int] = {}
    for r in refused:
        by_step[r["steps"][-1][0]] = by_step.get(r["steps"][-1][0], 0) + 1
    if by_step:
        lines.append("Refusals by last step: " + ", ".join(f"{k} {v}" for k, v in sorted(by_step.items())) + ".")
    for r in refused[:3]:
        lines.append(f"- {r['program']} {r['steps']}: {r['outcome'][:160]}")
    if brute is not None:
        lines.append(f"Brute force agrees with {brute[0]} of {brute[1]} verdicts.")
    lines.append(f"Measured on {platform.machine()} with Python {platform.python_version()} "
                 f"({platform.processor() or 'unknown CPU'}).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--brute", action="store_true")
    ap.add_argument("--save-cases", type=Path, default=None, help="write the case set as JSON")
    ap.add_argument("--cases", type=Path, default=None, help="read the case set from JSON (to time older code "
                    "on the same set: a step it cannot apply counts as a refusal)")
    ap.add_argument("--update-docs", type=Path, default=None)
    args = ap.parse_args()
    progs = programs()
    if args.cases is not None:
        case_list = [(name, [(p, a) for p, a in steps]) for name, steps in json.loads(args.cases.read_text())]
    else:
        case_list = cases(progs)
    if args.save_cases is not None:
        args.save_cases.write_text(json.dumps(case_list))
    rows = measure(progs, case_list, args.repeat)
    brute = brute_check(progs, rows) if args.brute else None
    text = table(rows, brute)
    print(text)
    if brute is not None and brute[2]:
        print("\n".join(["disagreements:"] + brute[2][:20]))
    if args.update_docs is not None:
        doc = args.update_docs.read_text()
        start, end = "<!-- legality-benchmark:start -->", "<!-- legality-benchmark:end -->"
        head, rest = doc.split(start, 1)
        _, tail = rest.split(end, 1)
        args.update_docs.write_text(f"{head}{start}\n{text}\n{end}{tail}")


if __name__ == "__main__":
    main()
