"""The variable-length serving benchmark: ``python -m benchmarks --dynamic``.

A stream of requests, each one sequence of a length drawn (seeded) between ``min_len`` and
``max_len``, goes through each system (batch 1).  Reported per system and model:

* ``compiles``: how often the system compiled (kiln's backend invocations under
  ``torch.compile``, kiln builds, Inductor graph compilations, ONNX exports);
* ``cold s``: the wall time of the first pass over the stream, compiles included, run
  system by system from a fresh start (what a server sees);
* ``steady ms``: per-request latency once everything is compiled: every request of the
  stream again, systems interleaved request by request (each turn timed with
  :func:`kiln.runtime.timing.best_time`), the median over the stream and its total;
* ``max rel err`` of the outputs against eager over the stream.

Systems:

* ``eager``: the model as it is.
* ``kiln-dynamic``: ``kiln.compile(model, (ids,), dynamic_shapes=...)`` with the sequence
  axis a ``Dim("seq", min=min_len, max=max_len)``: one compile for the whole stream.
* ``kiln-torch-compile``: ``torch.compile(model, backend="kiln")`` (``dynamic=None``: Dynamo
  compiles the first length statically, then one dynamic graph).
* ``kiln-static``: ``kiln.compile`` once per distinct length (a static build each).
* ``inductor`` / ``inductor-dynamic``: ``torch.compile`` with ``dynamic=None`` / ``True``.
* ``onnxruntime``: one ONNX export with a dynamic sequence axis, one session.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.runtime.timing import best_time

DYNAMIC_SYSTEMS = ("eager", "kiln-dynamic", "kiln-torch-compile", "kiln-static", "inductor", "inductor-dynamic",
                   "onnxruntime")


@dataclass
class StreamConfig:
    models: Sequence[str] = ("gpt2", "bert")
    systems: Sequence[str] = DYNAMIC_SYSTEMS
    requests: int = 64
    min_len: int = 16
    max_len: int = 512
    layers: int | None = None  # None: the full 12-layer models
    seed: int = 0
    out: Path = Path("benchmarks/results/dynamic")


@dataclass
class SystemResult:
    system: str
    model: str
    compiles: int = 0
    cold_s: float = 0.0
    steady_ms: list[float] = field(default_factory=list)
    max_rel_err: float = 0.0
    error: str | None = None

    @property
    def steady_median_ms(self) -> float:
        return statistics.median(self.steady_ms) if self.steady_ms else math.nan

    @property
    def steady_total_s(self) -> float:
        return sum(self.steady_ms) / 1e3 if self.steady_ms else math.nan


class TokenModel(nn.Module):
    """``forward(ids)`` -> the last hidden state: one named argument, so every exporter takes
    the same ``dynamic_shapes``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).last_hidden_state


def build_model(name: str, layers: int | None) -> nn.Module:
    """GPT-2 small or BERT-base with random weights (``layers`` overrides the depth)."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(use_cache=False, **({"n_layer": layers} if layers else {}))
        return TokenModel(GPT2Model(config)).eval()
    if name == "bert":
        from transformers import BertConfig, BertModel

        config = BertConfig(**({"num_hidden_layers": layers} if layers else {}))
        return TokenModel(BertModel(config, add_pooling_layer=False)).eval()
    raise ValueError(f"unknown model {name!r} for the dynamic benchmark; known: gpt2, bert")


def request_stream(config: StreamConfig) -> list[int]:
    rng = random.Random(config.seed)
    return [rng.randint(config.min_len, config.max_len) for _ in range(config.requests)]


def _ids(length: int, vocab: int = 30522) -> torch.Tensor:
    g = torch.Generator().manual_seed(length)
    return torch.randint(0, vocab, (1, length), generator=g)


class _Counting:
    """A torch.compile backend that counts its invocations before handing over."""

    def __init__(self, inner: Callable):
        self.inner = inner
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.calls += 1
        return self.inner(gm, example_inputs)


def make_runner(system: str, model: nn.Module, config: StreamConfig) -> tuple[Callable[[torch.Tensor], Any],
                                                                              Callable[[], int]]:
    """``(run(ids) -> output, compiles())`` of ``system`` on ``model``."""
    import kiln

    if system == "eager":
        return model, lambda: 0
    if system == "kiln-dynamic":
        state: dict[str, Any] = {}

        def run_dynamic(ids: torch.Tensor) -> Any:
            if "fn" not in state:
                seq = torch.export.Dim("seq", min=config.min_len, max=config.max_len)
                state["fn"] = kiln.compile(model, (ids,), dynamic_shapes=({1: seq},), cache=False)
            return state["fn"](ids)
        return run_dynamic, lambda: int("fn" in state)
    if system == "kiln-static":
        built: dict[int, Any] = {}

        def run_static(ids: torch.Tensor) -> Any:
            fn = built.get(ids.shape[1])
            if fn is None:
                fn = built[ids.shape[1]] = kiln.compile(model, (ids,), cache=False)
            return fn(ids)
        return run_static, lambda: len(built)
    if system in ("kiln-torch-compile", "inductor", "inductor-dynamic"):
        import torch._dynamo as dynamo

        dynamo.reset()
        if system == "kiln-torch-compile":
            from kiln.frontends.torch.dynamo import kiln_backend

            counter = _Counting(lambda gm, ex: kiln_backend(gm, ex, options={"cache": False}))
            dynamic = None
        else:
            from torch._inductor.compile_fx import compile_fx

            counter = _Counting(compile_fx)
            dynamic = True if system == "inductor-dynamic" else None
        compiled = torch.compile(model, backend=counter, dynamic=dynamic)
        return compiled, lambda: counter.calls
    if system == "onnxruntime":
        return _onnx_runner(model, config)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(DYNAMIC_SYSTEMS)}")


def _onnx_runner(model: nn.Module, config: StreamConfig):
    import tempfile

    import onnxruntime as ort

    state: dict[str, Any] = {}

    def run(ids: torch.Tensor) -> Any:
        if "session" not in state:
            path = Path(tempfile.mkdtemp()) / "model.onnx"
            seq = torch.export.Dim("seq", min=config.min_len, max=config.max_len)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(model, (ids,), str(path), dynamo=True, input_names=["ids"],
                                  output_names=["out"], dynamic_shapes=({1: seq},))
            options = ort.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            state["session"] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return torch.from_numpy(state["session"].run(None, {"ids": ids.numpy()})[0])
    return run, lambda: int("session" in state)


def _rel_err(out: Any, ref: torch.Tensor) -> float:
    out = out[0] if isinstance(out, (tuple, list)) else out
    out = torch.as_tensor(out)
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _cold_pass(run: Callable, lengths: Sequence[int], refs: dict[int, torch.Tensor]) -> tuple[float, float]:
    """The stream once through a fresh system, compiles included: its largest relative error
    and its wall time (one pass that cannot be repeated, so one clock reading, not
    :func:`best_time`)."""
    start = time.perf_counter()
    err = 0.0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in lengths:
            err = max(err, _rel_err(run(_ids(n)), refs[n]))
    return err, time.perf_counter() - start


def run_stream(config: StreamConfig, report: Callable[[str], None] = print) -> list[SystemResult]:
    lengths = request_stream(config)
    results: list[SystemResult] = []
    for model_name in config.models:
        model = build_model(model_name, config.layers)
        with torch.no_grad():
            refs = {n: model(_ids(n)) for n in sorted(set(lengths))}
        runners: dict[str, Callable] = {}
        by_system: dict[str, SystemResult] = {}
        for system in config.systems:  # cold pass: one system at a time, compiles included
            result = by_system[system] = SystemResult(system, model_name)
            try:
                run, compiles = make_runner(system, model, config)
                result.max_rel_err, result.cold_s = _cold_pass(run, lengths, refs)
                result.compiles = compiles()
                runners[system] = run
            except Exception as e:  # noqa: BLE001 - a failing system is reported, not fatal
                result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            report(f"{model_name} {system}: cold {result.cold_s:.1f} s, {result.compiles} compiles"
                   + (f", error {result.error}" if result.error else ""))
        with torch.no_grad(), warnings.catch_warnings():  # steady state: interleaved per request
            warnings.simplefilter("ignore")
            for n in lengths:
                ids = _ids(n)
                for system, run in runners.items():
                    by_system[system].steady_ms.append(
                        1e3 * best_time(lambda: run(ids), repeat=3, warmup=0, statistic="median"))
        results.extend(by_system.values())
    return results


def format_table(results: Sequence[SystemResult], config: StreamConfig) -> str:
    head = (f"{config.requests} requests, lengths {config.min_len}..{config.max_len} (seed {config.seed}), "
            f"batch 1, {torch.get_num_threads()} threads"
            + (f", {config.layers} layers" if config.layers else ", full depth"))
    lines = [head, "", "| model | system | compiles | cold total s | steady median ms | steady total s | "
             "max rel err |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.model} | {r.system} | - | - | - | - | failed: {r.error} |")
            continue
        lines.append(f"| {r.model} | {r.system} | {r.compiles} | {r.cold_s:.1f} | {r.steady_median_ms:.1f} | "
                     f"{r.steady_total_s:.2f} | {r.max_rel_err:.1e} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks --dynamic",
                                     description="Variable-length serving: compile counts and total time.")
    parser.add_argument("--dynamic", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--systems", default=",".join(DYNAMIC_SYSTEMS))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None, help="model depth (default: the full models)")
    parser.add_argument("--quick", action="store_true", help="2 layers, 16 requests, lengths 16..128")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dynamic"))
    args = parser.parse_args(argv)
    config = StreamConfig(models=[m for m in args.models.split(",") if m],
                          systems=[s for s in args.systems.split(",") if s], requests=args.requests,
                          min_len=args.min_len, max_len=args.max_len, layers=args.layers, out=args.out)
    if args.quick:
        config.requests, config.max_len, config.layers = 16, 128, config.layers or 2
    unknown = [s for s in config.systems if s not in DYNAMIC_SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(DYNAMIC_SYSTEMS)}")
    results = run_stream(config)
    table = format_table(results, config)
    print(table)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "results.md").write_text(table + "\n")
    (config.out / "results.json").write_text(json.dumps(
        {"config": {**asdict(config), "out": str(config.out)},
         "results": [{**asdict(r), "steady_median_ms": r.steady_median_ms} for r in results]}, indent=1))
    print(f"results: {config.out / 'results.md'}")
    return 0


__all__ = ["DYNAMIC_SYSTEMS", "StreamConfig", "SystemResult", "format_table", "main", "run_stream"]
