"""The polyhedral bridge: domains, accesses, exact dependences, parallelism, explanations."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import islpy as isl
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kiln.loops as kl  # noqa: E402
from kiln.ir.errors import IllegalTransformError, ScheduleError  # noqa: E402
from kiln.ir.poly import build_model, compute_dependences  # noqa: E402
from polybench import PARAMS, load  # noqa: E402
from polybench.bruteforce import conflicting_pairs, trace  # noqa: E402


def isl_pairs(program: kl.Program, params: dict) -> dict[tuple, set[str]]:
    """Every (source, sink) instance pair of every dependence, with its kinds, at ``params``."""
    out: dict[tuple, set[str]] = {}
    for dep in compute_dependences(build_model(program)):
        rel = dep.relation
        for i in range(rel.dim(isl.dim_type.param)):
            rel = rel.fix_val(isl.dim_type.param, i, isl.Val(int(params[rel.get_dim_name(isl.dim_type.param, i)])))
        n_in, n_out = rel.dim(isl.dim_type.in_), rel.dim(isl.dim_type.out)

        def add(pt, dep=dep, n_in=n_in, n_out=n_out):
            vals = [pt.get_coordinate_val(isl.dim_type.set, k).to_python() for k in range(n_in + n_out)]
            key = ((dep.source, tuple(vals[:n_in])), (dep.sink, tuple(vals[n_in:])))
            out.setdefault(key, set()).add(dep.kind)

        rel.wrap().foreach_point(add)
    return out


@pytest.mark.parametrize("kernel", list(PARAMS))
def test_dependences_are_exactly_the_conflicting_pairs(kernel):
    program, params = load(kernel), PARAMS[kernel]
    _, cells = trace(program, params)
    brute = {pair: {kind for kind, _ in found} for pair, found in conflicting_pairs(cells).items()}
    assert isl_pairs(program, params) == brute


def test_domains_and_accesses():
    prog = kl.from_c("for (i = 0; i < N; i++) for (j = i; j < min(N, i + 4); j++) A[i][j - i] += B[j] * x[2 * j + 1];")
    model = build_model(prog)
    s = model.statements["S0"]
    assert s.domain.is_equal(isl.Set("[N] -> { S0[i, j] : 0 <= i < N and i <= j < N and j < i + 4 }"))
    by_array = {(a.array, a.is_write): a for a in s.accesses}
    assert by_array[("A", True)].relation.is_equal(
        isl.Map("[N] -> { S0[i, j] -> A[i, j - i] : 0 <= i < N and i <= j < N and j < i + 4 }"))
    assert by_array[("x", False)].exact and by_array[("A", False)].exact


def test_parallelism_is_exact_where_distance_tests_are_conservative():
    # The dependence (1, -1) is carried by i; j has a non-zero distance but is parallel.
    prog = kl.from_c("for (i = 1; i < N; i++) for (j = 0; j < N - 1; j++) A[i][j] = A[i - 1][j + 1] * 0.5;")
    s = kl.Schedule(prog)
    s.parallel("j")
    with pytest.raises(IllegalTransformError, match=r"loop 'i' cannot run in parallel: flow dependence"):
        s.parallel("i")
    assert s.verify().legal


def test_independent_accesses_have_no_dependences():
    prog = kl.from_c("for (i = 0; i < N; i++) A[2 * i] = A[2 * i + 1] + 1.0;")
    assert len(kl.Schedule(prog).dependences) == 0
    kl.Schedule(prog).reverse("i").parallel("i")


def test_non_affine_accesses_are_conservative():
    src = "double A[N], idx[N], C[N];\nfor (i = 0; i < N; i++) A[(int)idx[i]] = A[i] * 2.0;"
    s = kl.Schedule(kl.from_c(src))
    access = [a for a in s.model.statements["S0"].writes][0]
    assert not access.exact
    with pytest.raises(IllegalTransformError, match=r"dependence on A\["):
        s.reverse("i")
    reads_only = kl.Schedule(kl.from_c("double A[N], idx[N], C[N];\nfor (i = 0; i < N; i++) C[i] = A[(int)idx[i]];"))
    reads_only.reverse("i").parallel("i")


def test_non_affine_conditions_stay_as_guards():
    prog = kl.from_c("for (i = 0; i < N; i++) if (x[i] > 0.5) y[i] = x[i]; else y[i] = -x[i];")
    model = build_model(prog)
    assert len(model.statements["S0"].guards) == 1 and not model.statements["S0"].writes[0].exact
    generated = kl.Schedule(prog).reverse("i").program()
    assert "if (x[-i] > 0.5)" in str(generated)  # the reversed loop runs over -i
    x = np.linspace(0, 1, 7)
    y1, y2 = np.zeros(7), np.zeros(7)
    kl.run(prog, {"N": 7}, {"x": x, "y": y1})
    kl.run(generated, {"N": 7}, {"x": x, "y": y2})
    np.testing.assert_array_equal(y1, y2)


def test_affine_conditions_restrict_domains():
    prog = kl.from_c("for (i = 0; i < N; i++) { if (i >= 2 && i != 5) A[i] = A[i - 2]; else B[i] = 1; }")
    model = build_model(prog)
    assert model.statements["S0"].domain.is_equal(isl.Set("[N] -> { S0[i] : 2 <= i < N and i != 5 }"))
    assert model.statements["S1"].domain.is_equal(isl.Set("[N] -> { S1[i] : 0 <= i < N and (i < 2 or i = 5) }"))
    with pytest.raises(IllegalTransformError):
        kl.Schedule(prog).reverse("i")


def test_non_affine_bounds_are_rejected_clearly():
    prog = kl.from_c("double n[4], A[N];\nfor (i = 0; i < (int)n[0]; i++) A[i] = 0;")
    with pytest.raises(ScheduleError, match=r"upper bound 'i32\(n\[0\]\)' of loop 'i' is not affine"):
        kl.Schedule(prog)


def test_explanations_name_instances_cells_kinds_and_distances():
    s = kl.Schedule(load("seidel-2d"))
    with pytest.raises(IllegalTransformError) as err:
        s.interchange("i", "j")
    v = err.value.violation
    text = err.value.explanation
    assert v.kind in ("flow", "anti", "output")
    assert re.search(r"(flow|anti|output) dependence on A\[\d+, \d+\]: S0\[t=\d+, i=\d+, j=\d+\] (writes|reads) it "
                     r"before S0\[t=\d+, i=\d+, j=\d+\] (reads|writes|overwrites) it \(distance t: 0, i: 1, j: -1\)",
                     text), text
    assert "new schedule runs" in text and "with N=" in text
    assert dict(v.distance) == {"t": 0, "i": 1, "j": -1}
    assert v.sink_time < v.source_time


def test_explanation_of_a_parallel_violation():
    s = kl.Schedule(load("prefix-sum"))
    with pytest.raises(IllegalTransformError) as err:
        s.parallel("j")
    v = err.value.violation
    assert v.loop == "j" and v.kind == "flow"
    assert "loop 'j' cannot run in parallel" in err.value.explanation
    assert "same iteration of the loops around 'j'" in err.value.explanation
