"""Task mappings: enumeration semantics, composition, auto_map, lowering to loops (run in the
interpreter against the enumeration), the isl exactly-once proof, text and interpreter
support of kernel nodes."""

from __future__ import annotations

import itertools
import math

import islpy as isl
import numpy as np
import pytest

from kiln.ir.loops import (
    INDEX, Annotation, Barrier, Buffer, CopyCommit, CopyWait, Load, Loop, Program, Reduce, Shuffle, Store,
    Var, VectorCopy, parse_program,
)
from kiln.ir.loops.interp import run
from kiln.ir.types import DType
from kiln.mapping import (
    CoverageError, TaskMapping, auto_map, lower_mappings, prove_coverage, repeat, spatial,
)

F32 = DType.float32


def tasks_of(m: TaskMapping) -> dict[int, list[tuple[int, ...]]]:
    return {w: m.worker2task(w) for w in range(m.num_workers)}


def assert_exactly_once(m: TaskMapping) -> None:
    every = [t for w in range(m.num_workers) for t in m.worker2task(w)]
    box = list(itertools.product(*(range(d) for d in m.task_shape)))
    assert sorted(every) == box  # each task of the box once, nothing else


# ----------------------------------------------------------------------------- semantics
def test_spatial_gives_one_task_per_worker_row_major_in_rank_order():
    assert tasks_of(spatial(2, 3)) == {w: [(w // 3, w % 3)] for w in range(6)}
    assert tasks_of(spatial(2, 3, ranks=[1, 0])) == {w: [(w % 2, w // 2)] for w in range(6)}
    assert spatial(2, 3).worker2task(6) == [] and spatial(2, 3).worker2task(-1) == []
    assert_exactly_once(spatial(2, 3, 4, ranks=[2, 0, 1]))


def test_repeat_is_one_worker_looping_in_rank_order():
    assert repeat(2, 3).num_workers == 1
    assert repeat(2, 3).worker2task(0) == [(i, j) for i in range(2) for j in range(3)]
    assert repeat(2, 3, ranks=[1, 0]).worker2task(0) == [(i, j) for j in range(3) for i in range(2)]
    assert_exactly_once(repeat(2, 2, 3, ranks=[1, 2, 0]))


def test_composition_combines_workers_and_tasks():
    m = spatial(2, 2) * repeat(1, 2)
    assert m.num_workers == 4 and m.task_shape == (2, 4)
    assert tasks_of(m) == {w: [(w // 2, (w % 2) * 2 + r) for r in range(2)] for w in range(4)}
    m = repeat(2, 1) * spatial(4, 32)
    assert m.worker2task(33) == [(1, 1), (5, 1)]
    for m in (spatial(2, 3) * repeat(2, 2) * spatial(2, 1, ranks=[1, 0]),
              repeat(3, 1) * spatial(2, 2, ranks=[1, 0]) * repeat(1, 2, ranks=[1, 0]),
              spatial(4) * spatial(2) * repeat(3)):
        assert_exactly_once(m)


@pytest.mark.parametrize("a, b, c", [
    (spatial(2, 3), repeat(2, 1), spatial(1, 2, ranks=[1, 0])),
    (repeat(2, 2, ranks=[1, 0]), spatial(3, 2), repeat(1, 2)),
    (spatial(2), spatial(3), repeat(2)),
])
def test_composition_is_associative(a, b, c):
    left, right = (a * b) * c, a * (b * c)
    assert left == right and hash(left) == hash(right)
    assert tasks_of(left) == tasks_of(right)
    assert left != a * c * b


def test_mappings_are_structural_values():
    assert spatial(2, 3) == spatial(2, 3) and spatial(2, 3) != spatial(2, 3, ranks=[1, 0])
    assert len({spatial(2, 3) * repeat(2, 2), spatial(2, 3) * repeat(2, 2), repeat(2, 2)}) == 2
    with pytest.raises(ValueError, match="different ranks"):
        spatial(2, 3) * repeat(2)
    with pytest.raises(ValueError, match="permutation"):
        spatial(2, 3, ranks=[0, 0])


def test_auto_map_follows_hidet():
    assert auto_map(8, 32, workers=64) == repeat(4, 1) * spatial(2, 32)
    assert auto_map(16, 16, workers=128) == repeat(2, 1) * spatial(8, 16)
    assert auto_map(4, 6, workers=8) == repeat(1, 3) * spatial(4, 2)
    # the fastest dimension is the one of highest rank
    assert auto_map(16, 16, workers=128, ranks=[1, 0]) == repeat(1, 2, ranks=[1, 0]) * spatial(16, 8, ranks=[1, 0])
    for shape, workers in (((8, 32), 64), ((6, 4), 12), ((2, 9), 6), ((3, 5, 4), 20)):
        m = auto_map(*shape, workers=workers)
        assert m.task_shape == shape and m.num_workers == workers
        assert_exactly_once(m)
    with pytest.raises(ValueError, match=r"8 workers .* task shape 3x4 \(12 tasks\)"):
        auto_map(3, 4, workers=8)


# ----------------------------------------------------------------------------- lowering
def order_program(m: TaskMapping, launch: int) -> Program:
    """Worker ``w`` of ``[0, launch)`` logs its tasks in the order it does them."""
    iters = [f"i{d}" for d in range(m.rank)]
    most = math.prod(m.task_shape) // m.num_workers
    log = [Store("log", (Var("w"), Load("count", (Var("w"),)), d), Var(it)) for d, it in enumerate(iters)]
    body = m.on(Var("w")).loop(iters, [*log, Reduce("count", (Var("w"),), "+", 1)])
    return Program("order", (), (Buffer("log", (launch, most, m.rank), INDEX), Buffer("count", (launch,), INDEX)),
                   (Loop("w", 0, launch, (body,), annotation=Annotation("mapped", axis="threadIdx.x")),))


MAPPINGS = [
    spatial(4, 8), repeat(2, 3, ranks=[1, 0]), spatial(2, 3) * repeat(2, 2), repeat(2, 1) * spatial(4, 8),
    spatial(3, 2, ranks=[1, 0]) * repeat(2, 2, ranks=[1, 0]) * spatial(2, 2), auto_map(8, 32, workers=64),
    spatial(1, 4) * spatial(3, 1), spatial(2, 2, 2, ranks=[2, 1, 0]) * repeat(1, 2, 1),
]


@pytest.mark.parametrize("m", MAPPINGS, ids=str)
def test_lowered_task_loops_do_what_the_enumeration_says(m):
    for launch in (m.num_workers, m.num_workers + 5):  # a larger launch: the guard idles the rest
        program = order_program(m, launch)
        most = math.prod(m.task_shape) // m.num_workers
        log, count = np.full((launch, most, m.rank), -1, dtype=np.int64), np.zeros(launch, dtype=np.int64)
        run(program, {}, {"log": log, "count": count})
        for w in range(launch):
            expected = m.worker2task(w)
            assert count[w] == len(expected)
            assert [tuple(t) for t in log[w, :count[w]]] == expected


def test_lowering_shape_guards_and_names():
    t = Var("t")
    m = repeat(2, 1) * spatial(4, 8)
    inner = Store("s", (Var("i"), Var("j")), 1.0)
    exact = Program("k", (), (Buffer("s", (8, 8), F32, "shared"),),
                    (Loop("t", 0, 32, (m.on(t).loop(["i", "j"], [inner]),)),))
    text = str(lower_mappings(exact))
    assert "if" not in text  # t in [0, 32) is provably a worker of the mapping
    assert "s[i_r * 4 + floordiv(t, 8), floormod(t, 8)] = 1.0" in text
    larger = exact.replace(body=(Loop("t", 0, 40, exact.body[0].body),))
    assert "if (t < 32) {" in str(lower_mappings(larger))
    # warp / lane workers: floordiv and floormod ranges are understood, no guard either
    warp = spatial(4).on(t // 32).loop(["i"], [spatial(32).on(t % 32).loop(["j"], [Store("s", (Var("i"), Var("j") // 4), 1.0)])])
    nested = Program("n", (), (Buffer("s", (4, 8), F32, "shared"),), (Loop("t", 0, 128, (warp,)),))
    lowered = lower_mappings(nested)
    assert "if" not in str(lowered) and "s[floordiv(t, 32), floordiv(floormod(t, 32), 4)]" in str(lowered)
    # a worker of unknown range gets both bounds checked
    free = Program("f", (), (Buffer("s", (4,), F32), Buffer("x", (1,), INDEX)),
                   (spatial(4).on(Load("x", (0,))).loop(["i"], [Store("s", (Var("i"),), 1.0)]),))
    assert "if (x[0] >= 0 && x[0] < 4) {" in str(lower_mappings(free))
    assert lower_mappings(lowered) is lowered  # nothing left to lower


# ----------------------------------------------------------------------------- isl proofs
def relation_pairs(rel: isl.Map) -> set[tuple[int, tuple[int, ...]]]:
    out: set[tuple[int, tuple[int, ...]]] = set()
    n_in, n_out = rel.dim(isl.dim_type.in_), rel.dim(isl.dim_type.out)

    def add(pt):
        vals = [pt.get_coordinate_val(isl.dim_type.set, k).to_python() for k in range(n_in + n_out)]
        out.add((vals[0], tuple(vals[n_in:])))

    rel.wrap().foreach_point(add)
    return out


@pytest.mark.parametrize("m", MAPPINGS + [auto_map(6, 4, workers=12), spatial(5) * repeat(3) * spatial(2)], ids=str)
def test_coverage_proof_agrees_with_enumeration(m):
    proof = prove_coverage(m)
    assert proof.task_shape == m.task_shape and proof.num_workers == m.num_workers
    assert proof.tasks_per_worker == math.prod(m.task_shape) // m.num_workers
    enumerated = {(w, t) for w, tasks in tasks_of(m).items() for t in tasks}
    assert relation_pairs(proof.relation) == enumerated
    assert "exactly once" in str(proof)


def test_coverage_failures_name_the_task_and_workers():
    with pytest.raises(CoverageError, match=r"no worker of spatial\(4, 8\) \(32 workers\) does task \(0, 8\)") as e:
        prove_coverage(spatial(4, 8), task_shape=(4, 9))
    assert e.value.task == (0, 8) and e.value.workers == ()
    with pytest.raises(CoverageError, match=r"worker 7 of .* does task \(0, 7\), outside the 4x7 box"):
        prove_coverage(spatial(4, 8), task_shape=(4, 7))
    # a lowering that forgets the floormod of the second atom: worker w of spatial(2) * spatial(4)
    wrong = isl.Map("{ [w] -> [t] : 0 <= w < 8 and t = 4 * floor(w / 4) + w }")
    with pytest.raises(CoverageError, match=r"no worker of the relation does task \(4,\)"):
        prove_coverage(wrong, task_shape=(8,))
    doubled = isl.Map("{ [w, r] -> [t] : 0 <= w < 4 and 0 <= r < 2 and t = w + r }")
    with pytest.raises(CoverageError, match=r"task \(1,\) of the relation is done twice, by worker 0 in repeat "
                                            r"iteration \(1,\) and by worker 1 in repeat iteration \(0,\);") as e:
        prove_coverage(doubled, task_shape=(5,))
    assert e.value.task == (1,) and e.value.workers == ((0, (1,)), (1, (0,)))
    assert prove_coverage(isl.Map("{ [w, r] -> [t] : 0 <= w < 4 and 0 <= r < 2 and t = 4 * r + w }"),
                          task_shape=(8,)).num_workers == 4
    with pytest.raises(ValueError, match="task_shape"):
        prove_coverage(doubled)


# ----------------------------------------------------------------------------- text and interpreter
def test_task_loops_and_kernel_nodes_round_trip_through_text():
    t = Var("t")
    m = spatial(2, 4, ranks=[1, 0]) * repeat(2, 2, ranks=[1, 0])
    body = (m.on(t).loop(["i", "j"], [Store("s", (Var("i"), Var("j")), Load("x", (Var("i"), Var("j"))))]),
            Barrier(), Barrier("warp"),
            Shuffle("r", (0,), Load("s", (t // 4, t % 4)), "xor", 1, 8),
            VectorCopy("s", (0, t % 4 * 4), "x", (1, 0), 4, asynchronous=True), CopyCommit(), CopyWait(1))
    p = Program("k", (), (Buffer("x", (4, 16), F32), Buffer("s", (4, 16), F32, "shared"),
                          Buffer("r", (1,), F32, "register")),
                (Loop("t", 0, 8, body, annotation=Annotation("mapped", axis="threadIdx.x")),))
    text = str(p)
    assert "for (i, j) in spatial(2, 4, ranks=[1, 0]) * repeat(2, 2, ranks=[1, 0]) on t {" in text
    again = parse_program(text)
    assert again == p and str(again) == text


def test_interpreter_runs_vector_copies_and_refuses_collectives():
    t = Var("t")
    body = (VectorCopy("s", (t, 0), "x", (0, t * 4), 4, asynchronous=True), CopyCommit(), CopyWait(0),
            spatial(4).on(t).loop(["i"], [Loop("k", 0, 4, [Reduce("r", (0,), "+", Load("s", (Var("i"), Var("k"))))]),
                                          Store("y", (Var("i"),), Load("r", (0,)))]))
    p = Program("k", (), (Buffer("x", (1, 16), F32), Buffer("y", (4,), F32), Buffer("s", (4, 4), F32, "shared"),
                          Buffer("r", (1,), F32, "register")),
                (Loop("t", 0, 4, body, annotation=Annotation("mapped", axis="threadIdx.x")),))
    x, y = np.arange(16, dtype=np.float32).reshape(1, 16), np.zeros(4, np.float32)
    scratch = run(p, {}, {"x": x, "y": y})
    assert np.array_equal(scratch["s"], x.reshape(4, 4))
    # one register for the whole serial run: it accumulates across threads
    assert np.array_equal(y, np.cumsum(x.reshape(4, 4).sum(axis=1)))
    for node, what in ((Barrier(), "a barrier"), (Shuffle("r", (0,), 1.0, "down", 1), "the warp shuffle S")):
        bad = p.replace(body=(Loop("t", 0, 4, (node,)),))
        with pytest.raises(ValueError, match=rf"holds {what}.*emulate\(kernel\)"):
            run(bad, {}, {"x": x, "y": y})
