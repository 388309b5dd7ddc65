"""The ``kiln`` console command: one entry point, one subcommand per tool.

::

    kiln bench --quick                  # the benchmark harness (python -m benchmarks)
    kiln bench --models gpt2 --systems eager,kiln --threads 1
    kiln tune --backend tvm --trials 64 # MetaSchedule-tune the built-in models' kernels
    kiln tune-passes --out runs/rl      # train and evaluate a pass-ordering agent
    kiln zoo --models llama,swin        # the model-zoo sweep against eager (python -m kiln.zoo)

A subcommand is a :class:`Command`: a name, a one-line help, ``configure(parser)`` to declare
its options and ``run(args, rest)`` returning the exit status.  ``forward`` commands take
their arguments unparsed (``rest``) and hand them to a tool with its own parser, so
``kiln bench --help`` shows the harness's options.  New tools add a ``Command`` to
:data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    """One ``kiln`` subcommand."""

    name: str
    help: str
    run: Callable[[argparse.Namespace, list[str]], int]
    configure: Callable[[argparse.ArgumentParser], None] | None = None
    forward: bool = False  # pass the remaining arguments through unparsed


def _import_benchmarks() -> object:
    """The ``benchmarks`` package of a kiln source checkout.

    The harness lives beside the ``kiln`` package in the repository (it is not installed
    with kiln), so when it is not importable as is, the checkout that holds this kiln is tried.
    """
    try:
        return importlib.import_module("benchmarks.__main__")
    except ModuleNotFoundError as error:
        if error.name not in ("benchmarks", "benchmarks.__main__"):
            raise
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "benchmarks" / "harness.py").is_file():
        raise SystemExit(
            "kiln bench: the benchmark harness lives in the benchmarks/ folder of a kiln source "
            f"checkout and none was found beside this kiln ({checkout}); clone the repository and run "
            "`kiln bench` (or `python -m benchmarks`) from its root"
        )
    sys.path.insert(0, str(checkout))
    return importlib.import_module("benchmarks.__main__")


def _run_bench(args: argparse.Namespace, rest: list[str]) -> int:
    harness = _import_benchmarks()
    return int(harness.main(rest, prog="kiln bench"))  # type: ignore[attr-defined]


def _configure_tune(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="with --budget: a model to autotune for the cpu backend (a built-in model of "
                             "`python -m kiln`, or a benchmark workload such as mlp, gpt2 or gpt2-s128-b1)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of cpu schedule autotuning for MODEL (kiln.tuning.autotune; records in the "
                             "compile cache folder)")
    parser.add_argument("--backend", default="tvm", choices=["tvm", "cpu"],
                        help="backend whose kernels to tune (tvm: MetaSchedule; cpu: kiln's autotuner, needs "
                             "MODEL and --budget)")
    parser.add_argument("--models", default="all",
                        help="comma-separated built-in models of `python -m kiln` (default: all)")
    parser.add_argument("--trials", type=int, default=64,
                        help="MetaSchedule trials per model, all kernels together (default 64)")
    parser.add_argument("--cache-dir", default=None, help="compile cache folder (default: kiln's)")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: torch's)")


def _run_tune(args: argparse.Namespace, rest: list[str]) -> int:
    """Tune every kernel of the chosen built-in models with MetaSchedule; the records go to
    ``tvm_tuning/`` in the cache folder, where ``schedules="tuned"`` builds find them."""
    import time

    import kiln
    from kiln.compiler.demo import _models

    if args.budget is not None or args.backend == "cpu" or args.model is not None:
        return _run_autotune(args)
    if args.trials < 1:
        raise SystemExit("kiln tune: --trials must be at least 1")
    models = _models()
    wanted = None if args.models == "all" else {m.strip() for m in args.models.split(",")}
    known = [name for name, _, _ in models]
    if wanted is not None and not wanted <= set(known):
        raise SystemExit(f"kiln tune: unknown model(s) {', '.join(sorted(wanted - set(known)))}; "
                         f"known: {', '.join(known)}")
    options = {"schedules": "tuned", "tune_trials": args.trials, "cache_dir": args.cache_dir,
               "threads": args.threads}
    for index, (name, model, inputs) in enumerate(models):
        if wanted is not None and name not in wanted:
            continue
        print(f"[{index + 1}/{len(models)}] {name}: tuning with {args.trials} MetaSchedule trials ...", flush=True)
        start = time.perf_counter()
        compiled = kiln.compile(model, inputs, backend=args.backend, **options)
        notes = compiled.executable.info.get("tvm_notes", {})
        tuned = sum(note == "MetaSchedule record" for note in notes.values())
        print(f"[{index + 1}/{len(models)}] {name}: {tuned} of {len(notes)} kernels tuned in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return 0


def _run_autotune(args: argparse.Namespace) -> int:
    """``kiln tune MODEL --budget S``: autotune the loop schedules of MODEL's cpu kernels."""
    from kiln.compiler.demo import _models
    from kiln.tuning.autotune.model import tune_model

    if args.model is None or args.budget is None or args.budget <= 0:
        raise SystemExit("kiln tune: autotuning needs a model and a positive budget: kiln tune MODEL --budget 600")
    found = {name: (model, inputs) for name, model, inputs in _models()}
    if args.model not in found:
        _import_benchmarks()  # puts the checkout's benchmarks/ on the path
        models = importlib.import_module("benchmarks.models")
        workloads = {w.name: w for w in models.select_workloads()} | {
            w.model: w for w in reversed(models.select_workloads(list(models.MODELS), quick=True))}
        if args.model not in workloads:
            raise SystemExit(f"kiln tune: unknown model {args.model!r}; known: {', '.join([*found, *workloads])}")
        workload = workloads[args.model]
        found[args.model] = (workload.spec.build(), workload.inputs())
    model, inputs = found[args.model]
    print(f"kiln tune: {args.model}, {args.budget:.0f} s of schedule search ...", flush=True)
    result = tune_model(model, inputs, args.budget, cache_dir=args.cache_dir, threads=args.threads, progress=True)
    print(result.summary(), flush=True)
    return 0


def _run_tune_passes(args: argparse.Namespace, rest: list[str]) -> int:
    from kiln.tuning.rl.tune import main as tune_main

    return int(tune_main(rest, prog="kiln tune-passes"))


def _run_zoo(args: argparse.Namespace, rest: list[str]) -> int:
    from kiln.zoo.__main__ import main as zoo_main

    return int(zoo_main(rest, prog="kiln zoo"))


COMMANDS: list[Command] = [
    Command("bench", "benchmark kiln against PyTorch eager, Inductor, ONNX Runtime and TVM "
                     "(options: kiln bench --help)", _run_bench, forward=True),
    Command("tune", "tune the kernels of the built-in models for a backend (tvm: MetaSchedule, records in "
                    "the compile cache folder)", _run_tune, configure=_configure_tune),
    Command("tune-passes", "train a pass-ordering agent, evaluate it against the baselines, write a "
                           "report (options: kiln tune-passes --help)", _run_tune_passes, forward=True),
    Command("zoo", "run the model zoo (transformers families, hand-written nets) through kiln against "
                   "eager: inference, gradients, compile_train, fallback ops (options: kiln zoo --help)",
            _run_zoo, forward=True),
]


def build_parser() -> argparse.ArgumentParser:
    """The ``kiln`` parser with one subparser per :data:`COMMANDS` entry."""
    parser = argparse.ArgumentParser(prog="kiln", description="kiln, a deep-learning compiler for PyTorch "
                                                              "models: command-line tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help,
                                    add_help=not command.forward)
        if command.configure is not None:
            command.configure(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kiln`` console script; returns the exit status."""
    parser = build_parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    command = next(c for c in COMMANDS if c.name == args.command)
    if rest and not command.forward:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return command.run(args, rest)


if __name__ == "__main__":
    sys.exit(main())
