"""Measure kiln's cpu backend against PyTorch eager: ``python -m benchmarks.measure``.

Prints, per model, eager and kiln-cpu latency (median of interleaved runs, so machine load
hits both alike), the speedup, the compile time, the planned arena beside the sum of the
intermediates, and the per-call overhead of an executable whose kernels do almost nothing.
Not a test: numbers depend on the machine.  A quicker, narrower tool than ``python -m
benchmarks`` (two systems, no report files); the graph-level pieces it uses are
:mod:`kiln.tuning.measure`'s.

    python -m benchmarks.measure                  # test models and GPT-2 small seq 128
    python -m benchmarks.measure gpt2-small bert-base --runs 20 --threads 1
    python -m benchmarks.measure gpt2-small --profile   # where the time goes
    python -m benchmarks.measure gpt2-small --roofline  # GFLOP/s against this machine's sgemm peak

``--roofline`` measures the machine's sgemm peak in the same run (the best GFLOP/s of
``torch.mm`` -- MKL here -- on square float32 matrices of 1024 to 3072 at the thread count)
and reports each model's GEMM work (matmuls, convolutions and attention, counted from
kiln's graph with the ops' cost rules) over kiln's median latency, as GFLOP/s and as a share
of that peak.  Everything else the model does (norms, softmax, GELU) counts as time, not
work, so the share is a bound on how close to the GEMM roofline the whole model runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kiln
from kiln.tuning.measure import best_time, call_overhead_us, kernel_profiling, profile_plan

TESTS = Path(__file__).resolve().parent.parent / "tests"
"""Where ``tests/models.py`` lives (the ``test-*`` models and ResNet-18)."""

ModelFactory = Callable[[], tuple[torch.nn.Module, tuple, dict]]


def _gpt2_small() -> tuple[torch.nn.Module, tuple, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(use_cache=False)).eval()
    return model, (torch.randint(0, 50257, (1, 128)),), {}


def _bert_base() -> tuple[torch.nn.Module, tuple, dict]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig()).eval()
    return model, (torch.randint(0, 30522, (1, 128)),), {}


def _test_models() -> Any:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import models

    return models


def _resnet18_224() -> tuple[torch.nn.Module, tuple, dict]:
    return _test_models().resnet18(1000), (torch.randn(1, 3, 224, 224),), {}


def _mlp_batch() -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10)).eval()
    return model, (torch.randn(32, 784),), {}


def _test_model(name: str) -> ModelFactory:
    def make() -> tuple[torch.nn.Module, tuple, dict]:
        builder, inputs = _test_models().MODELS[name]
        args, kwargs = inputs()
        return builder(), args, kwargs
    return make


MODELS: dict[str, ModelFactory] = {
    "gpt2-small": _gpt2_small, "bert-base": _bert_base, "resnet18-224": _resnet18_224, "mlp-784": _mlp_batch,
    **{f"test-{n}": _test_model(n) for n in ("mlp", "resnet18", "cnn", "gpt2", "bert")},
}


def interleaved(a: Callable[[], Any], b: Callable[[], Any], runs: int) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b`` called alternately ``runs`` times each, after two
    warm-up calls of each.  Each call is timed alone with :func:`best_time`; alternating
    them puts both under the same machine load."""
    for _ in range(2):
        a()
        b()
    samples = [(best_time(a, repeat=1, warmup=0), best_time(b, repeat=1, warmup=0)) for _ in range(runs)]
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


GEMM_LIKE = ("matmul", "conv", "conv_transpose", "scaled_dot_product_attention")
"""Ops whose work is a GEMM (their ``cost`` rule counts multiply-adds as two FLOPs)."""


def gemm_flops(graph: Any) -> float:
    """FLOPs of the GEMM-like nodes of a kiln graph (fused bodies included), from the ops'
    cost rules."""
    total = 0.0
    for node in graph.nodes:
        if node.op_name == "fused":
            total += gemm_flops(node.attrs["body"])
        elif node.op_name in GEMM_LIKE and node.op.cost is not None:
            total += float(node.op.cost([v.type for v in node.inputs], [v.type for v in node.outputs], **node.attrs))
    return total


def sgemm_peak(sizes: tuple[int, ...] = (1024, 2048, 3072)) -> tuple[float, int]:
    """This machine's float32 GEMM peak at torch's thread count: the best GFLOP/s of
    ``torch.mm`` (MKL where torch has it) over square matrices of ``sizes``; returns it and
    the size that reached it."""
    best = (0.0, 0)
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        seconds = best_time(lambda: torch.mm(a, b, out=out), repeat=5, warmup=2)
        best = max(best, (2.0 * n ** 3 / seconds / 1e9, n))
    return best


def measure_model(name: str, runs: int) -> dict[str, Any]:
    """Eager and kiln-cpu latency (ms) of the model ``name`` of :data:`MODELS`, the speedup,
    the compile time (s), the memory plan and the GEMM work (GFLOP, :func:`gemm_flops`)."""
    model, args, kwargs = MODELS[name]()
    start = time.perf_counter()
    compiled = kiln.compile(model, args, backend="cpu", example_kwargs=kwargs)
    compile_s = time.perf_counter() - start  # one compile, not a timing loop
    with torch.no_grad():
        eager_s, kiln_s = interleaved(lambda: model(*args, **kwargs), lambda: compiled(*args, **kwargs), runs)
    info = getattr(compiled.executable, "info", {})
    return {"model": name, "eager_ms": eager_s * 1e3, "kiln_ms": kiln_s * 1e3, "speedup": eager_s / kiln_s,
            "compile_s": compile_s, "memory": info.get("memory", ""),
            "gemm_gflop": gemm_flops(compiled.executable.graph) / 1e9}


def profile_model(name: str, repeat: int = 5) -> tuple[float, list[tuple[str, float, int]]]:
    """:func:`profile_module` of the model ``name`` of :data:`MODELS`."""
    model, args, kwargs = MODELS[name]()
    return profile_module(model, args, kwargs, repeat)


def profile_module(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, repeat: int = 5
                   ) -> tuple[float, list[tuple[str, float, int]]]:
    """Where one call of ``model`` compiled by kiln's cpu backend spends its time: compiled
    under :func:`~kiln.tuning.measure.kernel_profiling` (each kernel a native call of its
    own) and timed by :func:`~kiln.tuning.measure.profile_plan` (best of ``repeat`` per
    call, summed per category).  Returns the total seconds and ``(category, seconds,
    calls)`` rows, largest first."""
    kwargs = dict(kwargs or {})
    with kernel_profiling():
        compiled = kiln.compile(model, args, backend="cpu", example_kwargs=kwargs)
    flat = [*compiled._check(compiled._flatten(args, kwargs)), *compiled.params]
    return profile_plan(compiled.executable.plan, flat, repeat=repeat)


class _TinyElementwise(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2 + 1).relu()


def module_call_overhead_us(number: int = 5000) -> list[tuple[str, float, float]]:
    """Per-call time in microseconds of a ``kiln.compile``d module (the whole Python call:
    input checks, the call plan, its kernels, the outputs) and of eager, on two tiny models
    whose kernels take well under a microsecond: ``(label, kiln_us, eager_us)``."""
    x = torch.randn(4)
    rows = []
    for label, model in (("elementwise on f32[4]", _TinyElementwise()), ("Linear(4, 4) on f32[4]", torch.nn.Linear(4, 4))):
        compiled = kiln.compile(model, (x,), backend="cpu")
        with torch.no_grad():
            times = [best_time(lambda f=f: f(x), repeat=5, warmup=100, number=number) * 1e6 for f in (compiled, model)]
        rows.append((label, *times))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.measure", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"models (default: the test models and gpt2-small); one of {', '.join(sorted(MODELS))}")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch and kiln threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="print where each model's time goes instead")
    parser.add_argument("--roofline", action="store_true",
                        help="measure this machine's sgemm peak and each model's GEMM GFLOP/s against it")
    ns = parser.parse_args(argv)
    ns.models = ns.models or ["test-mlp", "test-resnet18", "test-cnn", "test-gpt2", "test-bert", "gpt2-small"]
    unknown = [m for m in ns.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(sorted(MODELS))}")
    warnings.filterwarnings("ignore")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.profile:
        for name in ns.models:
            total, rows = profile_model(name)
            print(f"\n{name}: {total * 1e3:.2f} ms in plan calls ({torch.get_num_threads()} threads)")
            print("| where | ms | share | calls |\n|---|---|---|---|")
            for category, seconds, calls in rows:
                print(f"| {category} | {seconds * 1e3:.2f} | {seconds / total:.0%} | {calls} |")
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"per-call overhead (3 tiny kernels): {call_overhead_us():.1f} us")
    for label, kiln_us, eager_us in module_call_overhead_us():
        print(f"per-call time of kiln.compile({label}) (whole call, kernels included): {kiln_us:.1f} us; "
              f"eager: {eager_us:.1f} us")
    peak = sgemm_peak() if ns.roofline else None
    if peak is not None:
        print(f"sgemm peak (torch.mm, {torch.get_num_threads()} threads): {peak[0]:.0f} GFLOP/s at {peak[1]}^3")
    extra = " GEMM GFLOP | kiln GFLOP/s | of peak |" if peak else ""
    print("| model | eager ms | kiln-cpu ms | speedup | compile s | memory plan |" + extra)
    print("|---|---|---|---|---|---|" + "---|---|---|" * bool(peak))
    for name in ns.models:
        r = measure_model(name, ns.runs)
        row = (f"| {r['model']} | {r['eager_ms']:.2f} | {r['kiln_ms']:.2f} | {r['speedup']:.2f}x | "
               f"{r['compile_s']:.1f} | {r['memory'].replace('memory plan: ', '')} |")
        if peak:
            rate = r["gemm_gflop"] / (r["kiln_ms"] / 1e3)
            row += f" {r['gemm_gflop']:.2f} | {rate:.0f} | {rate / peak[0]:.0%} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
