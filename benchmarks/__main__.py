"""``python -m benchmarks`` (also ``kiln bench``): run the benchmark and write the report."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .harness import DEFAULT_OUT, BenchConfig, run
from .models import MODELS, select_workloads
from .systems import SYSTEM_NAMES, make_systems
from .train_bench import make_train_systems, run_train, select_train_workloads

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TVM_NUM_THREADS")


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's command-line options, on ``parser``."""
    parser.add_argument("--models", type=_names, default=None,
                        help=f"comma-separated models (default: all but tiny-mlp): {', '.join(MODELS)}; "
                             "'seeds' for the seed workloads of benchmarks/workloads (seed-* names one)")
    parser.add_argument("--systems", type=_names, default=None,
                        help=f"comma-separated systems (default: all): {', '.join(SYSTEM_NAMES)}")
    parser.add_argument("--quick", action="store_true",
                        help="small subset, 10 timed calls per round, 3 s budget: under two minutes")
    parser.add_argument("--runs", type=int, default=None, help="timed calls per system per round (default 20)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per system (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (default 2)")
    parser.add_argument("--budget", type=float, default=None, dest="budget_s",
                        help="seconds of calls per system per round before it stops early (default 20)")
    parser.add_argument("--block", type=int, default=None,
                        help="timed calls per turn of the round-robin (default: all of a round's calls; "
                             "1: interleave call by call)")
    parser.add_argument("--settle", type=float, default=0.2, dest="settle_s",
                        help="pause in seconds before each turn, for the previous system's threads to idle")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for every system (torch, Inductor, ORT, BLAS, OpenMP); default: each "
                             "library's own. Use 1 on a machine shared with other work")
    parser.add_argument("--kiln-backend", default=None,
                        help="kiln backend (default: 'cpu' when registered, else kiln's default)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="output folder for results.md/.json/.png (default: benchmarks/results)")
    parser.add_argument("--train", action="store_true",
                        help="time whole training steps (forward, loss, backward, AdamW) instead of inference: "
                             "models mlp, gpt2 (and the seed workloads: 'seeds', seed-*); systems eager, inductor, kiln, "
                             "kiln-remat, kiln-unfused, "
                             "kiln-unfused-remat, kiln-cpu; output in OUT/train")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` of parsed command-line options."""
    return BenchConfig(models=args.models, systems=args.systems, quick=args.quick, runs=args.runs,
                       warmup=args.warmup, rounds=args.rounds, budget_s=args.budget_s, block=args.block,
                       settle_s=args.settle_s, threads=args.threads, out=args.out,
                       kiln_backend=args.kiln_backend, progress=not args.no_progress, plot=not args.no_plot)


def _restart_with_threads(threads: int, argv: Sequence[str]) -> None:
    """Restart as ``python -m benchmarks ARGV`` with every thread-count variable set.

    BLAS and OpenMP runtimes read their thread counts once, when loaded, and numpy's BLAS is
    loaded by now (kiln and torch import numpy): only a new process sees new values.
    """
    env = dict(os.environ)
    env.update({name: str(threads) for name in THREAD_VARIABLES})
    env["KILN_BENCH_THREADS"] = str(threads)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *argv], env)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv``, run the benchmark, print where the outputs are."""
    parser = argparse.ArgumentParser(prog=prog or "python -m benchmarks",
                                     description="Benchmark kiln against PyTorch eager, Inductor, "
                                                 "ONNX Runtime and TVM on CPU.")
    add_arguments(parser)
    parser.add_argument("--dynamic", action="store_true",
                        help="the variable-length serving benchmark (compile counts and total time over a "
                             "stream of lengths); see benchmarks/dynamic_bench.py and its --help")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dynamic" in argv:
        from .dynamic_bench import main as dynamic_main

        return dynamic_main(argv)
    args = parser.parse_args(argv)
    try:  # unknown names fail here, before anything slow
        if args.train:
            select_train_workloads(args.models)
            make_train_systems(args.systems, kiln_backend=args.kiln_backend)
        else:
            select_workloads(args.models, quick=args.quick)
            make_systems(args.systems, kiln_backend=args.kiln_backend)
    except ValueError as error:
        parser.error(str(error))
    if args.threads and os.environ.get("KILN_BENCH_THREADS") != str(args.threads):
        _restart_with_threads(args.threads, argv)
    document = (run_train if args.train else run)(config_from_args(args))
    for kind, path in document.get("files", {}).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
