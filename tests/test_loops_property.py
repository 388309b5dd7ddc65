"""Property tests on random affine loop nests.

* Random sequences of *legal* transformations regenerate programs computing the same
  arrays as the original.
* For random *unchecked* sequences, the isl verdict equals the brute-force verdict, and an
  illegal verdict's explanation names a pair the brute force finds violated.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

import kiln.loops as kl  # noqa: E402
from polybench.bruteforce import judge  # noqa: E402

N = 4
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def accesses(draw, iters: tuple[str, ...]) -> str:
    array = draw(st.sampled_from(["A", "B"]))
    first, second = iters if draw(st.booleans()) else iters[::-1]
    a, b = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    return f"{array}[{first} + {a}][{second} + {b}]"


@st.composite
def statements(draw, iters: tuple[str, ...]) -> str:
    target = draw(accesses(iters))
    reads = draw(st.lists(accesses(iters), min_size=1, max_size=2))
    op = draw(st.sampled_from(["=", "+="]))
    return f"{target} {op} {' + '.join(reads)} * 0.5;"


@st.composite
def nests(draw) -> str:
    """A small affine program over A, B: one or two nests, perfect or imperfect, maybe triangular."""
    out = ["double A[N + 3][N + 3], B[N + 3][N + 3];"]
    for n in range(draw(st.integers(1, 2))):
        i, j = f"i{n}", f"j{n}"
        upper = draw(st.sampled_from(["N", f"{i} + 1"]))
        inner = [draw(statements((i, j))) for _ in range(draw(st.integers(1, 2)))]
        body = f"for (int {j} = 0; {j} < {upper}; {j}++) {{ {' '.join(inner)} }}"
        if draw(st.booleans()):
            body = f"{draw(statements((i, i)))} {body}"
        out.append(f"for (int {i} = 0; {i} < N; {i}++) {{ {body} }}")
    return "\n".join(out)


def _run(program: kl.Program, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {"A": rng.random((N + 3, N + 3)), "B": rng.random((N + 3, N + 3))}
    kl.run(program, {"N": N}, arrays)
    return arrays


@SETTINGS
@given(source=nests(), seed=st.integers(0, 2**16), length=st.integers(1, 4))
def test_legal_sequences_preserve_results(source, seed, length):
    program = kl.from_c(source)
    schedule = kl.random_legal_sequence(program, length, seed=seed)
    assert schedule.verify().legal
    generated = schedule.program()
    want, got = _run(program, seed), _run(generated, seed)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12,
                                   err_msg=f"{schedule.trace}\n{generated}")


@SETTINGS
@given(source=nests(), seed=st.integers(0, 2**16), length=st.integers(1, 3))
def test_verdicts_and_explanations_match_brute_force(source, seed, length):
    program = kl.from_c(source)
    schedule = kl.random_sequence(program, length, seed=seed)
    verdict = schedule.verify()
    brute = judge(program, schedule, {"N": N})
    # isl decides for every N at once; the brute force for N = 4 and for the sizes of the
    # violation isl reports.
    assert brute.legal or not verdict.legal, (schedule.trace, "isl missed a violation")
    if verdict.legal:
        return
    v = verdict.violation
    at = {"N": N} | dict(v.params)
    brute_at = judge(program, schedule, at)
    pair = ((v.source.statement, tuple(x for _, x in v.source.point)),
            (v.sink.statement, tuple(x for _, x in v.sink.point)))
    found = brute_at.order_violations if v.loop is None else brute_at.parallel_violations[v.loop]
    assert pair in found, (schedule.trace, v.explain())
    assert (v.kind, (v.array, v.cell)) in brute_at.pairs[pair]
