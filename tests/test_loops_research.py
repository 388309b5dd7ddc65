"""The research API: tree nodes, action spaces, seeded sampling, datasets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kiln.loops as kl  # noqa: E402
from kiln.ir.errors import IllegalTransformError, ScheduleError  # noqa: E402
from kiln.backends.cpu.toolchain import c_compiler as compiler  # noqa: E402
from polybench import PARAMS, load  # noqa: E402


def test_nodes_describe_the_schedule_tree():
    s = kl.Schedule(load("gemm"))
    info = kl.nodes(s)
    assert [(n.kind, n.name) for n in info] == [
        ("band", "i"), ("sequence", None), ("band", "j"), ("leaf", "S0"), ("band", "k"), ("band", "j_1"),
        ("leaf", "S1")]
    assert info[1].children == ("j", "k") and info[0].statements == ("S0", "S1")
    s.parallel("i")
    assert kl.nodes(s)[0].annotation == "parallel"


def test_applicable_steps_apply_and_legal_ones_are_legal():
    s = kl.Schedule(load("seidel-2d"))
    structural = kl.applicable(s, "i")
    legal = kl.applicable(s, "i", legal_only=True)
    assert set(legal) < set(structural)
    assert kl.Step.of("interchange", a="i", b="j") in structural
    assert kl.Step.of("interchange", a="i", b="j") not in legal
    assert kl.Step.of("parallel", loop="i") not in legal and kl.Step.of("unroll", loop="i", factor=2) in legal
    for step in legal:
        trial = s.copy()
        step.apply(trial)
        assert trial.verify().legal
    for step in set(structural) - set(legal):
        with pytest.raises(IllegalTransformError):
            step.apply(s.copy())
    assert s.trace == []


def test_candidates_cover_producer_consumer_steps():
    s = kl.Schedule(load("blur"))
    steps = kl.candidate_steps(s)
    assert kl.Step.of("inline", statement="P") in steps
    assert kl.Step.of("inline", statement="P") in kl.applicable(s, legal_only=True)


def test_random_legal_sequences_are_seeded_and_legal():
    program = load("jacobi-2d")
    a = kl.random_legal_sequence(program, 4, seed=7)
    b = kl.random_legal_sequence(program, 4, seed=7)
    assert a.trace == b.trace and len(a.trace) == 4
    assert a.verify().legal
    assert kl.Schedule.replay(program, a.trace).trace == a.trace


def test_random_unchecked_sequences_only_fail_structurally_never():
    program = load("lu")
    for seed in range(5):
        s = kl.random_sequence(program, 3, seed=seed)
        assert len(s.trace) == 3
        try:
            kl.Schedule.replay(program, s.trace)
        except IllegalTransformError:
            assert not s.verify().legal
        except ScheduleError:  # pragma: no cover - a sampled step must apply structurally
            raise


@pytest.mark.skipif(compiler() is None, reason="no C compiler")
def test_export_dataset_writes_json_lines(tmp_path):
    out = tmp_path / "data.jsonl"
    programs = {"prefix-sum": load("prefix-sum"), "seidel-2d": load("seidel-2d")}
    count = kl.export_dataset(programs, out, sequences_per_program=4, length=2, seed=1,
                              params={"prefix-sum": PARAMS["prefix-sum"]}, progress=False, legal_fraction=0.5)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert count == len(records) == 8
    for r in records:
        assert set(r) == {"program", "source", "steps", "legal", "explanation", "runtime_s", "baseline_runtime_s"}
        replayed = kl.Schedule.replay(kl.parse(r["source"]), r["steps"], check=False)
        assert replayed.verify().legal == r["legal"]
        assert (r["explanation"] is None) == r["legal"]
        if r["program"] == "prefix-sum":
            assert r["runtime_s"] > 0 and r["baseline_runtime_s"] > 0
        else:
            assert r["runtime_s"] is None
    assert {r["legal"] for r in records} == {True, False}  # seed 1 draws both kinds


def test_candidates_cover_the_new_band_transforms():
    s = kl.Schedule(kl.from_c("""
double A[N], B[N], C[N], D[N];
for (i = 1; i < N; i++) { B[i] = A[i] * 2.0; C[i] = B[i] + B[i - 1]; D[i] = C[i] * C[i]; }
for (t = 0; t < N; t++) for (j = 0; j < N; j++) A[j] = A[j] + 1.0;
"""))
    steps = kl.candidate_steps(s)
    for step in (kl.Step.of("full_split", loop="i"), kl.Step.of("scale", loop="i", factor=2),
                 kl.Step.of("skew", target="t", source="j", factor=1)):
        assert step in steps
    legal = kl.applicable(s, legal_only=True)
    assert kl.Step.of("full_split", loop="i") in legal and kl.Step.of("skew", target="t", source="j", factor=1) in legal
    assert kl.Step.of("reverse", loop="t") not in legal
    step = kl.Step.of("transform", loops=["t", "j"], matrix=[[1, 0], [1, 1]])
    assert step.as_dict() == {"primitive": "transform", "args": {"loops": ["t", "j"], "matrix": [[1, 0], [1, 1]]}}
    assert {step} and "for j in [t, N + t)" in str(step.apply(s.copy()).program())
