"""Timing: the one measurement loop every timer in kiln uses.

Timed implementation selection (a backend choosing between a library call and a generated
kernel), the GEMM tuner, the native-kernel timer of loop programs, the per-step profile of
a call plan, the measured costs of :mod:`kiln.tuning` and the schedule research all call
:func:`best_time`, so they agree on what "the time of a call" means: the minimum (or the
median) over ``repeat`` rounds of ``number`` calls each, after ``warmup`` untimed calls.

It lives in the runtime -- the lowest layer that runs code -- so backends may time
candidates while they build; :mod:`kiln.tuning.measure` re-exports it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

STATISTICS = ("min", "median")


def best_time(run: Callable[[], Any], *, repeat: int = 5, warmup: int = 1, number: int = 1,
              statistic: str = "min", clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call of ``run()``.

    Calls ``run`` ``warmup`` times untimed, then times ``repeat`` rounds of ``number``
    consecutive calls and returns the ``statistic`` (``"min"``, the default, or
    ``"median"``) of the per-call time of each round.  The minimum is the estimate least
    disturbed by other work on the machine; the median is what a benchmark reports.
    """
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; choose one of {', '.join(STATISTICS)}")
    if repeat < 1 or number < 1 or warmup < 0:
        raise ValueError(f"best_time needs repeat >= 1, number >= 1 and warmup >= 0; got "
                         f"repeat={repeat}, number={number}, warmup={warmup}")
    for _ in range(warmup):
        run()
    rounds = []
    for _ in range(repeat):
        start = clock()
        for _ in range(number):
            run()
        rounds.append((clock() - start) / number)
    return min(rounds) if statistic == "min" else statistics.median(rounds)


__all__ = ["STATISTICS", "best_time"]
