"""``kiln.tuning``: one timing loop behind every timer, the measured cost of pass ordering,
timed loop schedules, and the model-level measurement tool (``benchmarks.measure``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kiln.ir as ir
import kiln.loops as kl
import kiln.passes.schedule
from kiln.backends.reference import run_graph
from kiln.passes.ordering import action_set, get_cost, op_count
from kiln.passes.ordering.episode import CostModel
from kiln.passes.ordering.learned import LearnedPipeline
from kiln.passes.ordering.transitions import TransitionCache
from kiln.runtime import timing
from kiln.tuning import measure, schedules
from kiln.tuning.rl.corpus import random_graph
from kiln.tuning.rl.costs import COSTS, cost_model

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GRAPH = """
graph @g(%x: f32[3, 4]) params(%w: f32[4, 4]) {
  %0: f32[3, 4] = matmul(%x, %w)
  %1: f32[3, 4] = tanh(%0)
  return %1
}"""


# ----------------------------------------------------------------------------- one timing loop
def test_tuning_reexports_the_one_best_time():
    assert measure.best_time is timing.best_time


def test_measured_cost_times_the_reference_executor_with_best_time(monkeypatch):
    graph = ir.parse(GRAPH)
    calls = []

    def fake_best_time(run, **options):
        calls.append(options)
        calls.append(run())  # what is timed: the graph on its seeded random arguments
        return 0.25

    monkeypatch.setattr(measure, "best_time", fake_best_time)
    assert measure.measure_runtime(graph, repeats=4, seed=3) == 0.25
    options, outputs = calls
    assert options == {"repeat": 4, "warmup": 1, "statistic": "median"}
    inputs, params = measure.random_arguments(graph, 3)
    np.testing.assert_allclose(outputs[0], run_graph(graph, inputs, params)[0], rtol=1e-6)


def test_measured_cost_is_a_positive_time():
    assert 0 < measure.measure_runtime(ir.parse(GRAPH), repeats=2) < 1.0


def test_profile_plan_sums_each_category(monkeypatch):
    class Plan:
        def profile(self, args, repeat):
            assert repeat == 2
            return [("NativeRunStep: [gemm 8x8x8] k0", 3e-3), ("NativeRunStep: layer_norm k1", 1.001e-3),
                    ("NativeRunStep: tanh k2", 0.5e-3), ("NativeRunStep: exp k3", 0.499e-3),
                    ("ReleaseStep: ", 1e-4), ("Mystery: x", 2e-4)]

    total, rows = measure.profile_plan(Plan(), [], repeat=2)
    assert total == pytest.approx(5.3e-3)
    assert [(c, n) for c, _, n in rows] == [("GEMM (+ fused epilogue)", 1), ("normalization kernels", 1),
                                            ("other generated kernels", 2), ("other", 1), ("releasing buffers", 1)]
    assert [t for _, t, _ in rows] == pytest.approx([3e-3, 1.001e-3, 0.999e-3, 2e-4, 1e-4])


def test_kernel_profiling_sets_and_restores_the_variable(monkeypatch):
    monkeypatch.delenv(measure.PROFILE_ENV_VAR, raising=False)
    import os

    with measure.kernel_profiling():
        assert os.environ[measure.PROFILE_ENV_VAR] == "1"
    assert measure.PROFILE_ENV_VAR not in os.environ


TIMED = ("kiln/tuning", "kiln/passes", "kiln/loops.py", "benchmarks")


def test_no_hand_written_timing_loops():
    """Timers in these places call best_time: no loop calls a clock itself."""
    found = []
    paths = [p for where in TIMED for p in ((ROOT / where).rglob("*.py") if (ROOT / where).is_dir()
                                            else [ROOT / where])]
    for path in paths:
        tree = ast.parse(path.read_text())
        for loop in ast.walk(tree):
            if not isinstance(loop, (ast.For, ast.While, ast.ListComp, ast.GeneratorExp)):
                continue
            for node in ast.walk(loop):
                if isinstance(node, ast.Attribute) and node.attr.startswith(("perf_counter", "monotonic")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


# ----------------------------------------------------------------------------- pass-ordering costs
def test_passes_only_estimate_and_tuning_adds_the_measured_cost():
    assert COSTS == ("op_count", "kernel_count", "runtime", "measured")
    with pytest.raises(ValueError, match="unknown cost 'measured'"):
        get_cost("measured")
    graph = random_graph(1)
    cache = TransitionCache(action_set("base"))
    key = cache.intern(graph)
    assert cost_model("op_count")(cache, key) == op_count(graph)
    measured = cost_model("measured")
    assert measured.fn is measure.measure_runtime and measured(cache, key) > 0
    with pytest.raises(ValueError, match="choose one of op_count, kernel_count, runtime, measured"):
        cost_model("ops")


def test_corpus_fingerprint_reads_the_sources_where_they_are():
    from kiln.tuning.rl import corpus

    names = {p.relative_to(ROOT).as_posix() for p in corpus.fingerprint_sources("training")}
    assert {"kiln/frontends/torch/capture.py", "kiln/frontends/torch/aten.py", "kiln/passes/decompose.py",
            "kiln/passes/autodiff.py", "kiln/tuning/rl/zoo.py", "kiln/tuning/rl/corpus.py"} <= names
    assert "kiln/passes/autodiff.py" not in {p.relative_to(ROOT).as_posix() for p in corpus.fingerprint_sources()}
    assert corpus.fingerprint("mlp") != corpus.fingerprint("training")


def test_environment_trains_on_the_measured_cost():
    pytest.importorskip("gymnasium")
    from kiln.tuning.rl.env import PassOrderingEnv

    env = PassOrderingEnv([random_graph(2, size=10)], cost="measured", budget=2)
    _, info = env.reset(seed=0)
    assert info["cost"] > 0 and env.cost_model.fn is measure.measure_runtime
    _, reward, *_ = env.step(int(np.flatnonzero(env.action_masks())[0]))
    assert np.isfinite(reward)


def test_learned_pipeline_takes_a_cost_model():
    seen = []

    def constant(graph):
        seen.append(graph)
        return 7.0

    pipeline = LearnedPipeline(cost=CostModel("constant", fn=constant))
    pipeline.run(random_graph(3))
    assert seen and pipeline.last.policy_cost == 7.0 and pipeline.last.default_cost == 7.0


def test_learned_passes_work_in_a_fresh_process_without_tuning():
    code = (
        "import sys, torch, kiln\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)).eval()\n"
        "x = torch.randn(2, 8)\n"
        "c = kiln.compile(m, (x,), passes='learned', backend='reference')\n"
        "assert torch.allclose(c(x), m(x), atol=1e-5)\n"
        "print(sorted(n for n in sys.modules if n.startswith('kiln.tuning')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- loop schedules
def test_timed_schedules_live_in_tuning():
    assert kl.measure_runtime is schedules.measure_runtime
    assert kl.export_dataset is schedules.export_dataset
    assert not hasattr(kiln.passes.schedule, "measure_runtime")
    assert not hasattr(kiln.passes.schedule, "export_dataset")


def test_schedule_runtime_is_measured_natively():
    from kiln.backends.cpu.toolchain import c_compiler

    if c_compiler() is None:
        pytest.skip("no C compiler")
    program = kl.from_c("for (i = 0; i < N; i++) A[i] = A[i] * 2.0;")
    assert 0 < schedules.measure_runtime(program, {"N": 64}, repeat=2) < 1.0
    arrays = schedules.random_arrays(program, {"N": 5}, np.random.default_rng(0))
    assert arrays["A"].shape == (5,) and ((0 <= arrays["A"]) & (arrays["A"] < 1)).all()


# ----------------------------------------------------------------------------- model-level tool
def test_interleaved_alternates_and_times_each_call_with_best_time(monkeypatch):
    from benchmarks import measure as model_measure

    order = []
    times = iter([1.0, 10.0, 3.0, 30.0, 2.0, 20.0])

    def fake_best_time(run, **options):
        assert options == {"repeat": 1, "warmup": 0}
        run()
        return next(times)

    monkeypatch.setattr(model_measure, "best_time", fake_best_time)
    a, b = model_measure.interleaved(lambda: order.append("a"), lambda: order.append("b"), runs=3)
    assert (a, b) == (2.0, 20.0)
    assert order == ["a", "b"] * 5  # two warm-up pairs, then three timed pairs


def test_benchmark_harness_times_calls_with_best_time(monkeypatch):
    from benchmarks import harness

    calls = []
    monkeypatch.setattr(harness, "best_time", lambda run, **options: calls.append(options) or 0.125)

    class Entry:
        class prepared:
            run = staticmethod(lambda: None)

    assert harness._call(Entry) == 0.125 and calls == [{"repeat": 1, "warmup": 0}]
