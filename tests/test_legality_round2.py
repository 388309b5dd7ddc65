"""General band transforms, symbolic verdicts, proofs and the memoized checker.

Every verdict here is confirmed by the brute-force oracle (tests/polybench/bruteforce.py),
and every legal schedule's regenerated program is run against the original at several
sizes.  The oracle's parallel check counts pairs of a loop's statements; after
``split_at`` a loop holds only pieces of them, so its pairs are filtered to the instances
the loop runs (``Schedule.loop_instances``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kiln.loops as kl  # noqa: E402
from kiln.ir.errors import IllegalTransformError, ScheduleError  # noqa: E402
from kiln.ir.loops.interp import buffer_shape  # noqa: E402
from kiln.ir.poly.legality import checker_for  # noqa: E402
from polybench import PARAMS, load  # noqa: E402
from polybench.bruteforce import judge  # noqa: E402

WAVEFRONT = kl.from_c("""
double A[N][M];
for (i = 1; i < N; i++)
  for (j = 1; j < M; j++)
    A[i][j] = A[i - 1][j] + A[i][j - 1] * 0.5;
""", name="wavefront")
STAGES = kl.from_c("""
double A[N], B[N], C[N], D[N];
for (i = 1; i < N; i++) {
  P: B[i] = A[i] * 2.0;
  Q: C[i] = B[i] + B[i - 1];
  R: D[i] = C[i] * C[i];
}
""", name="stages")
TRIANGLE = kl.from_c("""
double L[N][N], x[N];
for (i = 0; i < N; i++)
  for (j = 0; j <= i; j++)
    x[i] += L[i][j] * x[j] * 0.25;
""", name="triangle")
PROGRAMS = {"wavefront": WAVEFRONT, "stages": STAGES, "triangle": TRIANGLE}
SIZES = {"wavefront": [dict(N=4, M=5), dict(N=6, M=3), dict(N=2, M=7)],
         "stages": [dict(N=6), dict(N=2), dict(N=9)],
         "triangle": [dict(N=5), dict(N=1), dict(N=7)]}
for kernel in ("seidel-2d", "jacobi-1d", "lu", "gemm", "prefix-sum", "fdtd-2d", "2mm", "heat-3d"):
    PROGRAMS[kernel] = load(kernel)
    small = {k: (max(2, v - 1) if isinstance(v, int) else v) for k, v in PARAMS[kernel].items()}
    SIZES[kernel] = [PARAMS[kernel], small]

S = tuple
CASES: list[tuple[str, list[S], bool]] = [
    # skew in both nesting orders
    ("wavefront", [("skew", {"target": "j", "source": "i", "factor": 1}), ("interchange", {"a": "i", "b": "j"}),
                   ("parallel", {"loop": "i"})], True),
    ("wavefront", [("skew", {"target": "i", "source": "j", "factor": 1}), ("parallel", {"loop": "j"})], True),
    ("wavefront", [("skew", {"target": "i", "source": "j", "factor": -1})], False),
    ("seidel-2d", [("skew", {"target": "i", "source": "j", "factor": 1})], False),
    ("seidel-2d", [("skew", {"target": "i", "source": "j", "factor": 2})], False),
    ("seidel-2d", [("skew", {"target": "t", "source": "j", "factor": 1})], False),
    ("jacobi-1d", [("skew", {"target": "t", "source": "i", "factor": 1})], False),
    ("jacobi-1d", [("skew", {"target": "i", "source": "t", "factor": 2}), ("skew", {"target": "i_1", "source": "t",
                                                                                   "factor": 2})], True),
    ("lu", [("skew", {"target": "k", "source": "j", "factor": 1})], True),
    ("lu", [("skew", {"target": "j", "source": "k", "factor": 1})], False),
    ("triangle", [("skew", {"target": "i", "source": "j", "factor": 1})], True),
    ("triangle", [("skew", {"target": "i", "source": "j", "factor": -1})], False),
    # unimodular transforms
    ("seidel-2d", [("transform", {"loops": ["t", "i", "j"], "matrix": [[1, 0, 0], [1, 1, 0], [2, 1, 1]]})], True),
    ("seidel-2d", [("transform", {"loops": ["t", "i", "j"], "matrix": [[1, 0, 0], [1, 1, 0], [2, 1, 1]]}),
                   ("interchange", {"a": "i", "b": "j"}), ("parallel", {"loop": "i"})], False),
    ("seidel-2d", [("transform", {"loops": ["i", "j"], "matrix": [[1, 1], [0, 1]]})], False),
    ("wavefront", [("transform", {"loops": ["i", "j"], "matrix": [[1, 1], [0, 1]]}), ("parallel", {"loop": "j"})],
     True),
    ("wavefront", [("transform", {"loops": ["i", "j"], "matrix": [[0, 1], [-1, 0]]})], False),
    ("gemm", [("transform", {"loops": ["k", "j_1"], "matrix": [[0, 1], [1, 0]]})], True),
    ("gemm", [("transform", {"loops": ["k", "j_1"], "matrix": [[-1, 0], [0, 1]]})], False),
    ("heat-3d", [("transform", {"loops": ["i", "j", "k"], "matrix": [[0, 0, 1], [1, 0, 0], [0, 1, 0]]}),
                 ("parallel", {"loop": "k"})], True),
    # index-set splitting and Tadashi's family
    ("prefix-sum", [("split_at", {"loop": "j", "value": 3})], True),
    ("prefix-sum", [("split_at", {"loop": "i", "value": "N - 2"}), ("parallel", {"loop": "i_b"}),
                    ("interchange", {"a": "i_b", "b": "j_b"})], True),
    ("prefix-sum", [("split_at", {"loop": "j", "value": 2}), ("parallel", {"loop": "j_b"})], False),
    ("prefix-sum", [("split_at", {"loop": "j", "value": 3}), ("reverse", {"loop": "j_b"})], False),
    ("triangle", [("split_at", {"loop": "j", "value": "i"}), ("full_split", {"loop": "i"})], False),
    ("triangle", [("split_at", {"loop": "j", "value": "i"}), ("reverse", {"loop": "j"})], False),
    ("triangle", [("split_at", {"loop": "j", "value": "i"}), ("shift", {"loop": "j_b", "statement": None,
                                                                         "offset": "-i"})], True),
    ("triangle", [("split_at", {"loop": "i", "value": 3}), ("fuse", {"a": "i", "b": "i_b"})], True),
    ("stages", [("full_split", {"loop": "i"}), ("parallel", {"loop": "i"}), ("parallel", {"loop": "i_b"})], True),
    ("stages", [("full_split", {"loop": "i"}), ("full_fuse", {"loop": "i"})], True),
    ("stages", [("full_split", {"loop": "i"}), ("fuse", {"a": "i", "b": "i_b_1"})], False),
    ("stages", [("full_split", {"loop": "i"}), ("shift", {"loop": "i_b_1", "statement": None, "offset": -1}),
                ("fuse", {"a": "i", "b": "i_b_1"})], False),
    ("stages", [("shift", {"loop": "i", "statement": "R", "offset": 1}),
                ("shift", {"loop": "i", "statement": "Q", "offset": 1})], True),
    ("stages", [("shift", {"loop": "i", "statement": "P", "offset": 1})], False),
    ("stages", [("scale", {"loop": "i", "factor": 2}), ("shift", {"loop": "i", "statement": "Q", "offset": 1})],
     False),
    ("stages", [("scale", {"loop": "i", "factor": 2}), ("shift", {"loop": "i", "statement": "R", "offset": 1}),
                ("shift", {"loop": "i", "statement": "Q", "offset": 1})], True),
    ("stages", [("scale", {"loop": "i", "factor": 2}), ("shift", {"loop": "i", "statement": "Q", "offset": -1})],
     False),
    ("gemm", [("shift", {"loop": "j_1", "statement": "S1", "offset": "NJ"})], True),
    ("gemm", [("shift", {"loop": "k", "statement": None, "offset": "-i"})], True),
    ("jacobi-1d", [("shift", {"loop": "i_1", "statement": None, "offset": 1}), ("fuse", {"a": "i", "b": "i_1"}),
                   ("split_at", {"loop": "i", "value": 2})], True),
    ("fdtd-2d", [("full_fuse", {"loop": "i"})], False),
    ("2mm", [("full_split", {"loop": "j"}), ("fuse", {"a": "j", "b": "j_b"})], True),
]


def _case_id(case) -> str:
    kernel, steps, legal = case
    text = "+".join(f"{p}({','.join(str(v) for v in a.values())})" for p, a in steps)
    return f"{kernel}:{text}:{'legal' if legal else 'illegal'}".replace(" ", "")


def brute_legal(program: kl.Program, schedule: kl.Schedule, params: dict) -> bool:
    """The oracle's verdict with each parallel loop's pairs restricted to its instances."""
    brute = judge(program, schedule, params)
    if brute.order_violations:
        return False
    for loop, pairs in brute.parallel_violations.items():
        inside = schedule.loop_instances(loop, params)
        if any(a in inside and b in inside for a, b in pairs):
            return False
    return True


def brute_confirms(program: kl.Program, schedule: kl.Schedule, violation, params: dict) -> None:
    at = {**params, **dict(violation.params)}
    brute = judge(program, schedule, at)
    pair = ((violation.source.statement, tuple(v for _, v in violation.source.point)),
            (violation.sink.statement, tuple(v for _, v in violation.sink.point)))
    if violation.loop is None:
        assert pair in brute.order_violations, violation.explain()
    else:
        inside = schedule.loop_instances(violation.loop, at)
        assert pair in brute.parallel_violations[violation.loop] and pair[0] in inside and pair[1] in inside
    assert (violation.kind, (violation.array, violation.cell)) in brute.pairs[pair]


def arrays_for(program: kl.Program, params: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = {p.name: int(params[p.name]) for p in program.params if p.dtype.is_integer}
    out = {b.name: rng.random(buffer_shape(program, b.name, sizes)) for b in program.buffers if b.scope == "global"}
    if program.name == "lu":
        a = out["A"]
        out["A"] = a @ a.T + a.shape[0] * np.eye(a.shape[0])
    return out


def same_arrays(original: kl.Program, generated: kl.Program, sizes: list[dict]) -> None:
    for seed, params in enumerate(sizes):
        want = arrays_for(original, params, seed)
        got = {k: v.copy() for k, v in want.items()}
        kl.run(original, params, want)
        kl.run(generated, params, got)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12, err_msg=f"{name} at {params}")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_verdicts_agree_with_brute_force_and_legal_programs_compute_the_same(case):
    kernel, steps, legal = case
    program = PROGRAMS[kernel]
    unchecked = kl.Schedule.replay(program, [{"primitive": p, "args": a} for p, a in steps], check=False)
    verdict = unchecked.verify()
    assert verdict.legal == legal, verdict.explanation
    for params in SIZES[kernel][:1]:
        assert brute_legal(program, unchecked, params) == legal
    checked = kl.Schedule(program)
    for primitive, args in steps[:-1]:
        checked.apply(primitive, **args)
    if not legal:
        with pytest.raises(IllegalTransformError) as err:
            checked.apply(*steps[-1][:1], **steps[-1][1])
        assert err.value.violation == verdict.violation
        brute_confirms(program, unchecked, verdict.violation, SIZES[kernel][0])
        return
    checked.apply(steps[-1][0], **steps[-1][1])
    generated = checked.program()
    assert str(kl.parse(str(generated))) == str(generated)
    same_arrays(program, generated, SIZES[kernel])


# ----------------------------------------------------------------------------- structure and errors
def test_skewing_an_outer_loop_by_an_inner_one_changes_only_the_outer_band():
    s = kl.Schedule(WAVEFRONT).skew("i", "j", 1)
    text = str(s.program())
    assert "for i in [2, N + M - 1) {" in text and "for j in [max(1, i - N + 1), min(M, i)) {" in text
    assert "S0: A[i - j, j] = A[i - j - 1, j] + A[i - j, j - 1] * 0.5" in text
    assert str(s).splitlines()[1].strip() == "band j [S0: [(j)]]"
    s.parallel("j")  # the wavefront: every dependence is carried by the outer loop


def test_transform_generalizes_interchange_skew_and_reversal():
    def program_of(*steps):
        return str(kl.Schedule.replay(load("jacobi-2d"), [{"primitive": p, "args": a} for p, a in steps],
                                      check=False).program())

    assert program_of(("transform", {"loops": ["i", "j"], "matrix": [[0, 1], [1, 0]]})) == \
        program_of(("interchange", {"a": "i", "b": "j"}))
    assert program_of(("transform", {"loops": ["i", "j"], "matrix": [[1, 0], [1, 1]]})) == \
        program_of(("skew", {"target": "j", "source": "i", "factor": 1}))
    assert program_of(("transform", {"loops": ["j"], "matrix": [[-1]]})) == program_of(("reverse", {"loop": "j"}))


@pytest.mark.parametrize("call,message", [
    (lambda s: s.transform(["i", "j"], [[2, 0], [0, 1]]), r"determinant 2; only unimodular"),
    (lambda s: s.transform(["i", "j"], [[1, 1], [1, 1]]), r"determinant 0"),
    (lambda s: s.transform(["i", "j"], [[1, 0]]), r"must be 2 x 2 integers"),
    (lambda s: s.transform(["j", "i"], [[1, 0], [0, 1]]), r"not perfectly nested"),
    (lambda s: s.scale("i", 0), r"scale: the factor must be a non-zero integer"),
    (lambda s: s.shift("i", "S0", "i * j"), r"offset 'i \* j' is not affine in S0's iterators \(i, j\)"),
    (lambda s: s.shift("i", "S0", "q"), r"not affine in S0's iterators"),
    (lambda s: s.split_at("j", "M + 5"), r"every iteration of loop 'j' runs before 'M \+ 5'"),
    (lambda s: s.split_at("j", -3), r"runs at or after -3 for every size"),
    (lambda s: s.full_split("j"), r"full_split: loop 'j' directly contains statement S0"),
    (lambda s: s.full_fuse("i"), r"full_fuse: loop 'i' is not in a sequence"),
    (lambda s: s.split_at("j", 2).compute_at("S0", "j"), r"compute_at: statement S0 runs in pieces after split_at"),
])
def test_misapplied_new_primitives(call, message):
    s = kl.Schedule(kl.parse("""program p(N: i64, M: i64) {
  buffer A: f64[N, M]
  for i in [0, N) {
    for j in [0, M) {
      S0: A[i, j] = A[i, j] + 1.0
    }
  }
}"""))
    with pytest.raises(ScheduleError, match=message):
        call(s)


def test_split_at_names_both_halves_and_traces_replay():
    s = kl.Schedule(load("prefix-sum")).split_at("i", "N - 2").parallel("i_b")
    assert s.loops() == ["i", "j", "i_b", "j_b"]
    generated = s.program()
    assert "for i_b in [max(0, N - 2), N) @parallel {" in str(generated)
    assert "S0_1: x[i_b, j_b] += x[i_b, j_b - 1]" in str(generated)
    again = kl.Schedule.replay(load("prefix-sum"), s.trace_json())
    assert str(again.program()) == str(generated)


# ----------------------------------------------------------------------------- symbolic verdicts
SHIFTED = kl.from_c("double A[N], B[N], C[N];\nfor (i = 3; i < N; i++) { S: A[i] = C[i] * 2.0; T: B[i] = A[i - 3]; }")
OFFSET = kl.from_c("double A[N + M];\nfor (i = 0; i < N; i++) A[i] = A[i + M] * 0.5;")


@pytest.mark.parametrize("program,steps,ranges,when,samples", [
    (SHIFTED, [("shift", {"loop": "i", "statement": "S", "offset": 4})], {"N": (2, 64)}, "N >= 7",
     [{"N": n} for n in (2, 5, 6, 7, 9, 64)]),
    (SHIFTED, [("shift", {"loop": "i", "statement": "S", "offset": 3})], {"N": (2, 64)}, None,
     [{"N": n} for n in (2, 5, 11)]),
    (OFFSET, [("parallel", {"loop": "i"})], {"N": (2, 100), "M": (0, 50)}, "0 < M < N",
     [{"N": n, "M": m} for n, m in ((2, 0), (2, 1), (3, 2), (5, 5), (9, 3), (4, 50))]),
])
def test_symbolic_verdicts_agree_with_concrete_ones(program, steps, ranges, when, samples):
    s = kl.Schedule.replay(program, [{"primitive": p, "args": a} for p, a in steps], check=False)
    verdict = s.verify(ranges=ranges)
    assert verdict.illegal_when == when
    if when is None:
        assert verdict.legal and verdict.explanation.startswith("legal for all sizes in range")
    else:
        assert verdict.explanation.startswith(f"illegal when {when} in range")
        example = verdict.counterexample
        assert all(lo <= example[p] <= hi for p, (lo, hi) in ranges.items())
        assert not s.verify(ranges={p: (v, v) for p, v in example.items()}).legal
    for params in samples:
        concrete = s.verify(ranges={p: (v, v) for p, v in params.items()})
        expected = when is None or not eval(when.replace("N", str(params["N"])).replace("M", str(params.get("M"))))
        assert concrete.legal == expected == brute_legal(program, s, params), params


def test_a_schedule_with_ranges_accepts_steps_legal_in_range_only():
    with pytest.raises(IllegalTransformError, match=r"illegal when N >= 7 in range N in \[2, 64\]"):
        kl.Schedule(SHIFTED, ranges={"N": (2, 64)}).shift("i", "S", 4)
    s = kl.Schedule(SHIFTED, ranges={"N": (2, 6)}).shift("i", "S", 4)
    assert s.verify().legal and not s.verify(ranges={"N": (2, 4096)}).legal
    with pytest.raises(ScheduleError, match=r"ranges: 'Q' is not a size parameter"):
        kl.Schedule(SHIFTED, ranges={"Q": (1, 2)})


# ----------------------------------------------------------------------------- proofs
def test_proof_names_the_carrier_and_the_distances_of_every_dependence():
    s = kl.Schedule(load("seidel-2d")).skew("j", "i", 2).interchange("i", "j").parallel("i")
    proof = s.proof()
    assert len(proof.steps) == len(s.dependences)
    for step in proof.steps:
        assert step.carriers, step
        for c in step.carriers:
            first = c.box.strip("()").split(", ")[c.dim]
            assert first.startswith("1") or first[0].isdigit() and int(first.split("..")[0]) >= 1
    text = str(proof)
    assert "flow S0 -> S0 on A" in text and "carried by loop 't' (time position 0): time distances (1.., " in text
    assert "carried by loop 'j' (time position 1): time distances (0, 1.." in text
    assert "loop 'i' (parallel, time position 2)" in text
    assert "flow S0 -> S0 on A (iteration distances (0.., -1..1, -1..1))" in text
    # the distance bounds hold over every size: pieces such as 3 - M where M = 2 count
    wave = str(kl.Schedule(WAVEFRONT).skew("i", "j", 1).parallel("j").proof())
    assert "iteration distances (0..1, 0..1)" in wave and "time distances (1, 0..1)" in wave, wave
    stages = kl.Schedule(STAGES).proof()
    assert "carried by the order of a sequence's children (time position 1): time distances (0, 1)" in str(stages)
    with pytest.raises(ScheduleError, match=r"no proof: the schedule is illegal"):
        kl.Schedule(load("seidel-2d"), check=False).interchange("i", "j").proof()


# ----------------------------------------------------------------------------- the memo
def test_a_step_rechecks_only_the_pairs_whose_common_bands_changed():
    program = load("jacobi-2d")
    s = kl.Schedule(program)
    checker = checker_for(s.model, s.dependences)
    checker.clear()
    s.verify()
    base = checker.misses
    assert base == len(s.dependences.pairs)
    s.verify()
    assert checker.misses == base  # nothing changed: every pair from the memo
    s.tile(["i_1", "j_1"], [4, 4])  # only S1's own pair has changed common bands
    assert checker.misses == base + 1
    s.parallel("i")  # a parallel mark: one test per pair under the marked loop
    assert checker.misses == base + 2
    assert kl.Schedule(program).tile(["i_1", "j_1"], [4, 4]).verify().legal
