"""Schedule primitives: loops before and after, misuse errors, traces, research mode,
compute_at and inline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kiln.loops as kl  # noqa: E402
from kiln.ir.errors import IllegalTransformError, ScheduleError  # noqa: E402
from polybench import PARAMS, inputs, load  # noqa: E402

BEFORE = """program p(N: i64, M: i64) {
  buffer A: f64[N, M]
  buffer B: f64[N, M]
  for i in [0, N) {
    for j in [0, M) {
      S0: A[i, j] = A[i, j] + 1.0
    }
  }
  i_1: for i in [0, N) {
    j_1: for j in [0, M) {
      S1: B[i, j] = A[i, j] * 2.0
    }
  }
}"""

SECOND_NEST = """
  for i_1 in [0, N) {
    for j_1 in [0, M) {
      S1: B[i_1, j_1] = A[i_1, j_1] * 2.0
    }
  }
}"""

AFTER = {
    "interchange": ([("interchange", {"a": "i", "b": "j"})], """
  for j in [0, M) {
    for i in [0, N) {
      S0: A[i, j] = A[i, j] + 1.0
    }
  }""" + SECOND_NEST),
    "tile": ([("tile", {"loops": ["i", "j"], "sizes": [4, 8]})], """
  for i_tile in [0, floordiv(N - 1, 4) + 1) {
    for j_tile in [0, floordiv(M - 1, 8) + 1) {
      for i in [4 * i_tile, min(N, 4 * i_tile + 4)) {
        for j in [8 * j_tile, min(M, 8 * j_tile + 8)) {
          S0: A[i, j] = A[i, j] + 1.0
        }
      }
    }
  }""" + SECOND_NEST),
    "split": ([("split", {"loop": "j", "factor": 4})], """
  for i in [0, N) {
    for j_o in [0, floordiv(M - 1, 4) + 1) {
      for j_i in [0, min(4, M - 4 * j_o)) {
        S0: A[i, 4 * j_o + j_i] = A[i, 4 * j_o + j_i] + 1.0
      }
    }
  }""" + SECOND_NEST),
    "skew": ([("skew", {"target": "j", "source": "i", "factor": 1})], """
  for i in [0, N) {
    for j in [i, M + i) {
      S0: A[i, j - i] = A[i, j - i] + 1.0
    }
  }""" + SECOND_NEST),
    "skew_outer": ([("skew", {"target": "i", "source": "j", "factor": 1})], """
  for i in [0, N + M - 1) {
    for j in [max(0, i - N + 1), min(M, i + 1)) {
      S0: A[i - j, j] = A[i - j, j] + 1.0
    }
  }""" + SECOND_NEST),
    "transform": ([("transform", {"loops": ["i", "j"], "matrix": [[1, 1], [1, 2]]})], """
  for i in [0, N + M - 1) {
    for j in [max(i, 2 * i - N + 1), min(M + i, 2 * i + 1)) {
      S0: A[2 * i - j, j - i] = A[2 * i - j, j - i] + 1.0
    }
  }""" + SECOND_NEST),
    "split_at": ([("split_at", {"loop": "j", "value": 2})], """
  for i in [0, N) {
    for j in [0, min(2, M)) {
      S0: A[i, j] = A[i, j] + 1.0
    }
    for j_b in [2, M) {
      S0_1: A[i, j_b] = A[i, j_b] + 1.0
    }
  }""" + SECOND_NEST),
    "shift_by_expression": ([("shift", {"loop": "j", "statement": None, "offset": "N - i"})], """
  for i in [0, N) {
    for j in [N - i, N + M - i) {
      S0: A[i, i + j - N] = A[i, i + j - N] + 1.0
    }
  }""" + SECOND_NEST),
    "full_fuse_full_split": ([("full_fuse", {"loop": "i"}), ("full_split", {"loop": "i"})], """
  for i in [0, N) {
    for j in [0, M) {
      S0: A[i, j] = A[i, j] + 1.0
    }
  }
  for i_b in [0, N) {
    for j_1 in [0, M) {
      S1: B[i_b, j_1] = A[i_b, j_1] * 2.0
    }
  }
}"""),
    "reverse": ([("reverse", {"loop": "j"})], """
  for i in [0, N) {
    for j in [-M + 1, 1) {
      S0: A[i, -j] = A[i, -j] + 1.0
    }
  }""" + SECOND_NEST),
    "fuse": ([("fuse", {"a": "i", "b": "i_1"})], """
  for i in [0, N) {
    for j in [0, M) {
      S0: A[i, j] = A[i, j] + 1.0
    }
    for j_1 in [0, M) {
      S1: B[i, j_1] = A[i, j_1] * 2.0
    }
  }
}"""),
    "fission": ([("fuse", {"a": "i", "b": "i_1"}), ("fission", {"loop": "i", "split_before_child": 1})], """
  for i in [0, N) {
    for j in [0, M) {
      S0: A[i, j] = A[i, j] + 1.0
    }
  }
  for i_b in [0, N) {
    for j_1 in [0, M) {
      S1: B[i_b, j_1] = A[i_b, j_1] * 2.0
    }
  }
}"""),
    "shift": ([("fuse", {"a": "i", "b": "i_1"}), ("shift", {"loop": "i", "statement": "S1", "offset": 2})], """
  for i in [0, N + 2) {
    if (N >= i + 1) {
      for j in [0, M) {
        S0: A[i, j] = A[i, j] + 1.0
      }
    }
    if (i >= 2) {
      for j_1 in [0, M) {
        S1: B[i - 2, j_1] = A[i - 2, j_1] * 2.0
      }
    }
  }
}"""),
    "annotations": ([("parallel", {"loop": "i"}), ("vectorize", {"loop": "j"}),
                     ("unroll", {"loop": "j_1", "factor": 4}), ("map_to", {"loop": "i_1", "axis": "blockIdx.x"})], """
  for i in [0, N) @parallel {
    for j in [0, M) @vectorized {
      S0: A[i, j] = A[i, j] + 1.0
    }
  }
  for i_1 in [0, N) @mapped("blockIdx.x") {
    for j_1 in [0, M) @unrolled(4) {
      S1: B[i_1, j_1] = A[i_1, j_1] * 2.0
    }
  }
}"""),
}
HEAD = "program p(N: i64, M: i64) {\n  buffer A: f64[N, M]\n  buffer B: f64[N, M]"


def _outputs(program: kl.Program, params: dict, arrays: dict) -> dict:
    copies = {k: v.copy() for k, v in arrays.items()}
    kl.run(program, params, copies)
    return copies


@pytest.mark.parametrize("name", list(AFTER))
def test_primitive_before_and_after(name):
    steps, tail = AFTER[name]
    before = kl.parse(BEFORE)
    s = kl.Schedule(before)
    for primitive, args in steps:
        getattr(s, primitive)(**args)
    after = s.program()
    assert str(after) == HEAD + tail
    params = {"N": 5, "M": 6}
    rng = np.random.default_rng(0)
    arrays = {"A": rng.random((5, 6)), "B": rng.random((5, 6))}
    want, got = _outputs(before, params, arrays), _outputs(after, params, arrays)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("call,message", [
    (lambda s: s.interchange("i", "q"), r"interchange: unknown loop 'q'; loops: i, j, i_1, j_1"),
    (lambda s: s.interchange("i", "i"), r"both loops are 'i'"),
    (lambda s: s.interchange("i", "j_1"), r"loops 'i' and 'j_1' are not nested in each other"),
    (lambda s: s.fuse("i", "i_1").interchange("i", "j"), r"loops 'i' and 'j' are not perfectly nested: between "
                                                         r"them is a sequence of 'j', 'j_1'; use fission"),
    (lambda s: s.tile(["i", "j"], [4]), r"tile: give one size per loop"),
    (lambda s: s.tile(["i", "j"], [4, 0]), r"tile: sizes must be positive integers"),
    (lambda s: s.tile(["j", "i"], [4, 4]), r"tile: loops 'j' and 'i' are not perfectly nested"),
    (lambda s: s.split("j", 0), r"split: the factor must be a positive integer, got 0"),
    (lambda s: s.skew("i", "j_1", 1), r"skew: loops 'i' and 'j_1' are not on one path"),
    (lambda s: s.skew("i", "i", 1), r"skew: the target and source are both 'i'"),
    (lambda s: s.skew("j", "i", 0), r"skew: the factor must be a non-zero integer"),
    (lambda s: s.shift("i", "S1", 1), r"shift: statement 'S1' is not inside loop 'i'; it contains S0"),
    (lambda s: s.fuse("i_1", "i"), r"fuse: loop 'i' must follow loop 'i_1' in the same sequence"),
    (lambda s: s.fission("i", 1), r"fission: loop 'i' directly contains loop 'j'; there is nothing to split"),
    (lambda s: s.fuse("i", "i_1").fission("i", 2), r"split position 2 of loop 'i' must leave children on both"),
    (lambda s: s.fuse("i", "i_1").fission("i", "S9"), r"'S9' is not a direct child of loop 'i'"),
    (lambda s: s.vectorize("i"), r"vectorize: loop 'i' is not innermost: it contains loop 'j'"),
    (lambda s: s.unroll("j", 0), r"unroll: the factor must be a positive integer"),
    (lambda s: s.apply("permute", loops=["i"]), r"unknown primitive 'permute'"),
    (lambda s: s.apply("tile", loops=["i"]), r"tile: bad arguments"),
    (lambda s: s.compute_at("S9", "j"), r"unknown statement 'S9'"),
    (lambda s: s.compute_at("S1", "j"), r"compute_at: loop 'j' runs before statement S1"),
    (lambda s: s.compute_at("S0", "j"), r"statement S0 is already inside loop 'j'"),
    (lambda s: s.inline("S0"), r"inline: S0 stores to global buffer 'A'"),
])
def test_misapplied_primitives_raise_schedule_errors(call, message):
    s = kl.Schedule(kl.parse(BEFORE))
    with pytest.raises(ScheduleError, match=message):
        call(s)


def test_illegal_steps_leave_the_schedule_unchanged():
    s = kl.Schedule(load("seidel-2d"))
    before, program_before = str(s), str(s.program())
    with pytest.raises(IllegalTransformError):
        s.interchange("i", "j")
    assert str(s) == before and str(s.program()) == program_before and s.trace == []


def test_restore_returns_to_a_snapshot():
    s = kl.Schedule(load("jacobi-2d"))
    s.tile(["i", "j"], [2, 3])
    snapshot, program_then = s.copy(), str(s.program())
    s.parallel("i_tile").unroll("j", 2)
    assert str(s.program()) != program_then
    s.restore(snapshot)
    assert str(s.program()) == program_then and s.trace == snapshot.trace
    s.parallel("i_tile")  # the snapshot is not shared: it keeps its own state
    assert snapshot.annotation("i_tile").mode == "serial"
    with pytest.raises(ScheduleError, match="another program"):
        s.restore(kl.Schedule(load("gemm")))


def test_a_later_step_must_keep_parallel_marks_valid():
    s = kl.Schedule(load("jacobi-1d"))
    s.parallel("i").parallel("i_1").shift("i_1", "S1", 1)
    with pytest.raises(IllegalTransformError, match=r"loop 'i' cannot run in parallel"):
        s.fuse("i", "i_1")
    s.serial("i_1").fuse("i", "i_1")  # the fused loop keeps no mark when the two differ
    assert s.annotation("i").mode == "serial" and s.verify().legal


def test_research_mode_applies_without_checking_and_verify_reports():
    s = kl.Schedule(load("seidel-2d"), check=False)
    s.interchange("i", "j").parallel("t")
    verdict = s.verify()
    assert not verdict.legal and "illegal schedule" in verdict.explanation
    s2 = kl.Schedule(load("gemm"), check=False).parallel("k")
    v2 = s2.verify()
    assert not v2 and v2.violation.loop == "k" and "cannot run in parallel" in v2.explanation


def test_traces_are_json_and_replay_to_the_same_program():
    program = load("jacobi-2d")
    s = kl.Schedule(program)
    s.tile(["i", "j"], [2, 3]).parallel("i_tile").unroll("j", 2)
    text = s.trace_json()
    assert json.loads(text)[0] == {"primitive": "tile", "args": {"loops": ["i", "j"], "sizes": [2, 3]}}
    again = kl.Schedule.replay(program, text)
    assert str(again.program()) == str(s.program()) and again.trace == s.trace
    bad = json.dumps([{"primitive": "parallel", "args": {"loop": "t"}}])
    with pytest.raises(IllegalTransformError):
        kl.Schedule.replay(program, bad)
    assert not kl.Schedule.replay(program, bad, check=False).verify().legal


def test_multi_level_tiling_by_repetition():
    s = kl.Schedule(load("gemm"))
    s.tile(["k", "j_1"], [4, 4]).tile(["k_tile", "j_1_tile"], [2, 2])
    assert s.loops()[:6] == ["i", "j", "k_tile_tile", "j_1_tile_tile", "k_tile", "j_1_tile"]
    generated = s.program()
    params = PARAMS["gemm"] | {"NK": 9, "NJ": 11}
    want = inputs("gemm", generated, params)
    got = {k: v.copy() for k, v in want.items()}
    kl.run(load("gemm"), params, want)
    kl.run(generated, params, got)
    np.testing.assert_allclose(got["C"], want["C"], rtol=1e-12)


# ----------------------------------------------------------------------------- producers and consumers
def _same_results(a: kl.Program, b: kl.Program, params: dict, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    n = params["N"]
    arrays = {"A": rng.random(n), "C": rng.random(n)}
    want, got = _outputs(a, params, arrays), _outputs(b, params, arrays)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12)


def test_compute_at_places_the_producer_in_the_consumer_loop():
    blur = load("blur")
    s = kl.Schedule(blur).compute_at("P", "j")
    assert s.loops() == ["j", "i"] and s.loop_statements("j") == ["P", "Q"]
    generated = s.program()
    for n in (1, 2, 3, 7):
        _same_results(blur, generated, {"N": n}, seed=n)


def test_compute_at_is_checked():
    prog = kl.from_c("""
for (i = 0; i < N; i++) P: B[i] = A[i] * 2.0;
for (j = 0; j < N - 1; j++) Q: A[j + 1] = B[j] + 1.0;
""")
    with pytest.raises(IllegalTransformError, match=r"anti dependence on A\[1\]: P\[i=1\] reads it before Q\[j=0\] "
                                                    r"writes it"):
        kl.Schedule(prog).compute_at("P", "j")


def test_inline_substitutes_the_producer():
    blur = load("blur")
    s = kl.Schedule(blur).inline("P")
    generated = s.program()
    assert "buffer B" not in str(generated) and s.statements() == ["Q"]
    assert "Q: C[j] = A[j - 1] * 2.0 + 1.0 + (A[j] * 2.0 + 1.0) + (A[j + 1] * 2.0 + 1.0)" in str(generated)
    _same_results(blur, generated, {"N": 6})
    s.parallel("j")
    assert s.trace == [{"primitive": "inline", "args": {"statement": "P"}},
                       {"primitive": "parallel", "args": {"loop": "j"}}]


def test_inline_is_checked():
    prog = kl.from_c("""
void f(int N, double A[N], double C[N]) {
  double B[N];
  for (int i = 0; i < N; i++) P: B[i] = A[i] * 2.0;
  for (int j = 0; j < N; j++) W: A[j] = 0.0;
  for (int k = 0; k < N; k++) Q: C[k] = B[k];
}""")
    with pytest.raises(IllegalTransformError, match=r"inline P is illegal: W\[j=0\] overwrites A\[0\] after P\[i=0\] "
                                                    r"reads it and before Q\[k=0\]"):
        kl.Schedule(prog).inline("P")
    unchecked = kl.Schedule(prog, check=False).inline("P")
    assert not unchecked.verify().legal
