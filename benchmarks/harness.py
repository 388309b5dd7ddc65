"""The measurement loop: prepare every system, time them interleaved, derive ratios.

Per workload (one model at one input size), in one process:

1. **Prepare** each system in turn (cold start: export/compile + first call), recording the
   peak-RSS growth while doing so, and check its first output against eager's
   (``max |out - ref| / max |ref|`` over the output tensor).
2. **Warm up**: ``warmup`` calls per system, stopped early by the time budget.
3. **Time**: ``rounds`` rounds (default two).  In each round the systems take turns
   round-robin, each round starting one system further; a turn is a pause of ``settle_s``
   (0.2 s), one untimed call, then ``block`` timed calls (default: the round's ``runs``
   calls, so each system has one turn per round; ``block=1`` interleaves call by call).
   The pause and the untimed call keep one system's leftovers (BLAS and OpenMP worker
   threads that spin for ~0.1 s after a call, evicted caches) from being charged to the
   next one: on two cores an OpenBLAS call right before a PyTorch call made it ~45% slower.
   Each call is timed alone (:func:`kiln.runtime.timing.best_time` of one call), with
   garbage collection off.  Per system the round with the lower median is kept (a round
   disturbed by other processes only ever makes a median worse).
4. **Warm start**: each system again from nothing, with its caches filled.

Budget: each system gets ``budget_s`` seconds of calls per round.  It stops early once the
next call would exceed it (after at least one call), and is marked ``limited``.  A system
whose single call takes more than the budget gets one timed call in round one only; one
whose first call took more than three budgets is not called again: its first call is its
only sample (``first-call``).

Memory: peak RSS growth during one call (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``), measured on the first timed call of round one; and the RSS a
system keeps after preparing (``held``).  Before each measurement freed heap memory is
handed back to the OS (``malloc_trim``); memory an allocator keeps anyway (ORT's arena) is
reused without growing RSS, so both are lower bounds.  torch, ORT and numpy allocations are
all seen (``tracemalloc`` would see none of them).

Ratios are speedups computed from the medians of this run: ``vs_eager = eager / system``
(>1: faster than eager), likewise against Inductor and against the best peer (the fastest
other system that ran).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kiln.tuning.measure import best_time

from .models import Workload, select_workloads
from .report import (
    SystemResult,
    compute_ratios,
    describe_machine,
    summarize,
    write_outputs,
)
from .systems import (
    Prepared,
    System,
    describe_error,
    first_array,
    make_systems,
    relative_error,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SCHEMA = "kiln-bench/1"


@dataclass
class BenchConfig:
    """What to run and how; ``None`` fields take the full or ``quick`` defaults."""

    models: list[str] | None = None
    systems: list[str] | None = None
    quick: bool = False
    runs: int | None = None  # timed calls per system per round: 20 (quick: 10)
    warmup: int | None = None  # untimed calls per system: 3 (quick: 1)
    rounds: int = 2
    budget_s: float | None = None  # seconds of calls per system per round: 20 (quick: 3)
    block: int | None = None  # timed calls per turn; None: all of a round's calls in one turn
    settle_s: float = 0.2  # pause before each turn
    out: Path | None = DEFAULT_OUT  # None: write nothing
    threads: int | None = None  # intra-op threads of every system; None: library defaults
    kiln_backend: str | None = None
    progress: bool = True
    plot: bool = True

    def resolved(self) -> BenchConfig:
        """A copy with every default filled in."""
        quick = self.quick
        return BenchConfig(
            models=self.models, systems=self.systems, quick=quick,
            runs=self.runs or (10 if quick else 20), warmup=self.warmup if self.warmup is not None else
            (1 if quick else 3), rounds=max(1, self.rounds),
            budget_s=self.budget_s or (3.0 if quick else 20.0), block=self.block, settle_s=self.settle_s,
            out=Path(self.out) if self.out is not None else None, threads=self.threads,
            kiln_backend=self.kiln_backend,
            progress=self.progress, plot=self.plot)


@dataclass
class _Entry:
    """A system's state while one workload is measured."""

    system: System
    result: SystemResult
    prepared: Prepared | None = None
    estimate_s: float | None = None  # expected seconds per call
    rounds: list[list[float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result.status == "ok" and self.prepared is not None

    def fail(self, error: BaseException, phase: str) -> None:
        self.result.status = "failed"
        self.result.reason = f"{phase}: {describe_error(error)}"
        self.prepared = None


# --------------------------------------------------------------------------- memory


def _proc_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_memory(collect: bool) -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``), after a full garbage
    collection when ``collect``, so that the next measurement sees the memory a call needs
    rather than what the allocator happens to keep."""
    if collect:
        gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS growth then undercounts memory the allocator reuses


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


@dataclass
class _RssWindow:
    peak_mb: float | None = None
    held_mb: float | None = None


@contextmanager
def rss_window(collect: bool = True) -> Iterator[_RssWindow]:
    """Peak RSS growth (MB) inside the block, and RSS still held at its end; ``None``
    where the OS gives no per-process peak that can be reset (non-Linux)."""
    window = _RssWindow()
    _release_free_memory(collect)
    resettable = _reset_peak_rss()
    base = _proc_status_kb("VmRSS")
    try:
        yield window
    finally:
        peak, now = _proc_status_kb("VmHWM"), _proc_status_kb("VmRSS")
        if resettable and base is not None and peak is not None and now is not None:
            window.peak_mb = max(0, peak - base) / 1024
            window.held_mb = (now - base) / 1024


# --------------------------------------------------------------------------- one workload


class _Progress:
    """A tqdm bar when available and wanted, else nothing."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def step(self, text: str, advance: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(advance)

    def show(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _call(entry: _Entry) -> float:
    """Seconds of one call of the system: one sample of its distribution (the round-robin
    and the statistics are this module's; the clock is kiln's one timing loop)."""
    assert entry.prepared is not None
    return best_time(entry.prepared.run, repeat=1, warmup=0)


def _prepare(entry: _Entry, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], reference: Any,
             workdir: Path, key: str) -> None:
    reason = entry.system.unavailable_reason()
    if reason:
        entry.result.status, entry.result.reason = "skipped", reason
        return
    try:
        with rss_window() as memory:
            entry.prepared = entry.system.prepare(model, inputs, workdir, key)
    except Exception as error:  # noqa: BLE001 - a failing system is reported, never fatal
        entry.fail(error, "prepare")
        return
    result, prepared = entry.result, entry.prepared
    result.cold_start_s = prepared.cold_start_s
    result.compile_peak_mb, result.held_mb = memory.peak_mb, memory.held_mb
    result.notes += prepared.notes
    entry.estimate_s = prepared.first_call_s
    try:
        result.max_rel_err = relative_error(prepared.first_output, reference)
    except Exception as error:  # noqa: BLE001
        result.notes.append(f"output not comparable: {describe_error(error)}")
    prepared.first_output = None


def _warm_up(entry: _Entry, count: int, budget_s: float) -> None:
    if entry.estimate_s is not None and entry.estimate_s > 3 * budget_s:
        entry.result.limited = "first-call"
        entry.rounds = [[entry.estimate_s]]
        return
    spent = 0.0
    for _ in range(count):
        if spent >= budget_s:
            break
        try:
            elapsed = _call(entry)
        except Exception as error:  # noqa: BLE001
            entry.fail(error, "warm-up")
            return
        spent += elapsed
        entry.estimate_s = elapsed


@dataclass
class _RoundState:
    """One system's progress through one timing round."""

    entry: _Entry
    samples: list[float]
    spent_s: float = 0.0
    done: bool = False


def _turn(state: _RoundState, calls: int, budget_s: float, measure_memory: bool) -> None:
    """Up to ``calls`` timed calls of one system, after an untimed call that absorbs whatever
    the previous system left running (spinning BLAS or OpenMP threads, cold caches)."""
    entry, samples = state.entry, state.samples
    over_budget = entry.result.limited == "over-budget"
    try:
        if not over_budget:
            state.spent_s += _call(entry)
        for _ in range(calls):
            if samples and (over_budget or state.spent_s + statistics.median(samples) > budget_s):
                entry.result.limited = entry.result.limited or "budget"
                state.done = True
                return
            if measure_memory and not samples:
                with rss_window(collect=False) as memory:
                    elapsed = _call(entry)
                entry.result.run_peak_mb = memory.peak_mb
            else:
                elapsed = _call(entry)
            samples.append(elapsed)
            state.spent_s += elapsed
    except Exception as error:  # noqa: BLE001 - a failing system is reported, never fatal
        entry.fail(error, f"timed call {len(samples) + 1} of round {len(entry.rounds)}")
        state.done = True


def _timed_round(entries: list[_Entry], round_index: int, config: BenchConfig) -> None:
    """One round: the systems take turns round-robin (starting one further each round), each
    turn ``block`` timed calls after a settle pause, until each has ``runs`` calls or its budget
    is spent."""
    runs, budget_s = config.runs or 1, config.budget_s or 0.0
    block = min(config.block or runs, runs)
    active = [e for e in entries if e.ok and e.result.limited != "first-call"]
    if round_index > 0:
        active = [e for e in active if e.result.limited != "over-budget"]
    if not active:
        return
    states = []
    for entry in active:
        if entry.estimate_s is not None and entry.estimate_s > budget_s:
            entry.result.limited = "over-budget"
        entry.rounds.append([])
        states.append(_RoundState(entry, entry.rounds[-1]))
    shift = round_index % len(states)
    states = states[shift:] + states[:shift]
    while True:
        pending = [s for s in states if not s.done and s.entry.ok and len(s.samples) < runs]
        if not pending:
            return
        for state in pending:
            time.sleep(config.settle_s)
            _turn(state, min(block, runs - len(state.samples)), budget_s, measure_memory=round_index == 0)


def _warm_start(entry: _Entry, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], workdir: Path,
                key: str) -> None:
    try:
        entry.result.warm_start_s = entry.system.warm_start(model, inputs, workdir, key)
    except Exception as error:  # noqa: BLE001
        entry.result.warm_note = f"failed: {describe_error(error)}"
        return
    if entry.result.warm_start_s is None:
        entry.result.warm_note = entry.system.warm_start_note()


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No garbage collection inside the block (as ``timeit`` does while timing)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """Move every object alive now out of the collector's sight for the block, so the full
    collections before memory measurements scan only what the run creates (torch and its
    compilers leave millions of long-lived objects; each full collection took ~0.5 s)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def time_entries(entries: list[_Entry], config: BenchConfig, progress: _Progress, label: str) -> None:
    """Warm-up, then ``config.rounds`` interleaved timing rounds of the prepared ``entries``
    (garbage collection paused); samples land in each entry's ``rounds``.  The caller picks
    the autograd mode (inference: ``torch.inference_mode()``; training steps: none)."""
    with _gc_paused():
        for entry in entries:
            if entry.ok:
                _warm_up(entry, config.warmup or 0, config.budget_s or 0.0)
        for round_index in range(config.rounds):
            progress.show(f"{label}: round {round_index + 1}/{config.rounds}")
            _timed_round(entries, round_index, config)
            progress.step(f"{label}: round {round_index + 1} done")


def bench_workload(model: torch.nn.Module, workload: Workload, systems: list[System], config: BenchConfig,
                   workdir: Path, progress: _Progress) -> dict[str, Any]:
    """Measure every system on one workload; returns the workload's JSON record."""
    inputs = workload.inputs()
    try:
        with torch.inference_mode():
            reference = first_array(model(*inputs))
    except Exception as error:  # noqa: BLE001 - without eager's output nothing can be checked
        progress.step(f"{workload.name}: eager failed", advance=len(systems) + config.rounds + 1)
        return _failed_record(workload, systems, f"the model fails in eager mode: {describe_error(error)}")
    entries = [_Entry(system, SystemResult(system.name)) for system in systems]
    for entry in entries:
        progress.show(f"{workload.name}: {entry.system.name} compile")
        _prepare(entry, model, inputs, reference, workdir, workload.name)
        progress.step(f"{workload.name}: {entry.system.name} ready")
    with torch.inference_mode():
        time_entries(entries, config, progress, workload.name)
    for entry in entries:
        summarize(entry.result, entry.rounds)
        entry.prepared = None
        if entry.result.status == "ok":
            progress.show(f"{workload.name}: {entry.system.name} warm start")
            _warm_start(entry, model, inputs, workdir, workload.name)
        entry.system.release()
    progress.step(f"{workload.name}: done")
    results = {entry.system.name: entry.result for entry in entries}
    compute_ratios(results)
    gc.collect()
    return _record(workload, results)


def _record(workload: Workload, results: dict[str, SystemResult]) -> dict[str, Any]:
    return {"name": workload.name, "model": workload.model, "description": workload.spec.description,
            "batch": workload.shape.batch, "seq": workload.shape.seq,
            "results": {name: asdict(result) for name, result in results.items()}}


def _failed_record(workload: Workload, systems: list[System], reason: str) -> dict[str, Any]:
    """The record of a workload no system could run (the model did not build or run)."""
    return _record(workload, {s.name: SystemResult(s.name, status="failed", reason=reason) for s in systems})


# --------------------------------------------------------------------------- a whole run


CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "KILN_CACHE_DIR")


@contextmanager
def _isolated_caches(workdir: Path) -> Iterator[None]:
    """Point Inductor's and kiln's compile caches at empty folders so cold starts are cold;
    a cache folder the user chose through the environment is kept."""
    chosen = [name for name in CACHE_VARIABLES if name not in os.environ]
    for name in chosen:
        os.environ[name] = str(workdir / name.lower())
    try:
        yield
    finally:
        for name in chosen:
            os.environ.pop(name, None)


def run(config: BenchConfig, *, on_workload: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and write ``results.md``, ``results.json`` and ``results.png`` to
    ``config.out`` (unless it is ``None``); returns the JSON document."""
    config = config.resolved()
    workloads = select_workloads(config.models, quick=config.quick)
    systems = make_systems(config.systems, kiln_backend=config.kiln_backend)
    started = datetime.now(UTC)
    machine = describe_machine()
    machine["torch_threads"] = config.threads or machine["torch_threads"]
    records: list[dict[str, Any]] = []
    threads_before = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)  # Inductor and ORT follow torch's thread count
        os.environ.setdefault("TVM_NUM_THREADS", str(config.threads))
    steps_per_workload = len(systems) + config.rounds + 1
    progress = _Progress(len(workloads) * steps_per_workload, config.progress)
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp, _isolated_caches(Path(tmp)), \
                _gc_frozen():
            for spec, group in itertools.groupby(workloads, key=lambda w: w.spec):
                progress.show(f"building {spec.name}")
                try:
                    model: torch.nn.Module | None = spec.build()
                    build_error = ""
                except Exception as error:  # noqa: BLE001 - e.g. transformers missing: the others still run
                    model, build_error = None, f"building the model failed: {describe_error(error)}"
                for workload in group:
                    if model is None:
                        record = _failed_record(workload, systems, build_error)
                        progress.step(f"{workload.name}: no model", advance=steps_per_workload)
                    else:
                        record = bench_workload(model, workload, systems, config, Path(tmp), progress)
                    records.append(record)
                    if on_workload is not None:
                        on_workload(record)
                del model
                gc.collect()
    finally:
        progress.close()
        torch.set_num_threads(threads_before)
    return finish_document(SCHEMA, started, config, machine, systems, records)


def finish_document(schema: str, started: datetime, config: BenchConfig, machine: dict[str, Any],
                    systems: list[Any], records: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The JSON document of a finished run (``extra`` fields, e.g. report titles, follow the
    schema), written with :func:`write_outputs` to ``config.out`` unless that is ``None``."""
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    document = {
        "schema": schema,
        **extra,
        "created": started.isoformat(timespec="seconds"),
        "duration_s": round((datetime.now(UTC) - started).total_seconds(), 1),
        "config": _config_record(config),
        "machine": machine,
        "systems": [_system_record(s) for s in systems],
        "workloads": records,
    }
    if config.out is not None:
        document["files"] = {k: str(v) for k, v in write_outputs(document, config.out, plot=config.plot).items()}
    return document


def _config_record(config: BenchConfig) -> dict[str, Any]:
    record = asdict(config)
    record["out"] = str(config.out) if config.out is not None else None
    return record


def _system_record(system: System) -> dict[str, Any]:
    reason = system.unavailable_reason()
    version = ""
    if reason is None:
        try:
            version = system.version()
        except Exception as error:  # noqa: BLE001
            version = f"unknown ({describe_error(error)})"
    return {"name": system.name, "label": system.label, "available": reason is None, "version": version,
            "note": reason or ""}
