"""The schedule autotuner: legality of what it returns, same results as the untuned kernel,
illegal candidates pruned and counted, records across processes, damaged record files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("islpy")

import kiln.loops as kl  # noqa: E402
from kiln.backends.common.records import Record, RecordStore, machine_key, structural_key  # noqa: E402
from kiln.backends.cpu.schedules import default_schedule, strategy_schedule  # noqa: E402
from kiln.tuning.autotune import autotune, tune  # noqa: E402
from kiln.tuning.autotune.measure import random_inputs, specialize  # noqa: E402
from kiln.tuning.autotune.space import build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MATMUL = ("for (i = 0; i < N; i++) for (j = 0; j < N; j++) { C[i][j] = 0;"
          " for (k = 0; k < N; k++) C[i][j] += A[i][k] * B[k][j]; }")
# a wavefront: parallel marks on i or j and their interchange are illegal
SWEEP = "for (i = 1; i < N; i++) for (j = 1; j < N; j++) A[i][j] = A[i-1][j] * 0.5 + A[i][j-1] * 0.5;"


def _interpreted(program: kl.Program, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    arrays = {k: v.copy() for k, v in inputs.items()}
    kl.run(program, {}, arrays)
    return arrays


def _same_as_untuned(static: kl.Program, schedule: kl.Schedule, seed: int) -> None:
    inputs = random_inputs(static, seed)
    want = _interpreted(static, inputs)
    got = _interpreted(schedule.program(name=static.name), inputs)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("strategy", ["random", "evolutionary"])
def test_tuned_schedule_verifies_and_matches_the_untuned_kernel(strategy, tmp_path):
    program = kl.from_c(MATMUL, name="mm")
    result = tune(program, {"N": 24}, budget_s=None, trials=10, kind="matmul", strategy=strategy, seed=1,
                  workers=2, threads=2, records=tmp_path)
    assert result.schedule.verify()
    replayed = kl.Schedule.replay(result.program, result.schedule.trace)
    assert str(replayed.program()) == str(result.schedule.program())
    _same_as_untuned(result.program, result.schedule, seed=7)
    assert result.counts["measured"] == 10 and result.counts["wrong"] == 0
    assert result.time_s > 0 and result.default_s > 0
    record = RecordStore(tmp_path).lookup(structural_key(result.program), machine_key(2))
    assert record is not None and record.trace == result.schedule.trace


def test_illegal_candidates_are_pruned_before_measuring_and_counted():
    program = kl.from_c(SWEEP, name="sweep")
    measured = []
    result = tune(program, {"N": 40}, budget_s=None, trials=12, strategy="random", seed=3, workers=1,
                  on_measure=measured.append)
    assert result.counts["illegal"] > 0
    static = specialize(program, {"N": 40})
    for m in measured:  # every measured candidate was legal
        assert build(static, m.trace).legal
    assert result.schedule.verify()
    _same_as_untuned(static, result.schedule, seed=2)


def test_autotune_returns_a_replayable_schedule():
    program = kl.from_c("for (i = 0; i < N; i++) y[i] = x[i] * 2.0 + 1.0;", name="axpb")
    schedule = autotune(program, {"N": 4096}, budget_s=None, trials=4, workers=1)
    assert isinstance(schedule, kl.Schedule) and schedule.verify()
    static = specialize(program, {"N": 4096})
    assert str(kl.Schedule.replay(static, schedule.trace).program()) == str(schedule.program())


def test_bad_input_says_what_and_how_to_go_on():
    program = kl.from_c(MATMUL, name="mm")
    with pytest.raises(ValueError, match=r"size parameter\(s\) \['N'\].*params=\{'N': 64"):
        tune(program, {}, trials=1)
    with pytest.raises(ValueError, match="unknown strategy 'annealing'"):
        tune(program, {"N": 8}, trials=1, strategy="annealing")
    with pytest.raises(ValueError, match="budget in seconds"):
        tune(program, {"N": 8}, budget_s=None)


# ----------------------------------------------------------------------------- records
def _kernel() -> kl.Program:
    return specialize(kl.from_c(MATMUL, name="mm"), {"N": 16})


def _distinct_trace(program: kl.Program) -> list:
    s = kl.Schedule(program)
    s.tile(["i", "j"], [4, 8]).unroll("k", 3)
    return s.trace


def test_a_record_written_by_one_process_is_applied_by_another(tmp_path):
    program = _kernel()
    trace = _distinct_trace(program)
    script = textwrap.dedent(f"""
        import json, sys
        import kiln.loops as kl
        from kiln.backends.common.records import Record, RecordStore, machine_key, structural_key
        program = kl.parse({str(program)!r})
        RecordStore({str(tmp_path)!r}).add(Record(structural_key(program), machine_key(2), json.loads({json.dumps(trace)!r}),
                                               1e-4, 2e-4, {{"kernel": "mm"}}))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=120)
    scheduled = default_schedule(program, "matmul", threads=2, records=tmp_path)
    assert scheduled.trace == trace and scheduled.notes[0].startswith("tuned")
    other_machine = default_schedule(program, "matmul", threads=1, records=tmp_path)
    assert other_machine.trace == strategy_schedule(program, "matmul", threads=1).trace
    inputs = random_inputs(program, 0)
    want = _interpreted(program, inputs)
    got = _interpreted(scheduled.program, inputs)
    np.testing.assert_allclose(got["C"], want["C"], rtol=1e-12)


def test_a_corrupted_record_file_is_detected_and_ignored_with_a_warning(tmp_path):
    program = _kernel()
    store = RecordStore(tmp_path)
    good = Record(structural_key(program), machine_key(2), _distinct_trace(program), 1e-4, 2e-4)
    faster = Record(good.key, good.machine, [{"primitive": "unroll", "args": {"loop": "k", "factor": 2}}], 1e-6, 2e-4)
    store.add(good)
    store.add(faster)
    lines = store.path.read_text().splitlines()
    tampered = lines[1].replace('"time_s": 1e-06', '"time_s": 1e-09')  # digest no longer matches
    assert tampered != lines[1]
    store.path.write_text("\n".join([lines[0], tampered, "{not json", lines[0][: len(lines[0]) // 2]]) + "\n")
    with pytest.warns(UserWarning, match=r"3 damaged line\(s\) of the schedule records .* \(line 2, 3, 4\)"):
        found = RecordStore(tmp_path).lookup(good.key, good.machine)
    assert found is not None and found.trace == good.trace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduled = default_schedule(program, "matmul", threads=2, records=tmp_path)
    assert scheduled.trace == good.trace


def test_a_record_that_no_longer_replays_legally_falls_back_to_the_default(tmp_path):
    program = _kernel()
    illegal = [{"primitive": "parallel", "args": {"loop": "k"}}]  # k carries the reduction
    RecordStore(tmp_path).add(Record(structural_key(program), machine_key(2), illegal, 1e-6, 1e-3))
    scheduled = default_schedule(program, "matmul", threads=2, records=tmp_path)
    assert scheduled.trace == strategy_schedule(program, "matmul", threads=2).trace


def test_default_schedules_of_symbolic_programs_mark_no_work_dependent_parallelism(tmp_path):
    program = kl.from_c(MATMUL, name="mm")  # extents N: unknown work
    scheduled = default_schedule(program, "matmul", threads=2, records=tmp_path)
    assert not any(s["primitive"] == "parallel" for s in scheduled.trace)
    assert kl.Schedule.replay(program, scheduled.trace).verify()
