"""Tuning every generated kernel of a model's cpu build: :func:`tune_model`.

The model is captured and optimized as ``kiln.compile`` does (the default pipeline), built
once by the cpu backend with its compile cache off while :func:`~kiln.backends.cpu.schedules.
observe_kernels` collects the loop program of every generated kernel, exactly as the
backend schedules it.  Distinct kernels (by :func:`~kiln.backends.common.records.
structural_key`) are tuned largest first, the budget split evenly among them, and each
result is appended to the record file of the cache folder.  The next build of any model
containing one of those kernels replays its tuned schedule (checked again); the records
are part of the build's cache key, so no stale artifact is loaded.

``kiln.compile(model, args, tune=budget_seconds)`` is this function followed by the usual
compile; ``kiln tune MODEL --budget 600`` runs it from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.backends import get_backend
from kiln.backends.common.records import machine_key, store_for, structural_key
from kiln.backends.cpu.loop_work import nest_work
from kiln.backends.cpu.schedules import observe_kernels
from kiln.passes.pipeline import resolve_passes

from .search import Deadline, TuneResult, tune


@dataclass
class ModelTuning:
    """What :func:`tune_model` did: the tuned kernels' results, and the kernels skipped
    (already recorded, out of budget, or failing to tune: with the reason)."""

    results: dict[str, TuneResult] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    kernels: int = 0

    def summary(self) -> str:
        lines = [f"{self.kernels} distinct kernels, {len(self.results)} tuned, {len(self.skipped)} skipped"]
        for name, r in self.results.items():
            c = r.counts
            lines.append(f"  {name}: {r.speedup:.2f}x over the default ({r.default_s * 1e3:.3f} -> "
                         f"{r.time_s * 1e3:.3f} ms; {c['measured']} measured, {c['illegal']} illegal pruned)")
        lines += [f"  {name}: skipped ({why})" for name, why in self.skipped.items()]
        return "\n".join(lines)


def model_kernels(model: Any, args: Any, *, threads: int | None = None, passes: Any = "default",
                  options: dict[str, Any] | None = None) -> list[tuple]:
    """``(program, kind, threads)`` of every generated kernel of ``model``'s cpu build (with
    the backend ``options``, e.g. ``{"select": "generated"}``: GEMMs and convolutions as
    generated loops instead of library calls)."""
    import torch  # noqa: PLC0415

    from kiln.frontends.torch.capture import capture  # noqa: PLC0415

    args = args if isinstance(args, tuple) else (args,)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tune_model: expected a torch.nn.Module, got {type(model).__name__}; wrap a function in "
                        "a module to tune it")
    captured = capture(model, args)
    transform = resolve_passes(passes)
    graph = transform(captured.graph) if transform is not None else captured.graph
    with observe_kernels() as seen:
        get_backend("cpu").build(graph, {**(options or {}), "cache": False, "threads": threads})
    return list(seen)


def tune_model(model: Any, args: Any, budget_s: float = 600, *, cache_dir: str | None = None,
               threads: int | None = None, strategy: str = "evolutionary", min_kernel_s: float = 8.0,
               retune: bool = False, progress: bool = False, seed: int = 0, workers: int | None = None,
               passes: Any = "default") -> ModelTuning:
    """Tune the generated kernels of ``model`` (module docstring) within ``budget_s`` seconds
    in all; records go to ``cache_dir`` (default: the compile-cache folder).  Kernels with a
    record already are skipped unless ``retune``; at most ``budget_s / min_kernel_s`` kernels
    are tuned, largest (most loop iterations) first."""
    if budget_s <= 0:
        raise ValueError(f"tune_model: the budget must be positive seconds, got {budget_s}")
    deadline = Deadline(budget_s)
    kernels = model_kernels(model, args, threads=threads, passes=passes)
    store = store_for(cache_dir)
    out = ModelTuning()
    unique: dict[str, tuple] = {}
    for program, kind, n_threads in kernels:
        unique.setdefault(structural_key(program), (program, kind, n_threads))
    out.kernels = len(unique)
    todo = []
    for key, (program, kind, n_threads) in unique.items():
        label = f"{program.name}[{key[:8]}]"
        if not retune and store.lookup(key, machine_key(n_threads)) is not None:
            out.skipped[label] = "has a record"
            continue
        todo.append((nest_work(program.body) or 0, label, program, kind, n_threads))
    todo.sort(key=lambda t: -t[0])
    slots = max(1, int(budget_s // min_kernel_s))
    for _, label, *_rest in todo[slots:]:
        out.skipped[label] = "out of budget"
    todo = todo[:slots]
    for index, (_, label, program, kind, n_threads) in enumerate(todo):
        left = budget_s - deadline.elapsed()
        share = left / (len(todo) - index)
        if share < 1.0:
            out.skipped[label] = "out of budget"
            continue
        try:
            out.results[label] = tune(program, {}, share, strategy=strategy, kind=kind, threads=n_threads,
                                      records=store, progress=progress, seed=seed + index, workers=workers,
                                      cache_dir=cache_dir)
        except (RuntimeError, ValueError) as e:
            out.skipped[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return out


__all__ = ["ModelTuning", "model_kernels", "tune_model"]
