"""The zoo sweep: every entry of :mod:`kiln.zoo.models` through kiln, against PyTorch eager.

For each entry, :func:`run_entry` runs these checks (see ``docs/zoo.md``); each is caught on
its own, so one failing check (or model) never stops the others:

* ``capture``: ``kiln.capture`` (export + lowering, strict); its time and node count.
* ``inference``: ``kiln.compile(model, inputs, strict=True)`` in eval mode.
* ``dynamo``: ``torch.compile(model, backend="kiln", options={"strict": True})`` in eval
  mode under ``torch.no_grad()``.
* ``grad``: parameter gradients of ``(out * R).sum()`` over every floating output
  (:func:`kiln.zoo.compare.weighted_loss`) through ``torch.compile(backend="kiln")`` in
  train mode (the zoo's models have no dropout).
* ``train``: three ``kiln.compile_train`` steps with ``AdamW``: the three losses and the
  parameter change of the three steps (final minus initial; the parameters themselves
  would hide an error in the update behind their own size).
* ``fallback``: when strict inference fails, non-strict ``kiln.compile``: which ATen ops run
  in PyTorch, and whether the result is right.

Every comparison is :func:`kiln.zoo.compare.compare`: kiln's float32 result against eager
float64 (``model.double()`` copies), passing within 1e-4 relative or within 10x eager
float32's own error.
"""

from __future__ import annotations

import contextlib
import copy
import math
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from . import compare as cmp
from .models import ZooEntry, select

CHECKS = ("capture", "inference", "dynamo", "grad", "train", "fallback")
TRAIN_STEPS = 3
LEARNING_RATE = 1e-3


@dataclass
class Check:
    """The outcome of one check of one model."""

    status: str
    """``pass``, ``fail`` (ran, wrong numbers), ``error`` (raised) or ``skip``."""
    error: float | None = None
    """The worst relative error against eager float64 (the failing tensor's, if any fails)."""
    eager_error: float | None = None
    """Eager float32's own error on that tensor."""
    worst: str | None = None
    """The tensor with that error (``out.logits``, a parameter name, ``loss.2``)."""
    by_noise: int = 0
    """How many tensors passed only by the float32-noise bound."""
    compared: int = 0
    message: str | None = None
    """The first error line (``Type: message``), or what failed."""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "skip")


@dataclass
class ZooResult:
    """Everything the sweep records for one model."""

    name: str
    family: str
    kind: str
    checks: dict[str, Check] = field(default_factory=dict)
    capture_s: float | None = None
    nodes: int | None = None
    fallback_ops: dict[str, int] | None = None
    seconds: float = 0.0

    @property
    def status(self) -> str:
        """``error`` if a check raised, else ``fail`` if one compared wrong, else ``pass``."""
        states = [c.status for c in self.checks.values()]
        if "error" in states:
            return "error"
        if "fail" in states:
            return "fail"
        return "pass"

    @property
    def first_error(self) -> str | None:
        """``check: message`` of the first check that did not pass."""
        for name, check in self.checks.items():
            if not check.ok:
                return f"{name}: {check.message}"
        return None

    def passed(self, *names: str) -> bool:
        return all(self.checks[n].ok for n in names if n in self.checks)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status
        data["first_error"] = self.first_error
        return data


# ------------------------------------------------------------------ helpers


def error_line(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 400 characters).  A wrapper's cause is
    shown instead of the wrapper (``BackendCompilerFailed <- KilnError: ...``)."""
    prefix = ""
    inner = getattr(error, "inner_exception", None)  # Dynamo's BackendCompilerFailed
    if isinstance(inner, BaseException):
        prefix, error = f"{type(error).__name__} <- ", inner
    text = [t for t in str(error).strip().splitlines() if t.strip()]
    line = f"{prefix}{type(error).__name__}: {text[0].strip() if text else ''}".rstrip(": ")
    return line if len(line) <= 400 else line[:397] + "..."


class ZooTimeout(Exception):
    """A model ran past the sweep's per-model time limit."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`ZooTimeout` after ``seconds`` (main thread only; otherwise no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise ZooTimeout(f"still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def to_double(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    return x


def reset_dynamo() -> None:
    import torch._dynamo

    torch._dynamo.reset()


def judged(comparisons: Sequence[cmp.Comparison], seconds: float, **extra: Any) -> Check:
    """A :class:`Check` from the comparisons of its tensors."""
    if not comparisons:
        return Check("fail", message="nothing to compare (no floating output or gradient)", seconds=seconds)
    worst = cmp.worst(comparisons)
    assert worst is not None
    failed = [c for c in comparisons if not c.ok]
    message = None
    if failed:
        message = (f"{len(failed)}/{len(comparisons)} tensors differ from eager; worst {worst.name}: error "
                   f"{worst.error:.3g} vs float64 (eager float32: {worst.eager_error:.3g}, kiln vs eager float32: "
                   f"{worst.vs_eager:.3g})")
    if not failed:  # report the worst tensor held to 1e-4; the float32-noise ones are counted apart
        plain = [c for c in comparisons if not c.by_float32_noise]
        worst = max(plain, key=lambda c: c.error) if plain else worst
    return Check("fail" if failed else "pass", worst.error, worst.eager_error, worst.name,
                 sum(c.by_float32_noise for c in comparisons), len(comparisons), message, seconds, dict(extra))


class WeightedLoss(nn.Module):
    """``(out * R).sum()`` over every floating output of the model (R: fixed, random)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        super().__init__()
        self.names = list(weights)
        for i, name in enumerate(self.names):
            self.register_buffer(f"weight{i}", weights[name].to(torch.float32))

    def forward(self, output: Any) -> torch.Tensor:
        outputs = cmp.flatten_outputs(output)
        weights = {name: getattr(self, f"weight{i}") for i, name in enumerate(self.names)}
        missing = [n for n in self.names if n not in outputs]
        if missing:
            raise ValueError(f"the model output has no {missing}")
        return cmp.weighted_loss({n: outputs[n] for n in self.names}, weights)


# ------------------------------------------------------------------ eager references


@dataclass
class Reference:
    """Eager results in float32 and float64 for one model."""

    outputs32: dict[str, torch.Tensor]
    outputs64: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


def eval_outputs(model: nn.Module, inputs: Sequence[Any]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {k: v.detach().clone() for k, v in cmp.flatten_outputs(model.eval()(*inputs)).items()}


def grads_eager(model: nn.Module, inputs: Sequence[Any], loss_fn: WeightedLoss) -> dict[str, torch.Tensor]:
    """Parameter gradients (and ``loss``) of one train-mode eager step."""
    model.train()
    loss = loss_fn(model(*inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["loss"] = loss.detach().clone()
    return grads


def train_eager(model: nn.Module, inputs: Sequence[Any], loss_fn: WeightedLoss,
                steps: int = TRAIN_STEPS) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """``steps`` eager AdamW steps: the losses and each parameter's change."""
    model.train()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(*inputs))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses, {n: p.detach() - start[n] for n, p in model.named_parameters()}


# ------------------------------------------------------------------ checks


def _capture(entry: ZooEntry, model: nn.Module, inputs: tuple[Any, ...], result: ZooResult,
             backend: str, ref: Reference) -> Check:
    import kiln

    start = time.perf_counter()
    graph = kiln.capture(copy.deepcopy(model).eval(), inputs)
    result.capture_s = time.perf_counter() - start
    result.nodes = len(graph.nodes)
    return Check("pass", seconds=result.capture_s, extra={"nodes": result.nodes})


def _inference(entry: ZooEntry, model: nn.Module, inputs: tuple[Any, ...], result: ZooResult,
               backend: str, ref: Reference) -> Check:
    import kiln

    start = time.perf_counter()
    subject = copy.deepcopy(model).eval()
    compiled = kiln.compile(subject, inputs, strict=True, backend=backend)
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        outputs = cmp.flatten_outputs(compiled(*inputs))
    if result.nodes is None:
        result.nodes = compiled.stats["nodes"]
    return judged(cmp.compare_all(outputs, ref.outputs32, ref.outputs64), time.perf_counter() - start,
                  compile_s=compile_s)


def _dynamo(entry: ZooEntry, model: nn.Module, inputs: tuple[Any, ...], result: ZooResult,
            backend: str, ref: Reference) -> Check:
    reset_dynamo()
    start = time.perf_counter()
    subject = copy.deepcopy(model).eval()
    compiled = torch.compile(subject, backend="kiln", dynamic=False, options={"strict": True, "backend": backend})
    with torch.no_grad():
        outputs = cmp.flatten_outputs(compiled(*inputs))
    return judged(cmp.compare_all(outputs, ref.outputs32, ref.outputs64), time.perf_counter() - start)


def _grad(entry: ZooEntry, model: nn.Module, inputs: tuple[Any, ...], result: ZooResult,
          backend: str, ref: Reference) -> Check:
    loss32 = WeightedLoss(ref.weights)
    eager32 = grads_eager(copy.deepcopy(model), inputs, loss32)
    eager64 = grads_eager(copy.deepcopy(model).double(), [to_double(x) for x in inputs],
                          copy.deepcopy(loss32).double())
    reset_dynamo()
    start = time.perf_counter()
    subject = copy.deepcopy(model).train()
    compiled = torch.compile(subject, backend="kiln", dynamic=False, options={"strict": True, "backend": backend})
    loss = loss32(compiled(*inputs))
    loss.backward()
    grads = {n: p.grad for n, p in subject.named_parameters() if p.grad is not None}
    grads["loss"] = loss.detach()
    expected = {n: g for n, g in eager64.items()}
    extra = [n for n in grads if n not in expected]
    check = judged(cmp.compare_all(grads, eager32, expected), time.perf_counter() - start)
    if extra:
        check.extra["unexpected_grads"] = extra
    return check


def _train(entry: ZooEntry, model: nn.Module, inputs: tuple[Any, ...], result: ZooResult,
           backend: str, ref: Reference) -> Check:
    import kiln

    loss32 = WeightedLoss(ref.weights)
    losses32, delta32 = train_eager(copy.deepcopy(model), inputs, loss32)
    losses64, delta64 = train_eager(copy.deepcopy(model).double(), [to_double(x) for x in inputs],
                                    copy.deepcopy(loss32).double())
    start = time.perf_counter()
    subject = copy.deepcopy(model).train()
    initial = {n: p.detach().clone() for n, p in subject.named_parameters()}
    optimizer = torch.optim.AdamW(subject.parameters(), lr=LEARNING_RATE)
    step = kiln.compile_train(subject, loss32, optimizer, inputs, num_targets=0, backend=backend)
    losses = [step(*inputs).detach().clone() for _ in range(TRAIN_STEPS)]
    delta = {n: p.detach() - initial[n] for n, p in subject.named_parameters()}
    loss_cmp = [cmp.compare(f"loss.{i}", a, b, c) for i, (a, b, c) in enumerate(zip(losses, losses32, losses64))]
    delta_cmp = cmp.compare_all({f"step.{n}": v for n, v in delta.items()},
                                {f"step.{n}": v for n, v in delta32.items()},
                                {f"step.{n}": v for n, v in delta64.items()})
    check = judged(loss_cmp + delta_cmp, time.perf_counter() - start)
    worst_loss = cmp.worst(loss_cmp)
    check.extra["loss_error"] = worst_loss.error if worst_loss else None
    check.extra["loss_by_noise"] = bool(worst_loss and worst_loss.by_float32_noise)
    return check


def _fallback(entry: ZooEntry, model: nn.Module, inputs: tuple[Any, ...], result: ZooResult,
              backend: str, ref: Reference) -> Check:
    import kiln

    if result.checks.get("inference") and result.checks["inference"].status == "pass":
        result.fallback_ops = {}  # strict compilation succeeded: nothing can fall back
        return Check("skip", message="strict inference compiled the whole model")
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = kiln.compile(copy.deepcopy(model).eval(), inputs, backend=backend)
        with torch.no_grad():
            outputs = cmp.flatten_outputs(compiled(*inputs))
    result.fallback_ops = dict(compiled.stats.get("fallback_ops") or {})
    check = judged(cmp.compare_all(outputs, ref.outputs32, ref.outputs64), time.perf_counter() - start)
    check.extra["fallback_ops"] = result.fallback_ops
    check.extra["torch_nodes"] = compiled.stats.get("torch_nodes", 0)
    check.extra["warnings"] = sum(isinstance(w.message, kiln.KilnFallbackWarning) for w in caught)
    return check


_RUNNERS: dict[str, Callable[..., Check]] = {"capture": _capture, "inference": _inference, "dynamo": _dynamo,
                                             "grad": _grad, "train": _train, "fallback": _fallback}


def run_entry(entry: ZooEntry, checks: Iterable[str] = CHECKS, backend: str = "cpu",
              timeout: float | None = 600.0) -> ZooResult:
    """Run ``checks`` on one entry; never raises (a failure is recorded in the result)."""
    result = ZooResult(entry.name, entry.family, entry.kind)
    wanted = [c for c in CHECKS if c in set(checks)]
    start = time.perf_counter()
    try:
        with time_limit(timeout):
            try:
                model, inputs = entry.build()
                inputs = tuple(inputs)
                ref64_model = copy.deepcopy(model).double()
                outputs32 = eval_outputs(copy.deepcopy(model), inputs)
                outputs64 = eval_outputs(ref64_model, [to_double(x) for x in inputs])
                ref = Reference(outputs32, outputs64, cmp.weights_for(outputs64))
            except Exception as error:  # noqa: BLE001  (the model does not build or run in eager)
                result.checks["build"] = Check("error", message=error_line(error))
                return result
            for name in wanted:
                t0 = time.perf_counter()
                try:
                    result.checks[name] = _RUNNERS[name](entry, model, inputs, result, backend, ref)
                except ZooTimeout:
                    raise
                except Exception as error:  # noqa: BLE001  (recorded; the sweep goes on)
                    check = Check("error", message=error_line(error), seconds=time.perf_counter() - t0)
                    check.extra["traceback"] = traceback.format_exc(limit=-6)
                    result.checks[name] = check
    except ZooTimeout as error:
        running = next((c for c in wanted if c not in result.checks), "build")
        result.checks[running] = Check("error", message=error_line(error))
    finally:
        reset_dynamo()
        result.seconds = time.perf_counter() - start
    return result


def run_zoo(names: Iterable[str] | None = None, checks: Iterable[str] = CHECKS, backend: str = "cpu",
            timeout: float | None = 600.0,
            progress: Callable[[ZooResult], None] | None = None) -> list[ZooResult]:
    """:func:`run_entry` for every selected entry, in order."""
    results = []
    for entry in select(names):
        result = run_entry(entry, checks, backend, timeout)
        results.append(result)
        if progress is not None:
            progress(result)
    return results


# ------------------------------------------------------------------ reports


def _fmt_error(check: Check | None) -> str:
    if check is None or check.status == "skip":
        return "-"
    if check.status == "error":
        return "error"
    text = f"{check.error:.1e}" if check.error is not None and math.isfinite(check.error) else "inf"
    if check.status == "fail":
        text = f"**{text} ✗**"
    elif check.by_noise:
        text += f" (+{check.by_noise} at f32 noise)"
    return text


def _fmt_fallback(result: ZooResult) -> str:
    if result.fallback_ops is None:
        return "?"
    if not result.fallback_ops:
        return "0"
    total = sum(result.fallback_ops.values())
    ops = ", ".join(f"`{op}`×{n}" for op, n in sorted(result.fallback_ops.items(), key=lambda kv: -kv[1]))
    return f"{total}: {ops}"


def markdown_table(results: Sequence[ZooResult]) -> str:
    """The results as a markdown table plus one line per failure."""
    header = ("| model | family | kind | capture s | nodes | fallback ops | forward | torch.compile fwd | "
              "gradients | compile_train loss / update | status |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        train = r.checks.get("train")
        train_text = "-"
        if train is not None and train.status != "skip":
            loss_error = train.extra.get("loss_error")
            loss_text = f"{loss_error:.1e}" if isinstance(loss_error, float) and math.isfinite(loss_error) else "?"
            train_text = "error" if train.status == "error" else f"{loss_text} / {_fmt_error(train)}"
        cap = f"{r.capture_s:.1f}" if r.capture_s is not None else "-"
        lines.append(f"| {r.name} | {r.family} | {r.kind} | {cap} | {r.nodes if r.nodes is not None else '-'} | "
                     f"{_fmt_fallback(r)} | {_fmt_error(r.checks.get('inference'))} | "
                     f"{_fmt_error(r.checks.get('dynamo'))} | {_fmt_error(r.checks.get('grad'))} | {train_text} | "
                     f"{r.status} |")
    failures = [r for r in results if r.status != "pass"]
    if failures:
        lines += ["", "First error per model that does not pass (every failing check: `--json`):", ""]
        for r in failures:
            message = (r.first_error or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"- **{r.name}** — {message}")
    return "\n".join(lines)


def summary(results: Sequence[ZooResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error")}
    per_check = []
    for name in ("build",) + CHECKS:
        ran = [r.checks[name] for r in results if name in r.checks and r.checks[name].status != "skip"]
        if ran:
            per_check.append(f"{name} {sum(c.ok for c in ran)}/{len(ran)}")
    noise = sum(1 for r in results if r.checks.get("grad") and r.checks["grad"].ok and r.checks["grad"].by_noise)
    fallback: dict[str, list[str]] = {}
    for r in results:
        for op in (r.fallback_ops or {}):
            fallback.setdefault(op, []).append(r.name)
    lines = [f"kiln zoo: {len(results)} models: {counts['pass']} pass, {counts['fail']} fail (wrong numbers), "
             f"{counts['error']} error; checks passed: {', '.join(per_check)}; "
             f"{noise} gradient checks pass only by the float32-noise bound on some tensor"]
    if fallback:
        lines.append("ops that fall back to PyTorch (non-strict): " + "; ".join(
            f"{op} ({', '.join(models)})" for op, models in sorted(fallback.items())))
    return "\n".join(lines)
