"""Benchmark results: the per-system record, figures derived from samples (percentiles, ratios),
the machine description, and the outputs: a markdown report, JSON and a PNG plot.

The renderings read only the run's JSON document (see :func:`benchmarks.harness.run`), so a
saved ``results.json`` can be rendered again with :func:`write_outputs`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

LIMIT_MARKS = {"budget": "†", "over-budget": "‡", "first-call": "§"}
LIMIT_LEGEND = (
    "† stopped early by the time budget; ‡ one call is longer than the budget: one timed call; "
    "§ first call longer than three budgets: the first call (after compilation) is the only sample"
)


# --------------------------------------------------------------------------- records


@dataclass
class SystemResult:
    """One system on one workload. Times in milliseconds unless the name says seconds."""

    system: str
    status: str = "ok"  # ok | failed | skipped
    reason: str = ""
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    q1_ms: float | None = None
    q3_ms: float | None = None
    min_ms: float | None = None
    runs: int = 0
    round_medians_ms: list[float] = field(default_factory=list)
    samples_ms: list[float] = field(default_factory=list)
    limited: str = ""  # "" | "budget" | "over-budget" | "first-call"
    cold_start_s: float | None = None
    warm_start_s: float | None = None
    warm_note: str = ""
    compile_peak_mb: float | None = None
    held_mb: float | None = None
    run_peak_mb: float | None = None
    max_rel_err: float | None = None
    vs_eager: float | None = None
    vs_inductor: float | None = None
    vs_best_peer: float | None = None
    best_peer: str | None = None
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- statistics


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an ascending list (``q`` in [0, 1])."""
    position = (len(sorted_values) - 1) * q
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(result: SystemResult, rounds: list[list[float]]) -> None:
    """Fill the statistics of ``result`` from per-round samples (seconds): keep the round
    with the lowest median."""
    rounds = [r for r in rounds if r]
    if not rounds:
        return
    medians = [statistics.median(r) for r in rounds]
    best = sorted(rounds[medians.index(min(medians))])
    ms = [s * 1e3 for s in best]
    result.round_medians_ms = [m * 1e3 for m in medians]
    result.samples_ms = ms
    result.runs = len(ms)
    result.median_ms = statistics.median(ms)
    result.p10_ms, result.p90_ms = _percentile(ms, 0.1), _percentile(ms, 0.9)
    result.q1_ms, result.q3_ms = _percentile(ms, 0.25), _percentile(ms, 0.75)
    result.min_ms = ms[0]


def compute_ratios(results: dict[str, SystemResult]) -> None:
    """Speedups of every timed system against eager, Inductor and its best peer."""
    timed = {name: r.median_ms for name, r in results.items() if r.status == "ok" and r.median_ms}
    for name, result in results.items():
        mine = timed.get(name)
        if mine is None:
            continue
        if "eager" in timed:
            result.vs_eager = timed["eager"] / mine
        if "inductor" in timed:
            result.vs_inductor = timed["inductor"] / mine
        peers = {other: t for other, t in timed.items() if other != name}
        if peers:
            result.best_peer = min(peers, key=peers.__getitem__)
            result.vs_best_peer = peers[result.best_peer] / mine


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    """The installed version of a package, without importing it (transformers takes seconds)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    """A read-only git query about this checkout (no optional locks: never touches the index)."""
    try:
        out = subprocess.run(["git", "--no-optional-locks", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_commit() -> str | None:
    """The checkout's commit, with ``+changes`` when tracked files differ from it."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return commit


def _memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def describe_machine() -> dict[str, Any]:
    """CPU, cores, memory, load, library versions and kiln's backends, for the outputs."""
    from kiln.backends import available_backends

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "memory_gb": round(_memory_gb() or 0.0, 1) or None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": _version("onnxruntime"),
        "onnx": _version("onnx"),
        "transformers": _version("transformers"),
        "numpy": _version("numpy"),
        "kiln": _version("kiln"),
        "kiln_backends": available_backends(),
        "thread_variables": {name: os.environ[name] for name in
                             ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS") if name in os.environ},
        "git_commit": _git_commit(),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "argv": sys.argv,
    }


# --------------------------------------------------------------------------- formatting


def _ms(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value >= 1 else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.3f}x" if value >= 0.001 else f"{value:.1e}x"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _mb(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _error(value: float | None) -> str:
    return "–" if value is None else f"{value:.1e}"


def _threads(count: int) -> str:
    return f"{count} thread{'' if count == 1 else 's'}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]


def _labels(document: dict[str, Any]) -> dict[str, str]:
    return {s["name"]: s["label"] for s in document["systems"]}


def _cell_time(result: dict[str, Any], fastest: bool) -> str:
    if result["status"] != "ok":
        return result["status"]
    text = _ms(result["median_ms"]) + LIMIT_MARKS.get(result["limited"], "")
    return f"**{text}**" if fastest else text


def _fastest(results: dict[str, Any]) -> str | None:
    timed = {n: r["median_ms"] for n, r in results.items() if r["status"] == "ok" and r["median_ms"]}
    return min(timed, key=timed.__getitem__) if timed else None


# --------------------------------------------------------------------------- markdown


def _header(document: dict[str, Any]) -> list[str]:
    config, machine = document["config"], document["machine"]
    mode = "quick" if config["quick"] else "full"
    load_start = " / ".join(f"{x:.1f}" for x in machine.get("load_average_start") or [])
    load_end = " / ".join(f"{x:.1f}" for x in machine.get("load_average_end") or [])
    pinned = ", ".join(f"{k}={v}" for k, v in (machine.get("thread_variables") or {}).items())
    rows = [
        ["CPU", (f"{machine['cpu']} ({machine['logical_cpus']} logical CPUs, {machine['usable_cpus']} usable, "
                 f"{machine.get('memory_gb') or '?'} GiB)")],
        ["OS / Python", f"{machine['os']} / {machine['python']}"],
        ["PyTorch", f"{machine['torch']} ({_threads(machine['torch_threads'])}{'; ' + pinned if pinned else ''})"],
        ["ONNX Runtime / onnx", (f"{machine.get('onnxruntime') or 'not installed'} / "
                                 f"{machine.get('onnx') or 'not installed'}")],
        ["transformers / numpy", f"{machine.get('transformers') or '–'} / {machine.get('numpy') or '–'}"],
        ["kiln", (f"{machine.get('kiln')} (backends: {', '.join(machine.get('kiln_backends') or [])}; "
                  f"commit {machine.get('git_commit') or '?'})")],
        ["load average (1/5/15 min)", f"start {load_start}; end {load_end}"],
    ]
    block = f"{config['block']} calls" if config.get("block") else "all of a round's calls"
    method = (f"Run {document['created']} ({document['duration_s']:.0f} s), {mode} mode: {config['warmup']} "
              f"warm-up call(s), then {config['rounds']} rounds of up to {config['runs']} timed calls per "
              f"system; systems take turns round-robin (a turn: {config['settle_s']:g} s pause, one untimed "
              f"call, {block}); budget {config['budget_s']:g} s of calls per system per round; the better "
              "round's median is reported. " + document.get("mode_note", "float32, `torch.inference_mode()`."))
    busy = _busy_warning(machine)
    return [f"# {document.get('title', 'kiln benchmark results')}", "", *([busy, ""] if busy else []), method, "",
            *_table(["machine", ""], rows), ""]


def _busy_warning(machine: dict[str, Any]) -> str:
    """A warning when other processes kept the CPUs busy (1-minute load at start or end
    above half the usable CPUs): multi-threaded calls then wait for descheduled threads."""
    loads = [x[0] for x in (machine.get("load_average_start"), machine.get("load_average_end")) if x]
    cpus = machine.get("usable_cpus") or 1
    if not loads or max(loads) < cpus / 2:
        return ""
    return (f"**Busy machine:** 1-minute load average up to {max(loads):.1f} on {cpus} usable CPUs, so other "
            "processes competed for the cores; multi-threaded timings suffer most (a parallel region waits "
            "for its slowest, descheduled thread). Compare systems within this run only.")


def _summary(document: dict[str, Any]) -> list[str]:
    labels = _labels(document)
    names = [s["name"] for s in document["systems"]]
    time_rows, speed_rows = [], []
    for workload in document["workloads"]:
        results = workload["results"]
        fastest = _fastest(results)
        time_rows.append([workload["name"]] + [_cell_time(results[n], n == fastest) for n in names])
        speed_rows.append([workload["name"]] + [
            _ratio(results[n]["vs_eager"]) if results[n]["status"] == "ok" else results[n]["status"]
            for n in names])
    header = ["workload"] + [labels[n] for n in names]
    return [
        "## Median latency (ms, lower is better; fastest in bold)", "", *_table(header, time_rows), "",
        "## Speedup over PyTorch eager (higher is better)", "", *_table(header, speed_rows), "",
    ]


def _workload_section(workload: dict[str, Any], labels: dict[str, str]) -> list[str]:
    shape = f"batch {workload['batch']}" + (f", sequence {workload['seq']}" if workload["seq"] else "")
    header = ["system", "median ms", "p10–p90 ms", "runs", "vs eager", "vs Inductor", "vs best peer",
              "cold start s", "warm start s", "run peak MB", "held MB", "max rel err", "notes"]
    rows = []
    for name, r in workload["results"].items():
        if r["status"] != "ok":
            rows.append([labels.get(name, name), r["status"]] + ["–"] * 10 + [r["reason"]])
            continue
        spread = f"{_ms(r['p10_ms'])}–{_ms(r['p90_ms'])}"
        peer = f"{_ratio(r['vs_best_peer'])} ({r['best_peer']})" if r["best_peer"] else "–"
        warm = _seconds(r["warm_start_s"]) + (f" ({r['warm_note']})" if r["warm_note"] else "")
        rows.append([labels.get(name, name), _ms(r["median_ms"]), spread,
                     f"{r['runs']}{LIMIT_MARKS.get(r['limited'], '')}", _ratio(r["vs_eager"]),
                     _ratio(r["vs_inductor"]), peer, _seconds(r["cold_start_s"]), warm, _mb(r["run_peak_mb"]),
                     _mb(r["held_mb"]), _error(r["max_rel_err"]), "; ".join(r["notes"])])
    return [f"### {workload['name']}: {workload['description']}, {shape}", "", *_table(header, rows), ""]


def _legend(document: dict[str, Any]) -> list[str]:
    missing = [s for s in document["systems"] if not s["available"]]
    lines = [
        "## Notes", "",
        f"- Runs column marks: {LIMIT_LEGEND}.",
        ("- Ratios are speedups from this run's medians: `vs eager` = eager median / system median "
         "(> 1: faster than eager); `vs best peer` compares with the fastest other system."),
        ("- Cold start: export/compile plus the first call, first time in the process. Warm start: the "
         "same with caches filled (Inductor FX-graph cache after `torch._dynamo.reset()`, ORT session from "
         "the exported file, kiln's compile cache when its backend uses one)."),
        ("- Memory: `run peak` is the peak-RSS growth during one call, `held` the RSS a system keeps "
         "after compiling; both are in-process lower bounds (see docs/benchmarks.md)."),
        document.get("error_note", "- `max rel err`: max |output - eager| / max |eager| on the model output."),
    ]
    return lines + [f"- {s['label']} not run: {s['note']}" for s in missing] + [""]


def to_markdown(document: dict[str, Any]) -> str:
    """The whole report as markdown."""
    labels = _labels(document)
    lines = _header(document) + _summary(document) + ["## Per workload", ""]
    for workload in document["workloads"]:
        lines += _workload_section(workload, labels)
    return "\n".join(lines + _saved_section(document) + _legend(document))


def _saved_section(document: dict[str, Any]) -> list[str]:
    """Activation bytes kept for the backward, per workload (training runs only)."""
    saved = {w["name"]: w["saved_for_backward"] for w in document["workloads"] if w.get("saved_for_backward")}
    if not saved:
        return []
    labels = _labels(document)
    rows = []
    for workload, systems in saved.items():
        for name, by_policy in systems.items():
            rows += [[workload, labels.get(name, name), policy, f"{count / 2**20:,.2f}"] for policy, count in by_policy.items()]
    return ["## Activations saved for the backward (MB)", "",
            ("kiln: `split_joint(...).saved_bytes` of the step's joint graph under each autodiff policy (the "
             "compiled steps' own planned peaks are in their notes); eager: distinct storages autograd saves in "
             "one forward (parameters and inputs excluded)."), "",
            *_table(["workload", "system", "policy", "MB"], rows), ""]


# --------------------------------------------------------------------------- plot


def write_plot(document: dict[str, Any], path: Path) -> bool:
    """Grouped bars of the speedup over eager per workload; False without matplotlib.

    The scale is linear unless the speedups span more than 20x (then logarithmic)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return False
    labels = _labels(document)
    names = [s["name"] for s in document["systems"] if s["available"]]
    workloads = document["workloads"]
    width = 0.8 / max(len(names), 1)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.3 * len(workloads) + 2), 4.5))
    values: list[float] = []
    for index, name in enumerate(names):
        xs, ys = [], []
        for position, workload in enumerate(workloads):
            value = workload["results"].get(name, {}).get("vs_eager")
            if value:
                xs.append(position + (index - (len(names) - 1) / 2) * width)
                ys.append(value)
        axes.bar(xs, ys, width, label=labels[name])
        values += ys
    axes.axhline(1.0, color="black", linewidth=0.8)
    log = bool(values) and max(values) / min(values) > 20
    if log:
        axes.set_yscale("log")
    axes.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    axes.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    axes.set_xticks(range(len(workloads)), [w["name"] for w in workloads], rotation=30, ha="right")
    axes.set_ylabel("speedup over PyTorch eager" + (" (log scale)" if log else ""))
    axes.set_title(f"kiln benchmark ({document['created'][:10]}): {document['machine']['cpu']}, "
                   f"{_threads(document['machine']['torch_threads'])}; higher is better")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# --------------------------------------------------------------------------- files


def write_outputs(document: dict[str, Any], out: Path, *, plot: bool = True) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and (with matplotlib) ``results.png`` to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "results.json", "markdown": out / "results.md"}
    if plot:
        files["plot"] = out / "results.png"
    body = {k: v for k, v in document.items() if k != "files"}
    body["files"] = {k: str(v) for k, v in files.items()}
    if plot and not write_plot(body, files["plot"]):
        del files["plot"]
        body["files"].pop("plot")
    files["json"].write_text(json.dumps(body, indent=1, default=str) + "\n")
    files["markdown"].write_text(to_markdown(body) + "\n")
    return files
