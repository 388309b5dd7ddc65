"""Measure the cpu backend against PyTorch eager: ``python -m kiln.tuning.measure``.

Prints, per model, eager and kiln-cpu latency (median of interleaved runs, so machine load
hits both alike), the speedup, the compile time, the planned arena beside the sum of the
intermediates, and the per-call overhead of an executable whose kernels do almost nothing.
Not a test: numbers depend on the machine.

    python -m kiln.tuning.measure                 # test models and GPT-2 small seq 128
    python -m kiln.tuning.measure gpt2-small bert-base --runs 20 --threads 1
    python -m kiln.tuning.measure gpt2-small --profile   # where the time goes
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


def _resnet18_224() -> tuple[torch.nn.Module, tuple, dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from models import resnet18

    return resnet18(1000), (torch.randn(1, 3, 224, 224),), {}


def _mlp_batch() -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10)).eval()
    return model, (torch.randn(32, 784),), {}


def _test_model(name: str) -> Callable[[], tuple[torch.nn.Module, tuple, dict]]:
    def make() -> tuple[torch.nn.Module, tuple, dict]:
        sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
        from models import MODELS

        builder, inputs = MODELS[name]
        args, kwargs = inputs()
        return builder(), args, kwargs
    return make


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple, dict]]] = {
    "gpt2-small": _gpt2_small, "bert-base": _bert_base, "resnet18-224": _resnet18_224, "mlp-784": _mlp_batch,
    **{f"test-{n}": _test_model(n) for n in ("mlp", "resnet18", "cnn", "gpt2", "bert")},
}


def _interleaved(a: Callable[[], Any], b: Callable[[], Any], runs: int) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b`` run alternately ``runs`` times each (after warm-up)."""
    for _ in range(2):
        a()
        b()
    ta, tb = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)


def measure_model(name: str, runs: int) -> dict[str, Any]:
    import kiln

    model, args, kwargs = MODELS[name]()
    t0 = time.perf_counter()
    compiled = kiln.compile(model, args, backend="cpu", example_kwargs=kwargs)
    compile_s = time.perf_counter() - t0
    with torch.no_grad():
        eager_s, kiln_s = _interleaved(lambda: model(*args, **kwargs), lambda: compiled(*args, **kwargs), runs)
    info = getattr(compiled.executable, "info", {})
    return {"model": name, "eager_ms": eager_s * 1e3, "kiln_ms": kiln_s * 1e3, "speedup": eager_s / kiln_s,
            "compile_s": compile_s, "memory": info.get("memory", "")}


def call_overhead_us(repeats: int = 20000) -> float:
    """Per-call time of an executable with 2 inputs, 3 tiny kernels and 1 output (microseconds)."""
    import kiln.ir as ir
    from kiln.backends import get_backend
    from kiln.passes import default_pipeline

    graph = default_pipeline().run(ir.parse("""
graph @tiny(%x: f32[4], %y: f32[4]) {
  %0: f32[4] = add(%x, %y)
  %1: f32[] = sum(%0)
  %2: f32[4] = mul(%0, %1)
  %3: f32[4] = exp(%2)
  return %3
}""")).graph
    exe = get_backend("cpu").build(graph)
    args = [torch.randn(4), torch.randn(4)]
    with torch.no_grad():
        for _ in range(100):
            exe(args)
        t0 = time.perf_counter()
        for _ in range(repeats):
            exe(args)
        return (time.perf_counter() - t0) / repeats * 1e6


PROFILE_CATEGORIES = (
    ("GEMM (+ fused epilogue)", lambda step, label: "[gemm" in label),
    ("convolution", lambda step, label: "conv" in label and step == "TorchStep"),
    ("attention (torch SDPA)", lambda step, label: "scaled_dot_product_attention" in label),
    ("normalization kernels", lambda step, label: "norm" in label and step == "NativeRunStep"),
    ("other generated kernels", lambda step, label: step == "NativeRunStep"),
    ("other library calls", lambda step, label: step == "TorchStep"),
    ("copies, packing, views", lambda step, label: step in ("ContiguousStep", "PackStep", "ViewStep")),
    ("releasing buffers", lambda step, label: step == "ReleaseStep"),
)
"""How :func:`profile_model` groups the calls of a plan (first matching category wins)."""


def profile_model(name: str, repeat: int = 5) -> tuple[float, list[tuple[str, float, int]]]:
    """:func:`profile_module` of the model ``name`` of :data:`MODELS`."""
    model, args, kwargs = MODELS[name]()
    return profile_module(model, args, kwargs, repeat)


def profile_module(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, repeat: int = 5
                   ) -> tuple[float, list[tuple[str, float, int]]]:
    """Where one call of ``model`` compiled by kiln spends its time: each kernel gets its own
    native call (``KILN_PROFILE_KERNELS=1``), every call is timed (best of ``repeat``), and
    the times are summed per :data:`PROFILE_CATEGORIES` entry.  Returns the total seconds
    and ``(category, seconds, calls)`` rows, largest first."""
    import os

    import kiln
    from kiln.backends.cpu.backend import PROFILE_ENV_VAR

    kwargs = dict(kwargs or {})
    previous = os.environ.get(PROFILE_ENV_VAR)
    os.environ[PROFILE_ENV_VAR] = "1"
    try:
        compiled = kiln.compile(model, args, backend="cpu", example_kwargs=kwargs)
    finally:
        if previous is None:
            os.environ.pop(PROFILE_ENV_VAR)
        else:
            os.environ[PROFILE_ENV_VAR] = previous
    flat = [*compiled._check(compiled._flatten(args, kwargs)), *compiled.params]
    with torch.no_grad():
        timings = compiled.executable.plan.profile(flat, repeat=repeat)
    totals: dict[str, list[float]] = {}
    for label, seconds in timings:
        step, _, what = label.partition(": ")
        category = next((c for c, test in PROFILE_CATEGORIES if test(step, what)), "other")
        entry = totals.setdefault(category, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    rows = sorted(((c, t, int(n)) for c, (t, n) in totals.items()), key=lambda r: -r[1])
    return sum(t for _, t in timings), rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"models (default: the test models and gpt2-small); one of {', '.join(sorted(MODELS))}")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch and kiln threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="print where each model's time goes instead")
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
    print("| model | eager ms | kiln-cpu ms | speedup | compile s | memory plan |")
    print("|---|---|---|---|---|---|")
    for name in ns.models:
        r = measure_model(name, ns.runs)
        print(f"| {r['model']} | {r['eager_ms']:.2f} | {r['kiln_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['compile_s']:.1f} | {r['memory'].replace('memory plan: ', '')} |", flush=True)


if __name__ == "__main__":
    main()
