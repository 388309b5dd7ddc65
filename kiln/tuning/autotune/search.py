"""``autotune``: search loop schedules of one kernel, every candidate legality-checked.

The loop (one kernel)::

    default schedule (the cpu backend's strategy) -> measured first: the baseline
    repeat until the budget (seconds) or the number of trials is spent:
        propose candidates (random, or mutated / crossed-over traces of the best so far)
        build each, unchecked, then check it with isl: illegal ones are pruned (counted)
        optionally rank the legal ones with a cost model, keep the best few
        compile them in a process pool, run each once against the reference, time it
    the fastest measured schedule (the default when nothing beats it) -> a tuning record

Strategies: ``"random"`` (fresh random traces), ``"evolutionary"`` (a population of the
fastest traces, seeded by two batches of random ones: mutation and crossover, with a fifth
of the proposals still random), either with ``cost_model`` ranking the proposals
(a :class:`~kiln.tuning.autotune.costmodel.CostModel`, or ``"online"``: one fitted on this
run's measurements as they come).  ``policy`` strategies are in :mod:`.env`.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.backends.common.records import Record, RecordStore, machine_key, store_for, structural_key
from kiln.backends.cpu.schedules import strategy_schedule
from kiln.ir.loops.program import Program
from kiln.passes.schedule import Schedule

from . import space
from .measure import Measurer, compile_pool, default_workers, specialize

STRATEGIES = ("random", "evolutionary")


class Deadline:
    """The wall-clock budget of a search (seconds; ``None``: unlimited)."""

    def __init__(self, seconds: float | None):
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def expired(self) -> bool:
        return self.seconds is not None and self.elapsed() >= self.seconds


@dataclass
class Measured:
    trace: list[dict[str, Any]]
    time_s: float
    features: list[float] | None = None


@dataclass
class TuneResult:
    """What :func:`autotune` found: the best ``schedule`` (a legal, replayable
    :class:`~kiln.passes.schedule.Schedule` of the static program), its time and the default
    schedule's, and the counts of candidates (proposed, illegal, legal, duplicates, measured,
    wrong results, builds the C compiler rejected)."""

    program: Program
    schedule: Schedule
    time_s: float
    default_s: float
    unscheduled_s: float
    counts: dict[str, int] = field(default_factory=dict)
    history: list[Measured] = field(default_factory=list)
    key: str = ""
    elapsed_s: float = 0.0

    @property
    def speedup(self) -> float:
        """Default schedule's time over the tuned one's."""
        return self.default_s / self.time_s


def autotune(program: Program, params: Mapping[str, int | float] | None = None, budget_s: float | None = 60,
             *, strategy: str = "evolutionary", trials: int | None = None, kind: str = "elementwise",
             threads: int | None = None, seed: int = 0, batch: int = 8, workers: int | None = None,
             cost_model: Any = None, records: str | Path | RecordStore | None = None, repeat: int = 5,
             progress: bool = False, cache_dir: str | None = None) -> Schedule:
    """The fastest legal schedule found for ``program`` at the sizes ``params`` within
    ``budget_s`` seconds (and at most ``trials`` measured candidates); see :func:`tune`,
    which returns the whole :class:`TuneResult`.  The schedule replays with
    ``Schedule.replay(result.program, schedule.trace)``."""
    return tune(program, params, budget_s, strategy=strategy, trials=trials, kind=kind, threads=threads, seed=seed,
                batch=batch, workers=workers, cost_model=cost_model, records=records, repeat=repeat,
                progress=progress, cache_dir=cache_dir).schedule


def tune(program: Program, params: Mapping[str, int | float] | None = None, budget_s: float | None = 60, *,
         strategy: str = "evolutionary", trials: int | None = None, kind: str = "elementwise",
         threads: int | None = None, seed: int = 0, batch: int = 8, workers: int | None = None,
         cost_model: Any = None, records: str | Path | RecordStore | None = None, repeat: int = 5,
         progress: bool = False, cache_dir: str | None = None,
         on_measure: Callable[[Measured], None] | None = None) -> TuneResult:
    """Tune one kernel (module docstring).

    Args:
        program: a loop program (a kernel of a model, or ``kiln.loops.from_c``).
        params: values of its size parameters (the program is specialized to them, as the
            backend builds static kernels) and of its scalar parameters.
        budget_s: wall-clock seconds (``None``: no limit; then ``trials`` must be given).
        strategy: ``"random"`` or ``"evolutionary"``.
        trials: at most this many measured candidates (the default schedule not counted).
        kind: the kernel template whose default strategy is the baseline (``matmul``,
            ``conv``, ``reduction``, ``elementwise``...).
        threads: threads the schedules are planned and measured for (default: torch's).
        batch: candidates compiled together per round.
        workers: compiler processes (default: up to 4).
        cost_model: ``None``, ``"online"`` or a fitted :class:`.costmodel.CostModel` that
            ranks proposals (4x ``batch`` proposed per round, the best ``batch`` measured).
        records: a folder or :class:`RecordStore`: the result is appended as a record there
            (when it is legal and at least as fast as the default).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"autotune: unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)} "
                         "(the policy runs through kiln.tuning.autotune.env)")
    if budget_s is None and trials is None:
        raise ValueError("autotune: give a budget in seconds (budget_s=60) or a number of trials (trials=64)")
    if not isinstance(program, Program):
        raise TypeError(f"autotune: expected a kiln loop Program (kiln.loops.from_c or a model's kernel), "
                        f"got {type(program).__name__}")
    import torch  # noqa: PLC0415

    threads = int(threads or torch.get_num_threads())
    params = dict(params or {})
    static = specialize(program, {k: int(v) for k, v in params.items() if k in program.size_params})
    scalars = {p.name: float(params[p.name]) for p in static.params}
    missing = [p.name for p in static.params if p.name not in params]
    if missing:
        raise ValueError(f"autotune: program '{program.name}' needs values for its scalar parameter(s) {missing}")
    deadline = Deadline(budget_s)
    rng = random.Random(seed)
    ext = space.extents(static)
    pool = compile_pool(workers if workers is not None else default_workers())
    try:
        measurer = Measurer(static, scalars, seed=seed, repeat=repeat, pool=pool, cache_dir=cache_dir)
        return _search(static, kind, threads, strategy, trials, batch, cost_model, records, progress, deadline,
                       rng, ext, measurer, on_measure)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def _search(static: Program, kind: str, threads: int, strategy: str, trials: int | None, batch: int,
            cost_model: Any, records: Any, progress: bool, deadline: Deadline, rng: random.Random,
            ext: dict[str, int], measurer: Measurer, on_measure: Any, final_repeat: int = 7) -> TuneResult:
    from .features import features  # noqa: PLC0415

    default = strategy_schedule(static, kind, threads=threads)
    base_trace = list(default.trace)
    unscheduled_s, default_s = measurer.measure([static, space.build(static, base_trace).schedule.program(
        name=static.name)])
    if default_s is None or unscheduled_s is None:
        raise RuntimeError(f"autotune: the default schedule of '{static.name}' does not build or gives results "
                           f"that differ from the unscheduled program ({(measurer.wrong + measurer.failed)[-1:]}); "
                           "this is a kiln bug, please report it")
    counts = {"proposed": 0, "illegal": 0, "legal": 0, "duplicate": 0, "measured": 0, "wrong": 0, "failed": 0}
    seen = {json.dumps(base_trace, sort_keys=True), "[]"}
    population = [Measured(base_trace, default_s), Measured([], unscheduled_s)]
    history: list[Measured] = []
    model = _online_model() if cost_model == "online" else cost_model
    bar = _bar(progress, trials)
    while not deadline.expired() and (trials is None or counts["measured"] < trials):
        want = batch if trials is None else min(batch, trials - counts["measured"])
        proposals = []
        pool_size = want * (4 if model is not None and _ready(model) else 1)
        for _ in range(pool_size * 6):
            if len(proposals) >= pool_size or deadline.expired():
                break
            trace = _proposal(static, strategy, population, base_trace, ext, rng, explore=len(history) < 2 * batch)
            built = space.build(static, trace)
            counts["proposed"] += 1
            key = json.dumps(built.trace, sort_keys=True)
            if key in seen:
                counts["duplicate"] += 1
                continue
            seen.add(key)
            if not built.legal:
                counts["illegal"] += 1
                continue
            counts["legal"] += 1
            proposals.append(built)
        if not proposals:
            if deadline.expired() or counts["proposed"] > 50 * (counts["measured"] + 10):
                break
            continue
        programs = [b.schedule.program(name=static.name) for b in proposals]
        feats = [features(static, b.schedule, p) for b, p in zip(proposals, programs)]
        if model is not None and _ready(model) and len(proposals) > want:
            order = sorted(range(len(proposals)), key=lambda i: model.predict([feats[i]])[0])
            keep = order[:want]
            proposals, programs, feats = ([proposals[i] for i in keep], [programs[i] for i in keep],
                                          [feats[i] for i in keep])
        failed_before, wrong_before = len(measurer.failed), len(measurer.wrong)
        times = measurer.measure(programs)
        counts["failed"] += len(measurer.failed) - failed_before
        counts["wrong"] += len(measurer.wrong) - wrong_before
        for built, t, f in zip(proposals, times, feats):
            counts["measured"] += 1
            if t is None:
                continue
            m = Measured(built.trace, t, f)
            history.append(m)
            population.append(m)
            if on_measure is not None:
                on_measure(m)
        population.sort(key=lambda m: m.time_s)
        del population[16:]
        if model is not None and hasattr(model, "observe"):
            model.observe(history, default_s)
        _update_bar(bar, counts, default_s / population[0].time_s, trials)
    if bar is not None:
        bar.close()
    best = min(population, key=lambda m: m.time_s)
    schedule = Schedule.replay(static, best.trace)  # checked again, step by step, as the backend replays it
    if not schedule.verify():
        raise RuntimeError(f"autotune: the best schedule of '{static.name}' failed its re-check (a kiln bug)")
    default_program = space.build(static, base_trace).schedule.program(name=static.name)
    best_s, default_s = measurer.remeasure([schedule.program(name=static.name), default_program],
                                           repeat=max(3, final_repeat))
    if best_s > default_s:  # the search's winner does not hold up: keep the default
        schedule, best_s = Schedule.replay(static, base_trace), default_s
    key = structural_key(static)
    result = TuneResult(static, schedule, best_s, default_s, unscheduled_s, counts, history, key,
                        deadline.elapsed())
    store = records if isinstance(records, RecordStore) or records is None else store_for(records)
    if store is not None:
        store.add(Record(key, machine_key(threads), list(schedule.trace), best_s, default_s,
                         {"kernel": static.name, "kind": kind, "strategy": strategy, "threads": threads,
                          **{k: v for k, v in counts.items()}}))
    return result


def _proposal(program: Program, strategy: str, population: list[Measured], base: list, ext: dict[str, int],
              rng: random.Random, explore: bool = False) -> list:
    """A random trace (``"random"``; the evolutionary search's first two batches, which seed
    its population, and a fifth of its later proposals), else a child of the population."""
    if strategy == "random" or explore or len(population) < 2 or rng.random() < 0.2:
        start = base if rng.random() < 0.5 else []
        return space.random_trace(program, start, rng.randint(1, 4), ext, rng)
    top = population[: max(2, min(len(population), 6))]
    if rng.random() < 0.25:
        a, b = rng.sample(top, 2)
        return space.crossover(a.trace, b.trace, rng)
    parent = top[min(int(rng.expovariate(1.0)), len(top) - 1)]
    return space.mutate(program, parent.trace, ext, rng)


def _online_model() -> Any:
    from .costmodel import CostModel  # noqa: PLC0415

    return CostModel(online=True)


def _ready(model: Any) -> bool:
    return bool(getattr(model, "fitted", True))


def _bar(progress: bool, trials: int | None) -> Any:
    if not progress:
        return None
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return None
    return tqdm(total=trials, unit="cand", desc="autotune")


def _update_bar(bar: Any, counts: dict[str, int], best: float, trials: int | None) -> None:
    if bar is None:
        return
    bar.n = counts["measured"]
    bar.set_postfix_str(f"best {best:.2f}x, tried {counts['proposed']}, legal {counts['legal']}"
                        f", illegal {counts['illegal']}")
    bar.refresh()


__all__ = ["STRATEGIES", "Deadline", "Measured", "TuneResult", "autotune", "tune"]
