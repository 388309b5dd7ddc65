"""One check of kiln on a GPU: correctness, timing against eager and Inductor, a matmul
roofline; a markdown report.  Run it through ``benchmarks/gpu_check.sh`` (which installs
what it needs first) or directly::

    python -m benchmarks.gpu_check --out $OUT/gpu.md            # on a CUDA machine
    python -m benchmarks.gpu_check --dry-run --out /tmp/gpu.md  # CPU: emulation, tiny models

Sections (each written to the report as soon as it is done, so a run cut short keeps what it
measured):

1. **Environment**: torch, CUDA, the GPU, nvcc, Triton, islpy, kiln's commit.
2. **Correctness** against eager, for the kiln backends ``cuda`` and ``triton``: the test
   models of ``tests/models.py`` (MLP, CNN, ResNet-18, GPT-2, BERT) in float32 (pass: max
   error within 1e-4 of the output's scale, ``max|out - ref| / max|ref|``) and with
   ``amp="bf16"`` (pass: within 3e-2), and one GPT-2 training step (``compile_train``,
   SGD with momentum; the loss and the updated parameters, within 1e-3).
3. **Timing**: GPT-2 small and BERT-base (sequence 128) and ResNet-50 (224x224) inference at
   batch 1 and 16, and a GPT-2 small bf16 training step (batch 8, sequence 128), for eager,
   Inductor (``torch.compile`` default and ``mode="max-autotune-no-cudagraphs"``) and the
   kiln backends.  Systems are timed interleaved (rounds rotate the order; a turn is one
   untimed call, then a block of calls and one synchronization); the median of the rounds'
   per-call times is reported, with speedups against eager and Inductor.
4. **Matmul roofline**: the kiln backends' generated matmul kernels against cuBLAS
   (``torch.matmul``) in TFLOP/s and as a fraction of the H200's dense peak (bf16 989,
   float32 67 TFLOP/s).

Every system's failure -- a build error, a wrong answer, a time-out -- is a row of the
report, never the end of the run.  A global deadline (``--budget-s``) bounds the run: a
build gets what is left minus a reserve, and work that no longer fits is reported as
skipped.  ``--dry-run`` runs the same code on the CPU with tiny models, the ``cuda`` backend
emulated, the ``triton`` backend interpreted and Inductor left out.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import kiln
from kiln.tuning.measure import best_time

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = {"bfloat16": 989.0, "float32": 67.0}
"""H200 SXM dense peak: bf16 tensor cores, float32 without tensor cores."""
KILN = ("kiln-cuda", "kiln-triton")
SYSTEMS = ("eager", "inductor", "inductor-max-autotune", *KILN)
FP32_TOL, BF16_TOL = 1e-4, 3e-2


# ------------------------------------------------------------------ run state
@dataclass
class Check:
    """The run's settings, clock and report."""

    dry_run: bool
    out: Path
    budget_s: float
    systems: tuple[str, ...] = SYSTEMS
    only: tuple[str, ...] = ()
    """Names of the models, workloads and checks to run (empty: all)."""
    start: float = field(default_factory=time.monotonic)
    sections: dict[str, list[str]] = field(default_factory=dict)

    def wants(self, name: str) -> bool:
        return not self.only or name in self.only

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def section(self, title: str, lines: list[str]) -> None:
        """Set (or replace) the section ``title`` and rewrite the report."""
        self.sections[title] = lines
        self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        mode = " (dry run: CPU, emulated cuda backend, tiny models)" if self.dry_run else ""
        text = [f"# kiln GPU check{mode}", "", f"Written {datetime.datetime.now().isoformat(timespec='seconds')}, "
                f"{time.monotonic() - self.start:.0f} s into the run.", ""]
        for title, lines in self.sections.items():
            text += [f"## {title}", "", *lines, ""]
        self.out.write_text("\n".join(text))


class TimeLimit(Exception):
    """A build or run went past its share of the budget."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TimeLimit` in the main thread after ``seconds`` (no limit off it)."""
    if seconds <= 0:
        raise TimeLimit("no time left in the budget")
    if os.name != "posix" or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeLimit(f"over its {seconds:.0f} s share of the budget")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def error_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}".replace("|", "/")


def sync(device: str) -> None:
    torch.cuda.synchronize() if device == "cuda" else None


# ------------------------------------------------------------------ comparing
def leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def rel_error(got: Any, want: Any) -> float:
    """``max |got - want| / max |want|`` over the float outputs (inf: shapes differ)."""
    g, w = leaves(got), leaves(want)
    if len(g) != len(w) or any(a.shape != b.shape for a, b in zip(g, w)):
        return float("inf")
    err = max(((a.float() - b.float()).abs().max().item() for a, b in zip(g, w)), default=0.0)
    scale = max((b.float().abs().max().item() for b in w), default=0.0)
    return err / max(scale, 1e-30)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


# ------------------------------------------------------------------ systems
def kiln_options(check: Check, system: str) -> dict[str, Any]:
    if system == "kiln-cuda":
        return {"backend": "cuda", **({"emulate": True} if check.dry_run else {})}
    return {"backend": "triton"}


def kiln_info(compiled: Any) -> str:
    """Kernels, kinds and fallbacks of a kiln build (what its executable reports)."""
    exe = getattr(compiled, "executable", None) or getattr(compiled, "_executable", None)
    info = getattr(exe, "info", None) or {}
    parts = []
    if "gpu_kernels" in info:
        parts.append(f"{info['gpu_kernels']} GPU kernels " + ", ".join(f"{k} {v}" for k, v in info["kinds"].items()))
    elif "kernels" in info:
        parts.append(f"{info['kernels']} kernels")
    if info.get("fallbacks"):
        parts.append(f"{len(info['fallbacks'])} fallbacks ({next(iter(info['fallbacks'].values()))[:60]})")
    if info.get("library_calls"):
        parts.append(f"{info['library_calls']} library calls")
    return "; ".join(parts).replace("|", "/") or "-"


def build_inference(check: Check, system: str, model: nn.Module, args: tuple, kwargs: dict,
                    amp: str | None = None) -> Callable[[], Any]:
    """A zero-argument call of ``model`` on its inputs through ``system``."""
    if system in KILN:
        options = kiln_options(check, system)
        compiled = kiln.compile(model, args, example_kwargs=kwargs, amp=amp, **options)
        call = lambda: compiled(*args, **kwargs)  # noqa: E731
        call.info = kiln_info(compiled)  # type: ignore[attr-defined]
        return call
    if system == "eager":
        target = model
    else:
        mode = "max-autotune-no-cudagraphs" if system == "inductor-max-autotune" else None
        target = torch.compile(model, mode=mode, dynamic=False)

    def call() -> Any:
        if amp is None:
            return target(*args, **kwargs)
        with torch.autocast(check.device, dtype=torch.bfloat16):
            return target(*args, **kwargs)
    return call


def interleaved(calls: dict[str, Callable[[], Any]], device: str, *, rounds: int = 3,
                turn_s: float = 0.25) -> dict[str, float]:
    """Median seconds per call of each system, timed interleaved (module docstring).  Every
    measurement is :func:`~kiln.tuning.measure.best_time` of one turn: a block of calls
    and one synchronization."""
    def turn(fn: Callable[[], Any], calls_per_turn: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls_per_turn):
                fn()
            sync(device)
        return run

    block = {name: max(1, min(50, int(turn_s / max(best_time(turn(fn, 1), repeat=1, warmup=0), 1e-6))))
             for name, fn in calls.items()}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            turn(calls[name], 1)()  # one untimed call first
            samples[name].append(best_time(turn(calls[name], block[name]), repeat=1, warmup=0) / block[name])
    return {name: statistics.median(s) for name, s in samples.items()}


class Stopwatch:
    """Wall seconds since it was made, for a build's duration in a report row (a single
    measurement; repeated timings go through :func:`interleaved`)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def elapsed(self) -> str:
        return fmt(time.perf_counter() - self._start)


def systems_for(check: Check) -> list[str]:
    """The timed systems: eager always (the reference), Inductor not in a dry run."""
    return [s for s in SYSTEMS if (s == "eager" or s in check.systems)
            and not (check.dry_run and s.startswith("inductor"))]


def kiln_systems(check: Check) -> list[str]:
    return [s for s in KILN if s in check.systems]


def build_share(check: Check, system: str, reserve: float = 60.0) -> float:
    """Seconds a build may take: what is left minus a reserve, at most 150 s; max-autotune
    (minutes of GEMM autotuning) at most 60 s, and only while more than 200 s are left."""
    if system == "inductor-max-autotune":
        return min(60.0, check.left() - reserve) if check.left() > 200 else 0.0
    return min(150.0, check.left() - reserve)


# ------------------------------------------------------------------ models
def check_models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    """The test models of ``tests/models.py``."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from models import MODELS  # tests/models.py: the test models

    return {name: MODELS[name] for name in ("mlp", "cnn", "resnet18", "gpt2", "bert")}


def to_device(x: Any, device: str) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


class Logits(nn.Module):
    """A causal LM returning only its logits (what a loss reads), its dropout off (so every
    system computes the same step)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        for m in lm.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt2(dry: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = (GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False)
              if dry else GPT2Config(use_cache=False))
    return GPT2LMHeadModel(config).eval()


def bert(dry: bool) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = (BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                         vocab_size=512) if dry else BertConfig())
    return BertModel(config).eval()


def resnet50(dry: bool) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = (ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10)
              if dry else ResNetConfig())
    return ResNetForImageClassification(config).eval()


def workloads(dry: bool) -> list[tuple[str, str, Callable[[], nn.Module], Callable[[], tuple[tuple, dict]]]]:
    """``(name, label, build, inputs)`` of every inference workload, batch 1 first."""
    seq, image, batches = (16, 32, (1, 2)) if dry else (128, 224, (1, 16))
    g = torch.Generator().manual_seed(1)
    out = []
    for batch in batches:
        ids = torch.randint(0, 512, (batch, seq), generator=g)
        out.append(("gpt2-small", f"gpt2-small b{batch}", lambda d=dry: gpt2(d), lambda ids=ids: ((ids,), {})))
        out.append(("bert-base", f"bert-base b{batch}", lambda d=dry: bert(d),
                    lambda ids=ids: ((ids,), {"attention_mask": torch.ones_like(ids)})))
        pixels = torch.randn(batch, 3, image, image, generator=g)
        out.append(("resnet50", f"resnet50 b{batch}", lambda d=dry: resnet50(d), lambda p=pixels: ((p,), {})))
    return out


# ------------------------------------------------------------------ sections
def environment(check: Check) -> None:
    from kiln.backends.cuda.toolchain import find_nvcc

    nvcc = find_nvcc()
    version = "-"
    if nvcc:
        run = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
        version = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "?"
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or "-"
    except OSError:
        commit = "-"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    triton = importlib.util.find_spec("triton")
    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("CUDA (torch)", torch.version.cuda or "-"), ("GPU", gpu), ("nvcc", f"{nvcc or 'not found'} {version}"),
            ("triton", __import__("triton").__version__ if triton else "not installed"),
            ("islpy", "importable" if importlib.util.find_spec("islpy") else "missing (no isl proofs at build time)"),
            ("kiln commit", commit), ("budget", f"{check.budget_s:.0f} s")]
    check.section("Environment", table(("what", "value"), rows))


def correctness(check: Check) -> None:
    rows = []
    for name, (build, inputs) in check_models().items():
        if not check.wants(name) or (check.dry_run and name not in ("mlp", "gpt2")):
            continue
        model = build().to(check.device)
        args, kwargs = to_device(inputs(), check.device)
        with torch.no_grad():
            want = model(*args, **kwargs)
        for precision, amp, tol in (("fp32", None, FP32_TOL), ("bf16", "bf16", BF16_TOL)):
            for system in kiln_systems(check):
                rows.append((name, precision, system, *_checked(check, system, model, args, kwargs, want, amp, tol)))
                check.section("Correctness against eager", _correctness_table(rows))
    if check.wants("gpt2-train"):
        rows += training_check(check)
    check.section("Correctness against eager", _correctness_table(rows))


def _correctness_table(rows: list) -> list[str]:
    return ["float32 passes within 1e-4 and bf16 (`amp=\"bf16\"`, against float32 eager) within 3e-2 of the "
            "output's scale (`max|out - ref| / max|ref|`).", "",
            *table(("model", "precision", "system", "status", "max rel. error", "build s", "kernels"), rows)]


def _checked(check: Check, system: str, model: nn.Module, args: tuple, kwargs: dict, want: Any, amp: str | None,
             tol: float) -> tuple:
    watch = Stopwatch()
    try:
        with time_limit(min(60.0, check.left() - 30)):
            call = build_inference(check, system, model, args, kwargs, amp)
            with torch.no_grad():
                got = call()
            sync(check.device)
    except Exception as e:  # noqa: BLE001 - every failure is a row
        return ("error", "-", watch.elapsed(), error_line(e))
    err = rel_error(got, want)
    return ("pass" if err <= tol else "FAIL", fmt(err), watch.elapsed(), call.info)


def training_check(check: Check) -> list[tuple]:
    """One SGD step of the test GPT-2 through each kiln backend against eager (SGD: Adam's
    first step divides gradients by their magnitude, which amplifies float noise in the
    near-zero gradients of GPT-2's key biases into visible differences)."""
    build, inputs = check_models()["gpt2"]
    (ids,), _ = inputs()
    ids = ids.to(check.device)
    labels = torch.roll(ids, -1, dims=1)
    base = Logits(build()).train().to(check.device)
    eager = copy.deepcopy(base)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    loss = lm_loss(eager(ids), labels)
    loss.backward()
    opt.step()
    rows = []
    for system in kiln_systems(check):
        model = copy.deepcopy(base)
        watch = Stopwatch()
        try:
            with time_limit(min(180.0, check.left() - 30)):
                step = kiln.compile_train(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          (ids, labels), **kiln_options(check, system))
                got = step(ids, labels)
                sync(check.device)
        except Exception as e:  # noqa: BLE001
            rows.append(("gpt2 train step", "fp32", system, "error", "-", watch.elapsed(),
                         error_line(e)))
            continue
        err = max(rel_error(got, loss.detach()),
                  max(rel_error(a, b) for a, b in zip(model.parameters(), eager.parameters())))
        rows.append(("gpt2 train step", "fp32", system, "pass" if err <= 1e-3 else "FAIL", fmt(err),
                     watch.elapsed(), kiln_info(step)))
    return rows


def timing(check: Check) -> None:
    rows: list[tuple] = []
    for name, label, build, inputs in workloads(check.dry_run):
        if not check.wants(name) or (check.dry_run and not label.endswith("b1")):
            continue
        if check.left() < 45:
            rows.append((label, "all", "skipped: out of time", "-", "-", "-", "-", "-", "-"))
            continue
        model = build().to(check.device)
        args, kwargs = to_device(inputs(), check.device)
        with torch.no_grad():
            rows += _time_workload(check, label, lambda s: build_inference(check, s, model, args, kwargs))
        check.section("Timing", _timing_table(rows))
    if check.wants("gpt2-small-train"):
        rows += training_timing(check)
    check.section("Timing", _timing_table(rows))


def _timing_table(rows: list) -> list[str]:
    return ["Median per-call time of interleaved rounds (inference under `torch.no_grad()`); speedups are "
            "eager / system and inductor / system.", "",
            *table(("workload", "system", "status", "ms", "vs eager", "vs inductor", "max rel. error", "build s",
                    "kernels"), rows)]


def _time_workload(check: Check, label: str, make: Callable[[str], Callable[[], Any]]) -> list[tuple]:
    calls: dict[str, Callable[[], Any]] = {}
    status: dict[str, tuple] = {}
    want = None
    for system in systems_for(check):
        watch = Stopwatch()
        try:
            with time_limit(build_share(check, system)):
                call = make(system)
                got = call()
                sync(check.device)
        except Exception as e:  # noqa: BLE001 - every failure is a row
            status[system] = ("error" if not isinstance(e, TimeLimit) else "skipped", error_line(e),
                              watch.elapsed())
            continue
        want = got if system == "eager" else want
        err = rel_error(got, want) if want is not None else None
        ok = err is None or err <= (BF16_TOL if "train" in label else 1e-3)
        status[system] = ("ok" if ok else "WRONG", fmt(err), watch.elapsed(), getattr(call, "info", "-"))
        calls[system] = call
    times = interleaved(calls, check.device) if calls else {}
    rows = []
    for system in systems_for(check):
        s = status[system]
        t = times.get(system)
        base = {k: times.get(k) for k in ("eager", "inductor")}
        speed = [fmt(base[k] / t) if t and base[k] else "-" for k in ("eager", "inductor")]
        rows.append((label, system, s[0], fmt(t * 1e3) if t else "-", *speed, s[1], s[2], s[3] if len(s) > 3 else "-"))
    return rows


def training_timing(check: Check) -> list[tuple]:
    """A GPT-2 small bf16 training step (AdamW, float32 master weights) per system."""
    if check.left() < 60:
        return [("gpt2-small train bf16", "all", "skipped: out of time", "-", "-", "-", "-", "-", "-")]
    batch, seq = (2, 16) if check.dry_run else (8, 128)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (batch, seq), generator=g).to(check.device)
    labels = torch.roll(ids, -1, dims=1)
    base = Logits(gpt2(check.dry_run)).train().to(check.device)

    def make(system: str) -> Callable[[], Any]:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if system in KILN:
            step = kiln.compile_train(model, lm_loss, opt, (ids, labels), amp="bfloat16", **kiln_options(check, system))
            call = lambda: step(ids, labels)  # noqa: E731
            call.info = kiln_info(step)  # type: ignore[attr-defined]
            return call
        target = model if system == "eager" else torch.compile(
            model, dynamic=False, mode="max-autotune-no-cudagraphs" if system.endswith("autotune") else None)

        def step_eager() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(check.device, dtype=torch.bfloat16):
                loss = lm_loss(target(ids), labels)
            loss.backward()
            opt.step()
            return loss.detach().float()
        return step_eager
    return _time_workload(check, f"gpt2-small train bf16 b{batch}", make)


def roofline(check: Check) -> None:
    sizes = (64,) if check.dry_run else (1024, 4096)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            if check.left() < 20:
                rows.append((f"{n}^3", str(dtype).split(".")[1], "-", "skipped: out of time", "-", "-", "-", "-"))
                continue
            g = torch.Generator().manual_seed(n)
            a = torch.randn(n, n, generator=g).to(check.device, dtype)
            b = torch.randn(n, n, generator=g).to(check.device, dtype)
            library = "torch" if check.dry_run else "cuBLAS"
            calls: dict[str, Callable[[], Any]] = {library: lambda: a @ b}
            notes, wrong = {}, set()
            for system in kiln_systems(check):
                try:
                    with time_limit(min(120.0, check.left() - 15)):
                        compiled = kiln.compile(_Matmul(), (a, b), **kiln_options(check, system))
                        err = rel_error(compiled(a, b), a.float() @ b.float())
                    calls[system] = lambda c=compiled: c(a, b)
                    notes[system] = f"error {fmt(err)}; {kiln_info(compiled)}"
                    if err > (BF16_TOL if dtype == torch.bfloat16 else 1e-4):
                        wrong.add(system)
                except Exception as e:  # noqa: BLE001
                    notes[system] = error_line(e)
            times = interleaved(calls, check.device)
            peak = PEAK_TFLOPS["bfloat16" if dtype == torch.bfloat16 else "float32"]
            for system in (library, *kiln_systems(check)):
                t = times.get(system)
                tflops = 2 * n**3 / t / 1e12 if t else None
                ref = times.get(library)
                rows.append((f"{n}^3", str(dtype).split(".")[1], system,
                             "WRONG" if system in wrong else "ok" if t else "error",
                             fmt(tflops), fmt(ref / t) if t and ref else "-",
                             f"{100 * tflops / peak:.1f}%" if tflops else "-", notes.get(system, "-")))
            check.section("Matmul roofline", _roofline_table(rows))
    check.section("Matmul roofline", _roofline_table(rows))


def _roofline_table(rows: list) -> list[str]:
    return [f"`C = A @ B`, square; peak: bf16 {PEAK_TFLOPS['bfloat16']:.0f}, float32 {PEAK_TFLOPS['float32']:.0f} "
            "TFLOP/s (H200 SXM, dense).", "",
            *table(("size", "dtype", "system", "status", "TFLOP/s", "vs cuBLAS", "of peak", "notes"), rows)]


class _Matmul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return a @ b


# ------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, emulated cuda backend, tiny models")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu.md"), help="report path")
    parser.add_argument("--budget-s", type=float, default=None, help="deadline of the run (default 440, dry 240)")
    parser.add_argument("--sections", default="environment,correctness,timing,roofline",
                        help="comma list of sections to run")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of systems (eager always runs)")
    parser.add_argument("--only", default="", help="comma list of models/workloads to run: mlp, cnn, resnet18, "
                        "gpt2, bert, gpt2-train, gpt2-small, bert-base, resnet50, gpt2-small-train (default: all)")
    args = parser.parse_args(argv)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    check = Check(args.dry_run, Path(args.out), args.budget_s or (240.0 if args.dry_run else 440.0), systems, only)
    if not args.dry_run and not torch.cuda.is_available():
        check.section("Environment", ["No CUDA device: nothing to check (use --dry-run on a CPU machine)."])
        return 1
    os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for every system
    runners = {"environment": environment, "correctness": correctness, "timing": timing, "roofline": roofline}
    for name in args.sections.split(","):
        try:
            runners[name.strip()](check)
        except Exception as e:  # noqa: BLE001 - a broken section is reported, the others still run
            check.section(f"{name} (failed)", [error_line(e)])
    print(f"gpu_check: report written to {check.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
