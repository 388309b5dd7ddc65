"""The systems kiln is measured against, behind one small protocol.

A :class:`System` turns ``(model, inputs)`` into a :class:`Prepared`: a zero-argument
``run`` callable (one inference call) plus what it cost to get there.  The harness times
``run`` and never needs to know which system it holds.

* ``eager``: the model itself, PyTorch eager mode.
* ``inductor``: ``torch.compile(model, dynamic=False)`` with default settings.
* ``onnxruntime``: ``torch.onnx.export`` (the dynamo-based exporter; the TorchScript exporter
  when that fails) into the run's temporary folder, then an ORT CPU session with
  ``ORT_ENABLE_ALL`` and as many intra-op threads as torch uses.
* ``kiln``: :func:`kiln.compile` with the ``cpu`` backend when it is registered, kiln's
  default backend otherwise.
* ``tvm``: TVM Relax (``from_exported_program``, default build for ``llvm``, untuned), only
  when ``import tvm`` works.

Cold start is the time from nothing to the first output (export/compile + first call).
Warm start is the same with the system's caches filled by the cold start, measured in the
same process: Inductor's FX-graph cache after ``torch._dynamo.reset()``, ORT's session
creation from the already exported file, kiln's compile cache (``kiln.runtime.cache``)
when the second compile hits it.  ``None`` means not applicable.  The harness points
Inductor's and kiln's cache folders at an empty temporary folder, so cold starts are cold.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

Inputs = tuple[torch.Tensor, ...]


@dataclass
class Prepared:
    """A system ready to run one model on fixed inputs.

    ``first_call_s`` is the first call alone when it can be separated from compilation
    (``None`` when compilation happens inside the first call, as with Inductor).
    """

    run: Callable[[], Any]
    cold_start_s: float
    first_output: Any
    first_call_s: float | None = None
    notes: list[str] = field(default_factory=list)


class System:
    """Base class: a ``name``, a human ``label``, availability, ``prepare`` and ``warm_start``."""

    name: str = ""
    label: str = ""

    def unavailable_reason(self) -> str | None:
        """Why this system cannot run here (``None`` when it can)."""
        return None

    def version(self) -> str:
        return ""

    def prepare(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> Prepared:
        """Compile (cold) and run once; ``key`` names the workload, for cached artifacts."""
        raise NotImplementedError

    def warm_start(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> float | None:
        """Seconds from nothing to the first output with caches filled; ``None``: n/a."""
        return None

    def warm_start_note(self) -> str:
        """Why :meth:`warm_start` is n/a, shown in the report."""
        return "no compile step"

    def release(self) -> None:
        """Drop per-workload state (compiled code, caches of compiled functions)."""


def _timed_first_call(run: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    with torch.inference_mode():
        output = run()
    return output, time.perf_counter() - start


# --------------------------------------------------------------------------- eager


class Eager(System):
    name, label = "eager", "PyTorch eager"

    def version(self) -> str:
        return torch.__version__

    def prepare(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> Prepared:
        def run() -> Any:
            return model(*inputs)

        output, first = _timed_first_call(run)
        return Prepared(run, cold_start_s=first, first_output=output, first_call_s=first)


# --------------------------------------------------------------------------- inductor


class Inductor(System):
    name, label = "inductor", "torch.compile (Inductor)"

    def version(self) -> str:
        return torch.__version__

    def prepare(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> Prepared:
        import torch._dynamo

        torch._dynamo.reset()
        start = time.perf_counter()
        compiled = torch.compile(model, backend="inductor", dynamic=False)
        with torch.inference_mode():
            output = compiled(*inputs)
        cold = time.perf_counter() - start
        return Prepared(lambda: compiled(*inputs), cold_start_s=cold, first_output=output)

    def warm_start(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> float | None:
        import torch._dynamo

        torch._dynamo.reset()  # drops the compiled code; Inductor's FX-graph cache stays
        start = time.perf_counter()
        compiled = torch.compile(model, backend="inductor", dynamic=False)
        with torch.inference_mode():
            compiled(*inputs)
        return time.perf_counter() - start

    def release(self) -> None:
        import torch._dynamo

        torch._dynamo.reset()


# --------------------------------------------------------------------------- ONNX Runtime


class OnnxRuntime(System):
    name, label = "onnxruntime", "ONNX Runtime (CPU EP)"

    def unavailable_reason(self) -> str | None:
        missing = [m for m in ("onnxruntime", "onnx", "onnxscript") if importlib.util.find_spec(m) is None]
        if missing:
            return f"not installed: {', '.join(missing)} (pip install 'kiln[bench]')"
        return None

    def version(self) -> str:
        import onnxruntime

        return onnxruntime.__version__

    def prepare(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> Prepared:
        start = time.perf_counter()
        path, notes = self._export(model, inputs, workdir / "onnx" / f"{key}.onnx")
        prepared = self._session_run(path, inputs)
        prepared.cold_start_s = time.perf_counter() - start
        prepared.notes = notes + prepared.notes
        return prepared

    def warm_start(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> float | None:
        path = workdir / "onnx" / f"{key}.onnx"
        if not path.exists():
            return None
        start = time.perf_counter()
        self._session_run(path, inputs)
        return time.perf_counter() - start

    def warm_start_note(self) -> str:
        return "export failed"

    @staticmethod
    def _export(model: nn.Module, inputs: Inputs, path: Path) -> tuple[Path, list[str]]:
        """Export with the dynamo-based exporter, else with the TorchScript one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        names = [f"input{i}" for i in range(len(inputs))]
        try:
            _quietly(lambda: torch.onnx.export(model, inputs, str(path), dynamo=True, input_names=names))
            return path, ["exporter: dynamo"]
        except Exception as error:  # noqa: BLE001 - any exporter failure: try the other exporter
            dynamo_error = _one_line(error)
        _quietly(lambda: torch.onnx.export(model, inputs, str(path), dynamo=False, input_names=names,
                                           opset_version=17))
        return path, [f"exporter: torchscript (dynamo exporter failed: {dynamo_error})"]

    @staticmethod
    def _session_run(path: Path, inputs: Inputs) -> Prepared:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = torch.get_num_threads()
        start = time.perf_counter()
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        feed = {arg.name: tensor.numpy() for arg, tensor in zip(session.get_inputs(), inputs)}
        session_s = time.perf_counter() - start

        def run() -> Any:
            return session.run(None, feed)

        output, first = _timed_first_call(run)
        return Prepared(run, cold_start_s=session_s + first, first_output=output, first_call_s=first)


# --------------------------------------------------------------------------- kiln


def kiln_backend_name(requested: str | None = None) -> str:
    """``requested``, else ``"cpu"`` when that backend is registered, else kiln's default."""
    from kiln.backends import DEFAULT_BACKEND, available_backends

    if requested:
        return requested
    return "cpu" if "cpu" in available_backends() else DEFAULT_BACKEND


class Kiln(System):
    name, label = "kiln", "kiln"

    def __init__(self, backend: str | None = None, name: str = "kiln"):
        self.backend = kiln_backend_name(backend)
        self.name = name
        self.label = f"kiln ({self.backend})"
        self._warm_note = ""
        self._uses_cache = False  # whether the last cold compile looked up the compile cache

    def version(self) -> str:
        import kiln

        return f"{kiln.__version__}, backend {self.backend}"

    def prepare(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> Prepared:
        counters = _kiln_cache_counters()
        before = dict(counters or {})
        compiled, compile_s = self._compile(model, inputs)
        self._uses_cache = counters is not None and counters != before
        notes: list[str] = []
        output, first = _timed_first_call(lambda: compiled(*inputs))
        stats = compiled.stats
        fallback = stats.get("fallback_ops") or {}
        if fallback:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(fallback.items()))
            notes.append(f"{stats.get('torch_nodes', 0)} node(s) ran in PyTorch: {ops}")
        notes.append(f"compile {compile_s:.2f} s, {stats['graphs']} graph(s), {stats['nodes']} nodes")
        return Prepared(lambda: compiled(*inputs), cold_start_s=compile_s + first, first_output=output,
                        first_call_s=first, notes=notes)

    def warm_start(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> float | None:
        counters = _kiln_cache_counters()
        if counters is None:
            self._warm_note = "kiln has no compile cache"
            return None
        if not self._uses_cache:
            self._warm_note = f"backend '{self.backend}' does not use the compile cache"
            return None
        hits_before = counters.get("hits", 0)
        start = time.perf_counter()
        compiled, _ = self._compile(model, inputs)
        with torch.inference_mode():
            compiled(*inputs)
        elapsed = time.perf_counter() - start
        if counters.get("hits", 0) == hits_before:
            self._warm_note = f"the second compile had no compile-cache hits (backend '{self.backend}')"
            return None
        return elapsed

    def warm_start_note(self) -> str:
        return self._warm_note

    def _compile(self, model: nn.Module, inputs: Inputs) -> tuple[Any, float]:
        import kiln

        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fallback to PyTorch is reported from the stats instead
            compiled = kiln.compile(model, inputs, backend=self.backend)
        return compiled, time.perf_counter() - start


def _kiln_cache_counters() -> dict[str, int] | None:
    """kiln's process-wide compile-cache counters, ``None`` when kiln has no compile cache."""
    if importlib.util.find_spec("kiln.runtime.cache") is None:
        return None
    counters = getattr(importlib.import_module("kiln.runtime.cache"), "COUNTERS", None)
    return counters if isinstance(counters, dict) else None


# --------------------------------------------------------------------------- TVM


class Tvm(System):
    name, label = "tvm", "TVM Relax (llvm, untuned)"

    def unavailable_reason(self) -> str | None:
        try:
            importlib.import_module("tvm")
        except Exception as error:  # noqa: BLE001 - a broken install is as absent as a missing one
            return f"`import tvm` failed ({_one_line(error)}); install apache-tvm to include TVM Relax"
        return None

    def version(self) -> str:
        import tvm

        return str(getattr(tvm, "__version__", "?"))

    def prepare(self, model: nn.Module, inputs: Inputs, workdir: Path, key: str) -> Prepared:
        import tvm
        from tvm import relax
        from tvm.relax.frontend.torch import from_exported_program

        start = time.perf_counter()
        with torch.no_grad():
            program = torch.export.export(model, inputs)
        module = from_exported_program(program)
        build = getattr(tvm, "compile", None) or relax.build
        executable = build(module, target="llvm")
        machine = relax.VirtualMachine(executable, tvm.cpu())
        make_array = getattr(getattr(tvm, "runtime", None), "tensor", None) or tvm.nd.array
        arguments = [make_array(t.numpy()) for t in inputs]
        main = machine["main"]

        def run() -> Any:
            return main(*arguments)

        output, first = _timed_first_call(run)
        return Prepared(run, cold_start_s=time.perf_counter() - start, first_output=output,
                        first_call_s=first, notes=["untuned: default schedules, no MetaSchedule"])

    def warm_start_note(self) -> str:
        return "no in-process compile cache"


# --------------------------------------------------------------------------- selection

SYSTEM_NAMES = ("eager", "inductor", "onnxruntime", "kiln", "kiln-tvm", "tvm")
"""``kiln-tvm`` is kiln with its ``tvm`` backend (kiln's kernels built by TVM), beside ``tvm``,
TVM's own Relax pipeline."""


def make_systems(names: list[str] | None = None, *, kiln_backend: str | None = None) -> list[System]:
    """The systems named (default: all), in the canonical order."""
    unknown = sorted(set(names or ()) - set(SYSTEM_NAMES))
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEM_NAMES)}")
    factories: dict[str, Callable[[], System]] = {
        "eager": Eager, "inductor": Inductor, "onnxruntime": OnnxRuntime,
        "kiln": lambda: Kiln(kiln_backend), "kiln-tvm": lambda: Kiln("tvm", "kiln-tvm"), "tvm": Tvm,
    }
    return [factories[name]() for name in SYSTEM_NAMES if not names or name in names]


# --------------------------------------------------------------------------- outputs


def first_array(output: Any) -> np.ndarray:
    """The first tensor of a system's output as a float64 numpy array (for error checks).

    Unwraps tuples and lists (ORT), mappings (Hugging Face ``ModelOutput``) and indexable
    containers (TVM arrays) down to a torch tensor, numpy array or object with ``.numpy()``.
    """
    for _ in range(8):  # a bound, so that odd outputs (strings) end in an error, not a loop
        if isinstance(output, (torch.Tensor, np.ndarray)) or hasattr(output, "numpy"):
            break
        if isinstance(output, Mapping):
            output = next(iter(output.values()))
        elif hasattr(output, "__getitem__") and hasattr(output, "__len__"):
            output = output[0]
        else:
            break
    if isinstance(output, torch.Tensor):
        return output.detach().double().numpy()
    if hasattr(output, "numpy"):
        return np.asarray(output.numpy(), dtype=np.float64)
    return np.asarray(output, dtype=np.float64)


def relative_error(output: Any, reference: np.ndarray) -> float:
    """``max |out - ref| / max |ref|`` over the first output tensor (inf on a shape mismatch)."""
    got = first_array(output)
    if got.shape != reference.shape:
        return float("inf")
    scale = max(float(np.max(np.abs(reference))), 1e-12) if reference.size else 1.0
    return float(np.max(np.abs(got - reference))) / scale if reference.size else 0.0


def _one_line(error: BaseException, limit: int = 200) -> str:
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}".strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _quietly(action: Callable[[], Any]) -> Any:
    """Run ``action`` with its stdout, stderr, warnings and torch.onnx log lines swallowed
    (the exporters are chatty)."""
    onnx_log = logging.getLogger("torch.onnx")
    level = onnx_log.level
    onnx_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return action()
    finally:
        onnx_log.setLevel(level)


def describe_error(error: BaseException) -> str:
    """A one-line reason for a failed system, shown in the report."""
    return _one_line(error, limit=300)
