"""Smoke tests of the benchmark harness (benchmarks/): one tiny model, eager and kiln, quick mode.

No timing assertions: the tests check that a run produces consistent outputs (markdown,
JSON, plot), that ratios come from the run's own medians, that failing systems are
reported instead of crashing the run, and that the budget rules mark what they cut.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import BenchConfig, SystemResult, run, to_markdown
from benchmarks.harness import bench_workload, compute_ratios, summarize
from benchmarks.models import MODELS, Shape, Workload, select_workloads
from benchmarks.systems import Prepared, System, kiln_backend_name


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    # the reference backend compiles nothing, which keeps this smoke test at a few seconds
    document = run(BenchConfig(models=["tiny-mlp"], systems=["eager", "kiln"], quick=True, out=out,
                               kiln_backend="reference", progress=False, settle_s=0.05))
    return document, out


def test_quick_run_writes_markdown_json_and_plot(tiny_run: tuple[dict[str, Any], Path]) -> None:
    document, out = tiny_run
    saved = json.loads((out / "results.json").read_text())
    assert saved["schema"] == "kiln-bench/1"
    assert [w["name"] for w in saved["workloads"]] == ["tiny-mlp-b1", "tiny-mlp-b16"]
    assert saved["workloads"] == document["workloads"]
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "results.md").read_text()
    assert markdown == to_markdown(saved) + "\n"  # the report renders from the JSON alone
    assert saved["machine"]["cpu"] in markdown and saved["machine"]["torch"] in markdown
    assert "kiln (reference)" in markdown
    assert saved["config"]["runs"] == 10 and saved["config"]["quick"] is True


def test_every_system_ran_and_matches_eager(tiny_run: tuple[dict[str, Any], Path]) -> None:
    document, _ = tiny_run
    for workload in document["workloads"]:
        for name in ("eager", "kiln"):
            result = workload["results"][name]
            assert result["status"] == "ok", (workload["name"], name, result["reason"])
            assert result["runs"] == len(result["samples_ms"]) > 0
            assert result["p10_ms"] <= result["median_ms"] <= result["p90_ms"]
            assert result["cold_start_s"] > 0
        assert workload["results"]["kiln"]["max_rel_err"] <= 1e-4
        assert workload["results"]["eager"]["max_rel_err"] == 0.0


def test_ratios_come_from_the_same_run(tiny_run: tuple[dict[str, Any], Path]) -> None:
    document, out = tiny_run
    markdown = (out / "results.md").read_text()
    for workload in document["workloads"]:
        eager, kiln = workload["results"]["eager"], workload["results"]["kiln"]
        assert kiln["vs_eager"] == pytest.approx(eager["median_ms"] / kiln["median_ms"])
        assert eager["vs_eager"] == pytest.approx(1.0)
        assert kiln["best_peer"] == "eager" and kiln["vs_best_peer"] == pytest.approx(kiln["vs_eager"])
        assert eager["best_peer"] == "kiln" and eager["vs_best_peer"] == pytest.approx(1 / kiln["vs_eager"])
        assert kiln["vs_inductor"] is None  # Inductor did not run
        assert f"{kiln['vs_eager']:.2f}x" in markdown or f"{kiln['vs_eager']:.3f}x" in markdown


# --------------------------------------------------------------------------- failures and budgets


class _Scripted(System):
    """A fake system: ``prepare`` may raise; each call sleeps ``call_s`` and may raise on call n."""

    def __init__(self, name: str, *, prepare_error: bool = False, fail_on_call: int | None = None,
                 call_s: float = 0.0):
        self.name = self.label = name
        self.prepare_error, self.fail_on_call, self.call_s = prepare_error, fail_on_call, call_s
        self.calls = 0

    def prepare(self, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], workdir: Path,
                key: str) -> Prepared:
        if self.prepare_error:
            raise RuntimeError("no kernel for aten::frobnicate\nsecond line")

        output = model(*inputs)

        def call() -> torch.Tensor:  # the model's output without running it: no CPU time
            self.calls += 1
            if self.fail_on_call is not None and self.calls >= self.fail_on_call:
                raise ValueError(f"call {self.calls} exploded")
            if self.call_s:
                time.sleep(self.call_s)
            return output

        return Prepared(call, cold_start_s=0.0, first_output=output, first_call_s=self.call_s)


def _bench(systems: list[System], tmp_path: Path, **config: Any) -> dict[str, Any]:
    spec = MODELS["tiny-mlp"]
    settings = BenchConfig(quick=True, progress=False, settle_s=0.0, **config).resolved()
    from benchmarks.harness import _Progress

    return bench_workload(spec.build(), Workload(spec, Shape(1)), systems, settings, tmp_path,
                          _Progress(0, enabled=False))["results"]


def test_failing_systems_are_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    results = _bench([_Scripted("eager"), _Scripted("broken", prepare_error=True),
                      _Scripted("flaky", fail_on_call=4)], tmp_path)
    assert results["broken"]["status"] == "failed"
    assert results["broken"]["reason"] == "prepare: RuntimeError: no kernel for aten::frobnicate"
    assert results["flaky"]["status"] == "failed"
    assert "ValueError: call 4 exploded" in results["flaky"]["reason"]
    assert results["eager"]["status"] == "ok" and results["eager"]["runs"] == 10
    assert results["eager"]["best_peer"] is None  # failed systems are nobody's peer


def test_budget_limits_are_marked(tmp_path: Path) -> None:
    results = _bench([_Scripted("eager"), _Scripted("slow", call_s=0.05), _Scripted("glacial", call_s=0.5)],
                     tmp_path, budget_s=0.12)
    assert results["eager"]["limited"] == "" and results["eager"]["runs"] == 10
    assert results["slow"]["limited"] == "budget" and 1 <= results["slow"]["runs"] < 10
    assert results["glacial"]["limited"] == "first-call" and results["glacial"]["runs"] == 1
    assert results["glacial"]["median_ms"] == pytest.approx(500.0)


# --------------------------------------------------------------------------- pure helpers


def test_summary_keeps_the_round_with_the_lower_median() -> None:
    result = SystemResult("x")
    summarize(result, [[0.003, 0.001, 0.002], [0.010, 0.011, 0.012, 0.013, 0.014]])
    assert result.round_medians_ms == pytest.approx([2.0, 12.0])
    assert result.median_ms == pytest.approx(2.0) and result.runs == 3
    assert result.p10_ms == pytest.approx(1.2) and result.p90_ms == pytest.approx(2.8)


def test_ratios_against_eager_inductor_and_best_peer() -> None:
    results = {name: SystemResult(name, median_ms=ms) for name, ms in
               (("eager", 10.0), ("inductor", 5.0), ("onnxruntime", 4.0), ("kiln", 8.0))}
    results["tvm"] = SystemResult("tvm", status="skipped")
    compute_ratios(results)
    kiln = results["kiln"]
    assert (kiln.vs_eager, kiln.vs_inductor, kiln.best_peer, kiln.vs_best_peer) == (1.25, 0.625, "onnxruntime", 0.5)
    assert results["onnxruntime"].best_peer == "inductor" and results["onnxruntime"].vs_best_peer == 1.25
    assert results["tvm"].vs_eager is None


def test_kiln_runs_its_cpu_backend_when_registered() -> None:
    from kiln.backends import DEFAULT_BACKEND, available_backends

    expected = "cpu" if "cpu" in available_backends() else DEFAULT_BACKEND
    assert kiln_backend_name() == expected
    assert kiln_backend_name("reference") == "reference"


def test_workload_selection() -> None:
    assert [w.name for w in select_workloads(quick=True)] == ["mlp-b1", "mlp-b64"]
    full = [w.name for w in select_workloads()]
    assert {"gpt2-s128-b1", "gpt2-s512-b4", "bert-s128-b8", "resnet18-b8"} <= set(full)
    assert "tiny-mlp-b1" not in full
    with pytest.raises(ValueError, match="unknown benchmark model.*nope"):
        select_workloads(["nope"])


def test_kiln_bench_forwards_to_the_harness(capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.compiler.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "usage: kiln bench" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--systems", "eager,nope"])
    assert exit_info.value.code == 2
    assert "unknown system(s) nope" in capsys.readouterr().err


def test_a_model_that_cannot_be_built_fails_its_workloads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.models import ModelSpec

    def build() -> torch.nn.Module:
        raise ImportError("No module named 'transformers'")

    monkeypatch.setitem(MODELS, "unbuildable", ModelSpec("unbuildable", "needs a missing package", build,
                                                         lambda shape: (torch.ones(1),), (Shape(1),),
                                                         default=False))
    document = run(BenchConfig(models=["unbuildable"], systems=["eager"], quick=True, out=None, progress=False))
    (workload,) = document["workloads"]
    result = workload["results"]["eager"]
    assert result["status"] == "failed"
    assert result["reason"] == "building the model failed: ImportError: No module named 'transformers'"


def test_outputs_unwrap_to_the_first_tensor() -> None:
    from collections import OrderedDict

    import numpy as np

    from benchmarks.systems import first_array, relative_error

    tensor = torch.arange(6.0).reshape(2, 3)
    for output in (tensor, (tensor, tensor * 2), [tensor.numpy()], OrderedDict(last_hidden_state=tensor)):
        np.testing.assert_array_equal(first_array(output), tensor.numpy())
    assert relative_error(tensor + 0.5, tensor.numpy()) == pytest.approx(0.1)
    assert relative_error(tensor[:1], tensor.numpy()) == float("inf")


# --------------------------------------------------------------------------- training step


def test_training_step_benchmark_smoke(tmp_path: Path) -> None:
    """Two timed training steps of a tiny MLP, eager and kiln (reference backend)."""
    from benchmarks.train_bench import run_train

    document = run_train(BenchConfig(models=["tiny-mlp"], systems=["eager", "kiln"], runs=2, warmup=0, rounds=1,
                                     out=tmp_path, kiln_backend="reference", progress=False, settle_s=0.0,
                                     plot=False))
    (workload,) = document["workloads"]
    assert workload["name"] == "tiny-mlp" and workload["loss"] == "MSE"
    for name in ("eager", "kiln"):
        result = workload["results"][name]
        assert result["status"] == "ok", (name, result["reason"])
        assert result["runs"] == 2 and len(result["samples_ms"]) == 2
    kiln, eager = workload["results"]["kiln"], workload["results"]["eager"]
    assert kiln["max_rel_err"] <= 1e-4  # first-step loss against eager's, same initial weights
    assert kiln["vs_eager"] == pytest.approx(eager["median_ms"] / kiln["median_ms"])
    saved = workload["saved_for_backward"]
    # x@W1 -> GELU -> @W2 -> MSE: save-all keeps the hidden pre- and post-activation (16x128
    # floats each) at least; remat recomputes GELU's output instead of saving it
    assert saved["kiln"]["save-all"] >= 2 * 16 * 128 * 4
    assert 0 < saved["kiln"]["remat"] < saved["kiln"]["save-all"]
    assert saved["eager"]["autograd"] > 0
    markdown = (tmp_path / "train" / "results.md").read_text()
    assert markdown.startswith("# kiln training-step benchmark results")
    assert "Activations saved for the backward" in markdown and "kiln (reference)" in markdown
