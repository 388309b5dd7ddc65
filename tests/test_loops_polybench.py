"""PolyBench-style kernels read from C: a table of transformations and expected verdicts.

Every verdict is confirmed by brute force (tests/polybench/bruteforce.py), every legal
schedule regenerates a program computing the same arrays as the original, and every
explanation names a dependence the brute force also finds violated.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kiln.loops as kl  # noqa: E402
from kiln.ir.errors import IllegalTransformError  # noqa: E402
from kiln.backends.cpu.toolchain import c_compiler as compiler  # noqa: E402
from polybench import PARAMS, inputs, load  # noqa: E402
from polybench.bruteforce import judge  # noqa: E402

S = tuple  # a step: (primitive, {args})

CASES: list[tuple[str, list[S], bool]] = [
    ("gemm", [("tile", {"loops": ["k", "j_1"], "sizes": [2, 2]})], True),
    ("gemm", [("interchange", {"a": "k", "b": "j_1"})], True),
    ("gemm", [("parallel", {"loop": "i"})], True),
    ("gemm", [("parallel", {"loop": "j_1"})], True),  # k carries the reduction, j_1 does not
    ("gemm", [("parallel", {"loop": "k"})], False),
    ("gemm", [("reverse", {"loop": "k"})], False),
    ("gemm", [("fuse", {"a": "j", "b": "k"})], False),
    ("gemm", [("fission", {"loop": "i", "split_before_child": 1})], True),
    ("gemm", [("skew", {"target": "j_1", "source": "k", "factor": 1})], True),
    ("2mm", [("fuse", {"a": "i", "b": "i_1"})], True),
    ("2mm", [("fuse", {"a": "i", "b": "i_1"}), ("fuse", {"a": "j", "b": "j_1"})], False),
    ("2mm", [("interchange", {"a": "i", "b": "j"})], True),
    ("2mm", [("parallel", {"loop": "k"})], False),
    ("2mm", [("fission", {"loop": "j", "split_before_child": 1}), ("interchange", {"a": "j_b", "b": "k"})], True),
    ("2mm", [("tile", {"loops": ["i", "j"], "sizes": [2, 2]})], True),
    ("atax", [("fuse", {"a": "j", "b": "j_1"})], False),
    ("atax", [("parallel", {"loop": "j_1"})], True),
    ("atax", [("parallel", {"loop": "j"})], False),
    ("atax", [("parallel", {"loop": "i_1"})], False),
    ("atax", [("fuse", {"a": "i", "b": "i_1"})], False),
    ("bicg", [("parallel", {"loop": "j"})], False),
    ("bicg", [("fission", {"loop": "j", "split_before_child": 1}), ("parallel", {"loop": "j"})], True),
    ("bicg", [("fission", {"loop": "j", "split_before_child": 1}), ("parallel", {"loop": "j_b"})], False),
    ("bicg", [("parallel", {"loop": "i_1"})], False),
    ("mvt", [("interchange", {"a": "i", "b": "j"})], True),
    ("mvt", [("parallel", {"loop": "i"})], True),
    ("mvt", [("parallel", {"loop": "j"})], False),
    ("mvt", [("fuse", {"a": "i", "b": "i_1"}), ("parallel", {"loop": "i"})], True),
    ("syrk", [("interchange", {"a": "k", "b": "j_1"})], True),
    ("syrk", [("parallel", {"loop": "i"})], True),
    ("syrk", [("fuse", {"a": "j", "b": "k"})], False),
    ("syrk", [("reverse", {"loop": "j"})], True),
    ("trmm", [("interchange", {"a": "i", "b": "j"})], True),
    ("trmm", [("reverse", {"loop": "i"})], False),
    ("trmm", [("parallel", {"loop": "j"})], True),
    ("trmm", [("parallel", {"loop": "i"})], False),
    ("lu", [("parallel", {"loop": "j_1"})], True),
    ("lu", [("parallel", {"loop": "j"})], False),
    ("lu", [("interchange", {"a": "j_1", "b": "k_1"})], True),
    ("lu", [("reverse", {"loop": "k"})], False),
    ("lu", [("parallel", {"loop": "i"})], False),
    ("cholesky", [("parallel", {"loop": "j"})], False),
    ("cholesky", [("reverse", {"loop": "k_1"})], False),
    ("cholesky", [("fission", {"loop": "i", "split_before_child": "k_1"})], False),
    ("cholesky", [("skew", {"target": "k", "source": "j", "factor": 1}), ("unroll", {"loop": "k", "factor": 2})],
     True),
    ("jacobi-1d", [("fuse", {"a": "i", "b": "i_1"})], False),
    ("jacobi-1d", [("shift", {"loop": "i_1", "statement": "S1", "offset": 1}), ("fuse", {"a": "i", "b": "i_1"})],
     True),
    ("jacobi-1d", [("shift", {"loop": "i_1", "statement": "S1", "offset": 1}), ("fuse", {"a": "i", "b": "i_1"}),
                   ("parallel", {"loop": "i"})], False),
    ("jacobi-1d", [("parallel", {"loop": "i"})], True),
    ("jacobi-1d", [("parallel", {"loop": "t"})], False),
    ("jacobi-2d", [("parallel", {"loop": "i"})], True),
    ("jacobi-2d", [("interchange", {"a": "i", "b": "j"})], True),
    ("jacobi-2d", [("tile", {"loops": ["i", "j"], "sizes": [2, 2]})], True),
    ("jacobi-2d", [("parallel", {"loop": "t"})], False),
    ("jacobi-2d", [("fuse", {"a": "i", "b": "i_1"})], False),
    ("seidel-2d", [("interchange", {"a": "i", "b": "j"})], False),
    ("seidel-2d", [("skew", {"target": "j", "source": "i", "factor": 1}), ("interchange", {"a": "i", "b": "j"})],
     True),
    ("seidel-2d", [("parallel", {"loop": "j"})], False),
    ("seidel-2d", [("tile", {"loops": ["i", "j"], "sizes": [2, 2]})], False),
    ("seidel-2d", [("skew", {"target": "j", "source": "i", "factor": 1}),
                   ("tile", {"loops": ["i", "j"], "sizes": [2, 2]})], True),
    ("seidel-2d", [("skew", {"target": "j", "source": "i", "factor": 1}), ("interchange", {"a": "i", "b": "j"}),
                   ("parallel", {"loop": "i"})], False),
    ("seidel-2d", [("skew", {"target": "j", "source": "i", "factor": 2}), ("interchange", {"a": "i", "b": "j"}),
                   ("parallel", {"loop": "i"})], True),
    ("heat-3d", [("parallel", {"loop": "i"})], True),
    ("heat-3d", [("parallel", {"loop": "k"})], True),
    ("heat-3d", [("parallel", {"loop": "t"})], False),
    ("heat-3d", [("interchange", {"a": "i", "b": "k"})], True),
    ("heat-3d", [("tile", {"loops": ["i", "j", "k"], "sizes": [2, 2, 2]})], True),
    ("heat-3d", [("fuse", {"a": "i", "b": "i_1"})], False),
    ("fdtd-2d", [("parallel", {"loop": "i"})], True),
    ("fdtd-2d", [("fuse", {"a": "i", "b": "i_1"})], True),
    ("fdtd-2d", [("fuse", {"a": "i_1", "b": "i_2"})], True),
    ("fdtd-2d", [("fuse", {"a": "i_1", "b": "i_2"}), ("fuse", {"a": "j_2", "b": "j_3"})], False),
    ("fdtd-2d", [("reverse", {"loop": "t"})], False),
    ("fdtd-2d", [("parallel", {"loop": "t"})], False),
    ("floyd-warshall", [("parallel", {"loop": "i"})], False),
    ("floyd-warshall", [("parallel", {"loop": "j"})], False),
    ("floyd-warshall", [("interchange", {"a": "i", "b": "j"})], True),
    ("floyd-warshall", [("tile", {"loops": ["i", "j"], "sizes": [2, 2]})], True),
    ("floyd-warshall", [("interchange", {"a": "k", "b": "i"})], False),
    ("conv2d", [("parallel", {"loop": "o"})], True),
    ("conv2d", [("parallel", {"loop": "p"})], True),
    ("conv2d", [("parallel", {"loop": "r"})], False),
    ("conv2d", [("interchange", {"a": "o", "b": "p"})], True),
    ("conv2d", [("tile", {"loops": ["o", "p"], "sizes": [2, 2]})], True),
    ("conv2d", [("interchange", {"a": "r", "b": "s"})], False),  # reorders the sum into out[o][p]
    ("conv2d", [("fission", {"loop": "p", "split_before_child": 1})], True),
    ("prefix-sum", [("interchange", {"a": "i", "b": "j"})], True),
    ("prefix-sum", [("parallel", {"loop": "i"})], True),
    ("prefix-sum", [("parallel", {"loop": "j"})], False),
    ("prefix-sum", [("reverse", {"loop": "j"})], False),
    ("prefix-sum", [("split", {"loop": "j", "factor": 2})], True),
    ("prefix-sum", [("interchange", {"a": "i", "b": "j"}), ("parallel", {"loop": "i"})], True),
]


def _case_id(case) -> str:
    kernel, steps, legal = case
    text = "+".join(f"{p}({','.join(str(v) for v in a.values())})" for p, a in steps)
    return f"{kernel}:{text}:{'legal' if legal else 'illegal'}".replace(" ", "")


def _run(program: kl.Program, name: str, seed: int = 0) -> dict[str, np.ndarray]:
    arrays = inputs(name, program, PARAMS[name], seed)
    kl.run(program, PARAMS[name], arrays)
    return arrays


def check_explanation(program: kl.Program, violation, params: dict, schedule) -> None:
    """The violation must be a pair the brute force finds violated, of the stated kind and cell."""
    at = dict(params)
    at.update(dict(violation.params))
    brute = judge(program, schedule, at)
    pair = ((violation.source.statement, tuple(v for _, v in violation.source.point)),
            (violation.sink.statement, tuple(v for _, v in violation.sink.point)))
    found = brute.order_violations if violation.loop is None else brute.parallel_violations[violation.loop]
    assert pair in found, f"{violation.explain()} is not a violated pair"
    assert (violation.kind, (violation.array, violation.cell)) in brute.pairs[pair]
    assert violation.array in violation.explain() and violation.kind in violation.explain()


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_verdict_matches_brute_force(case):
    kernel, steps, legal = case
    program = load(kernel)
    params = PARAMS[kernel]

    checked = kl.Schedule(program)
    for primitive, args in steps[:-1]:
        checked.apply(primitive, **args)
    last, last_args = steps[-1]
    if legal:
        checked.apply(last, **last_args)
    else:
        before, trace_before = str(checked), list(checked.trace)
        with pytest.raises(IllegalTransformError) as err:
            checked.apply(last, **last_args)
        assert str(checked) == before and checked.trace == trace_before, "a failed step changed the schedule"
        assert err.value.violation is not None

    unchecked = kl.Schedule.replay(program, [{"primitive": p, "args": a} for p, a in steps], check=False)
    verdict = unchecked.verify()
    assert verdict.legal == legal, verdict.explanation
    brute = judge(program, unchecked, params)
    assert brute.legal == legal

    if not legal:
        assert verdict.violation == err.value.violation
        check_explanation(program, verdict.violation, params, unchecked)
        return
    generated = checked.program()
    assert str(kl.parse(str(generated))) == str(generated)
    want, got = _run(program, kernel), _run(generated, kernel)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12, err_msg=name)


def test_every_kernel_round_trips_and_regenerates_unchanged():
    for kernel in PARAMS:
        program = load(kernel)
        assert str(kl.parse(str(program))) == str(program)
        generated = kl.Schedule(program).program()
        want, got = _run(program, kernel, seed=1), _run(generated, kernel, seed=1)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12, err_msg=f"{kernel}:{name}")


NATIVE = [
    ("gemm", [("tile", {"loops": ["k", "j_1"], "sizes": [2, 2]}), ("parallel", {"loop": "i"})]),
    ("seidel-2d", [("skew", {"target": "j", "source": "i", "factor": 2}), ("interchange", {"a": "i", "b": "j"}),
                   ("parallel", {"loop": "i"})]),
    ("jacobi-1d", [("shift", {"loop": "i_1", "statement": "S1", "offset": 1}), ("fuse", {"a": "i", "b": "i_1"})]),
    ("floyd-warshall", [("tile", {"loops": ["i", "j"], "sizes": [2, 2]})]),
    ("cholesky", [("skew", {"target": "k", "source": "j", "factor": 1})]),
]


@pytest.mark.skipif(compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("kernel,steps", NATIVE, ids=[k for k, _ in NATIVE])
def test_generated_c_matches_interpreter(kernel, steps):
    program = load(kernel)
    generated = kl.Schedule.replay(program, [{"primitive": p, "args": a} for p, a in steps]).program()
    want = _run(program, kernel, seed=2)
    got = inputs(kernel, generated, PARAMS[kernel], seed=2)
    kl.compile_c(generated)(PARAMS[kernel], got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12, err_msg=name)
