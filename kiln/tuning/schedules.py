"""Measured schedules of loop programs: the runtime of a program's generated C, and datasets
of (program, transformations, verdict, explanation, runtime) for research.

Both compile C (:func:`kiln.backends.cpu.native.compile_c`) and time it with the one
timing loop (:func:`kiln.runtime.timing.best_time`, through
:meth:`~kiln.backends.cpu.native.NativeKernel.time`).  The schedules themselves -- the
action space and the random sequences -- are :mod:`kiln.passes.schedule.research`.
``kiln.loops`` re-exports :func:`measure_runtime` and :func:`export_dataset`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from kiln.backends.cpu.native import compile_c
from kiln.ir.loops.interp import buffer_shape
from kiln.ir.loops.program import Program
from kiln.passes.schedule.research import random_legal_sequence, random_sequence


def random_arrays(program: Program, sizes: Mapping[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Uniform random arrays in ``[0, 1)`` for every global buffer of ``program`` at ``sizes``."""
    return {b.name: rng.random(buffer_shape(program, b.name, sizes)).astype(b.dtype.numpy)
            for b in program.buffers if b.scope == "global"}


def measure_runtime(program: Program, params: Mapping[str, int | float], seed: int = 0, repeat: int = 3) -> float:
    """Best wall time (seconds) of ``repeat`` runs of ``program``'s generated C on seeded
    random data, at the sizes and scalars ``params``."""
    kernel = compile_c(program)
    sizes = {p.name: int(params[p.name]) for p in program.params if p.dtype.is_integer}
    arrays = random_arrays(program, sizes, np.random.default_rng(seed))
    return kernel.time(params, arrays, repeat=repeat)


def export_dataset(programs: Mapping[str, Program] | Iterable[Program], path: str | Path,
                   sequences_per_program: int = 8, length: int = 3, seed: int = 0,
                   params: Mapping[str, Mapping[str, int | float]] | None = None, progress: bool = True,
                   legal_fraction: float = 0.5) -> int:
    """Write JSON lines ``{program, source, steps, legal, explanation, runtime_s,
    baseline_runtime_s}`` and return the number of records.

    About ``legal_fraction`` of the sequences are drawn among legal steps only, the others
    unchecked (so some are illegal).  ``params[name]`` gives the sizes to time program
    ``name``'s generated C with; runtimes are ``None`` for programs without sizes.
    """
    items = list(programs.items()) if isinstance(programs, Mapping) else [(p.name, p) for p in programs]
    jobs = [(name, prog, k) for name, prog in items for k in range(sequences_per_program)]
    bar = _progress(jobs, progress)
    rng = random.Random(seed)
    count = 0
    baselines: dict[str, float | None] = {}
    with open(path, "w") as fh:
        for name, prog, _ in bar:
            sizes = (params or {}).get(name)
            if name not in baselines:
                baselines[name] = measure_runtime(prog, sizes) if sizes else None
            sub_seed = rng.randrange(2**31)
            if rng.random() < legal_fraction:
                schedule = random_legal_sequence(prog, length, seed=sub_seed)
            else:
                schedule = random_sequence(prog, length, seed=sub_seed)
            verdict = schedule.verify()
            runtime = measure_runtime(schedule.program(), sizes) if sizes else None
            record = {"program": name, "source": str(prog), "steps": schedule.trace, "legal": verdict.legal,
                      "explanation": None if verdict.legal else verdict.explanation, "runtime_s": runtime,
                      "baseline_runtime_s": baselines[name]}
            fh.write(json.dumps(record) + "\n")
            count += 1
    return count


def _progress(items: list, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="schedules", unit="seq")


__all__ = ["export_dataset", "measure_runtime", "random_arrays"]
