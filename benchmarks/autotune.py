"""Autotuning schedules, measured in one run: per-kernel speedups of random and evolutionary
search over kiln's default schedules, the cost model's rank correlation on held-out kernels,
a MaskablePPO policy against both, and model latency after ``tune_model``.

::

    python -m benchmarks.autotune --trials 48 --rl-seconds 300 --model-budget 120 \\
        --update-docs docs/tuning.md --out runs/autotune.json

Every figure comes from this process; ``--update-docs`` rewrites the block between the
``autotune-benchmark`` markers of the given file.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import kiln
import kiln.loops as kl
from kiln.runtime.timing import best_time
from kiln.tuning.autotune import tune
from kiln.tuning.autotune.costmodel import CostModel, rank_correlation
from kiln.tuning.autotune.model import model_kernels, tune_model

ROOT = Path(__file__).resolve().parents[1]
POLY = ROOT / "tests" / "polybench"
POLY_SIZES = {
    "gemm": dict(NI=192, NJ=192, NK=192, alpha=1.5, beta=1.2),
    "2mm": dict(NI=128, NJ=128, NK=128, NL=128, alpha=1.5, beta=1.2),
    "atax": dict(M=1024, N=1024),
    "mvt": dict(N=1024),
    "syrk": dict(N=160, M=160, alpha=1.5, beta=1.2),
    "jacobi-2d": dict(T=8, N=256),
    "heat-3d": dict(T=4, N=40),
}
POLY_TRAIN_SIZES = {
    "bicg": dict(M=512, N=512),
    "trmm": dict(M=128, N=128, alpha=1.5),
    "fdtd-2d": dict(TMAX=4, NX=128, NY=128),
    "seidel-2d": dict(T=2, N=128),
    "conv2d": dict(H=256, W=256),
    "jacobi-1d": dict(T=16, N=4096),
}
"""PolyBench kernels the policy also trains on (never in the kernel table, never held out)."""


STAGE_NAMES = {"fitted": "the fit to the demonstrations", "dagger": "DAgger"}


def poly_kernel(name: str) -> kl.Program:
    return kl.from_c((POLY / f"{name}.c").read_text(), name="pb_" + name.replace("-", "_"))


def policy_corpus(train: list[tuple[kl.Program, dict, str]], extra: bool) -> list[tuple[kl.Program, dict, str]]:
    """The policy's training kernels: ``train`` and, with ``extra``, the
    :data:`POLY_TRAIN_SIZES` kernels, then every training PolyBench kernel also at half and
    twice its sizes (time steps kept)."""
    if not extra:
        return list(train)
    poly = [(poly_kernel(name), sizes, "elementwise") for name, sizes in POLY_TRAIN_SIZES.items()]
    poly += [(p, params, kind) for p, params, kind in train if params]
    scaled = [(p, {k: (max(4, int(v * f)) if isinstance(v, int) and k not in ("T", "TMAX") else v)
                   for k, v in params.items()}, kind) for f in (0.5, 2.0) for p, params, kind in poly]
    return [*train, *poly[: len(POLY_TRAIN_SIZES)], *scaled]


@functools.lru_cache(maxsize=1)
def kernel_set() -> list[tuple[str, kl.Program, dict, str]]:
    """Model kernels (generated GEMM, conv, norms, softmax, a reduction) and PolyBench ones."""
    torch.manual_seed(0)
    modules = [
        ("gemm 128x256x256 +bias", torch.nn.Linear(256, 256), torch.randn(128, 256)),
        ("gemm 64x768x768 +bias", torch.nn.Linear(768, 768), torch.randn(64, 768)),
        ("conv 16->16 3x3 32x32", torch.nn.Conv2d(16, 16, 3, padding=1), torch.randn(1, 16, 32, 32)),
        ("layer_norm 128x768", torch.nn.LayerNorm(768), torch.randn(128, 768)),
        ("softmax 128x512", torch.nn.Softmax(-1), torch.randn(128, 512)),
    ]
    out = []
    for name, module, x in modules:
        kernels = model_kernels(module.eval(), (x,), threads=torch.get_num_threads(),
                                options={"select": "generated"})
        program, kind, _ = max(kernels, key=lambda k: len(k[0].loops()))
        out.append((name, program, {}, kind))

    class RowSum(torch.nn.Module):
        def forward(self, x):
            return (x * x).sum(-1)

    program, kind, _ = model_kernels(RowSum(), (torch.randn(256, 1024),), threads=torch.get_num_threads())[0]
    out.append(("sum of squares 256x1024", program, {}, kind))
    for name, sizes in POLY_SIZES.items():
        out.append((f"polybench {name}", poly_kernel(name), sizes, "elementwise"))
    return out


def _now() -> float:
    return time.monotonic()


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def run_kernels(args: argparse.Namespace, rows: list[dict[str, Any]], dataset: list[dict[str, Any]],
                failed: list[dict[str, Any]]) -> None:
    for index, (name, program, params, kind) in enumerate(kernel_set()):
        row: dict[str, Any] = {"kernel": name, "kind": kind}
        for strategy in ("random", "evolutionary"):
            def keep(m, strategy=strategy, index=index):
                dataset.append({"kernel": index, "strategy": strategy, "features": m.features, "time_s": m.time_s})

            start = _now()
            try:
                r = tune(program, params, budget_s=args.kernel_seconds, trials=args.trials, strategy=strategy,
                         kind=kind, seed=index, on_measure=keep)
            except (RuntimeError, ValueError) as e:  # reported, and the run goes on
                row[strategy] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                print(f"{name} ({strategy}): {row[strategy]['error']}", flush=True)
                continue
            row[strategy] = {"speedup": r.speedup, "time_s": r.time_s, "default_s": r.default_s,
                             "unscheduled_s": r.unscheduled_s, "counts": r.counts, "seconds": _now() - start,
                             "trace": r.schedule.trace}
            for d in dataset:
                if d["kernel"] == index and d["strategy"] == strategy and "default_s" not in d:
                    d["default_s"] = r.default_s
        row["program"], row["params"] = str(program), params
        if any("error" in row[k] for k in ("random", "evolutionary")):
            failed.append(row)
            continue
        rows.append(row)
        print(f"{name}: random {row['random']['speedup']:.2f}x, evolutionary {row['evolutionary']['speedup']:.2f}x "
              f"(illegal pruned {row['random']['counts']['illegal']} + {row['evolutionary']['counts']['illegal']})",
              flush=True)


def cost_model_figures(dataset: list[dict[str, Any]], n_kernels: int) -> dict[str, Any]:
    """Two-fold leave-kernels-out: train on the even kernels, test on the odd ones, and back."""
    per_kernel, pooled_pred, pooled_true = [], [], []
    for fold in (0, 1):
        train = [d for d in dataset if d["kernel"] % 2 == fold]
        test = [d for d in dataset if d["kernel"] % 2 != fold]
        model = CostModel().fit([d["features"] for d in train], [math.log2(d["default_s"] / d["time_s"])
                                                                 for d in train])
        for k in sorted({d["kernel"] for d in test}):
            rows = [d for d in test if d["kernel"] == k]
            if len(rows) < 5:
                continue
            pred = model.predict_speedup([d["features"] for d in rows])
            true = [math.log2(d["default_s"] / d["time_s"]) for d in rows]
            per_kernel.append(rank_correlation(pred, true))
            pooled_pred += list(pred)
            pooled_true += true
    return {"backend": CostModel().backend, "samples": len(dataset), "kernels": n_kernels,
            "mean_per_kernel_spearman": sum(per_kernel) / len(per_kernel) if per_kernel else float("nan"),
            "pooled_spearman": rank_correlation(pooled_pred, pooled_true) if len(pooled_true) > 1 else float("nan")}


def run_policy(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.callbacks import BaseCallback

    from kiln.tuning.autotune.env import ScheduleKernelEnv
    from kiln.tuning.autotune.imitation import clone, dagger, demonstrations
    from kiln.tuning.autotune.measure import compile_pool
    from kiln.tuning.autotune.policy import SlotPolicy

    kernels = kernel_set()
    train = policy_corpus([(p, params, kind) for i, (_, p, params, kind) in enumerate(kernels) if i % 2 == 0],
                          args.rl_extra)
    held = [(i, name, p, params, kind) for i, (name, p, params, kind) in enumerate(kernels) if i % 2 == 1]
    start = time.monotonic()
    deadline = start + args.rl_seconds
    env = ScheduleKernelEnv(train, max_steps=6, threads=torch.get_num_threads(), start=args.rl_start,
                            pool=compile_pool(2))

    class Stop(BaseCallback):
        def _on_step(self) -> bool:
            return time.monotonic() < deadline

    agent = MaskablePPO(SlotPolicy, env, n_steps=48, batch_size=48, n_epochs=4, ent_coef=args.rl_entropy, seed=0,
                        verbose=0)
    out: dict[str, Any] = {"start": args.rl_start, "train_kernels": len(train), "samples": args.rl_samples,
                           "kernels": []}
    evaluate = ScheduleKernelEnv([(p, params, kind) for _, _, p, params, kind in held], max_steps=6,
                                 threads=torch.get_num_threads(), start=args.rl_start)

    def policy(obs, mask, deterministic):
        return int(agent.predict(obs, action_masks=mask, deterministic=deterministic)[0])

    def held_out() -> list[dict[str, Any]]:
        torch.manual_seed(0)  # the sampled episodes
        return [evaluate.rollouts(policy, j, samples=args.rl_samples) for j in range(len(held))]

    stages: dict[str, list[dict[str, Any]]] = {}
    if args.rl_clone:
        demos = demonstrations(env)
        out["demonstration_measurements"] = sum(d.measurements for d in demos)
        out["clone_error"] = clone(agent, demos)
        out["demonstration_seconds"] = time.monotonic() - start
        print(f"{len(demos)} demonstrations ({out['demonstration_measurements']} measurements) in "
              f"{out['demonstration_seconds']:.0f} s", flush=True)
        stages["fitted"] = held_out()
        if args.rl_dagger:
            data = dagger(env, agent, demos, rounds=args.rl_dagger)
            out["dagger_measurements"] = sum(d.measurements for d in data) - out["demonstration_measurements"]
            out["dagger_seconds"] = time.monotonic() - start - out["demonstration_seconds"]
            print(f"DAgger: {args.rl_dagger} rounds, {out['dagger_measurements']} measurements in "
                  f"{out['dagger_seconds']:.0f} s", flush=True)
            stages["dagger"] = held_out()
    if args.rl_ppo and time.monotonic() < deadline:
        agent.learn(total_timesteps=100_000, callback=Stop())
    out["train_seconds"], out["train_steps"] = time.monotonic() - start, int(agent.num_timesteps)
    final = held_out() if args.rl_ppo or not stages else list(stages.values())[-1]
    for j, ((i, name, *_rest), r) in enumerate(zip(held, final)):
        evo = rows[i]["evolutionary"]
        out["kernels"].append({"kernel": name, "policy": r["speedup"], "policy_with_fallback": max(1.0, r["speedup"]),
                               "deterministic": r["deterministic"], "measurements": r["measurements"],
                               "stages": {k: v[j]["speedup"] for k, v in stages.items()},
                               "evolutionary": evo["speedup"], "evolutionary_measurements": evo["counts"]["measured"],
                               "trace": r["trace"]})
        print(f"policy on {name}: {r['speedup']:.2f}x with {r['measurements']} measurements, deterministic "
              f"{r['deterministic']:.2f}x, stages {out['kernels'][-1]['stages']} "
              f"(evolutionary {evo['speedup']:.2f}x)", flush=True)
    return out


def run_models(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT))
    from benchmarks.models import MODELS, Workload, select_workloads
    from kiln.compiler.demo import _models

    chosen: list[tuple[str, torch.nn.Module, tuple]] = []
    demo = {name: (m, x) for name, m, x in _models()}
    workloads = {w.name: w for w in select_workloads(list(MODELS), quick=True)}
    for name in args.models.split(","):
        if name in demo:
            chosen.append((name, *demo[name]))
        else:
            w: Workload = workloads[name]
            chosen.append((name, w.spec.build(), w.inputs()))
    out = []
    for name, model, inputs in chosen:
        model.eval()
        with tempfile.TemporaryDirectory(prefix="kiln-autotune-") as folder:
            default = kiln.compile(model, inputs, backend="cpu", cache_dir=folder)
            start = _now()
            result = tune_model(model, inputs, args.model_budget, cache_dir=folder)
            tuned_s = _now() - start
            tuned = kiln.compile(model, inputs, backend="cpu", cache_dir=folder)
            with torch.no_grad():
                err = float((tuned(*inputs) - model(*inputs)).abs().max())
                times = {"default": float("inf"), "tuned": float("inf")}
                for _ in range(5):  # alternate, keep each one's best
                    for key, compiled in (("default", default), ("tuned", tuned)):
                        times[key] = min(times[key], best_time(lambda c=compiled: c(*inputs), repeat=10, warmup=2))
        out.append({"model": name, "default_s": times["default"], "tuned_s": times["tuned"],
                    "gain": 1 - times["tuned"] / times["default"], "tune_seconds": tuned_s,
                    "kernels": result.kernels, "tuned_kernels": len(result.results),
                    "kernel_speedups": {k: r.speedup for k, r in result.results.items()}, "max_abs_error": err})
        print(f"{name}: {times['default'] * 1e3:.3f} -> {times['tuned'] * 1e3:.3f} ms "
              f"({out[-1]['gain'] * 100:+.1f}%), {len(result.results)}/{result.kernels} kernels tuned", flush=True)
    return out


def markdown(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [f"Measured by `python -m benchmarks.autotune {a['argv']}` on {report['machine']}, "
             f"{report['threads']} threads, in one run of {report['seconds'] / 60:.1f} minutes.", "",
             "| kernel | kind | unscheduled (ms) | default (ms) | random | evolutionary | illegal pruned (random + evo) "
             "| rejected by the C compiler |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["kernels"]:
        ra, ev = r["random"], r["evolutionary"]
        lines.append(f"| {r['kernel']} | {r['kind']} | {ev['unscheduled_s'] * 1e3:.3f} | {ev['default_s'] * 1e3:.3f} | "
                     f"{ra['speedup']:.2f}x | {ev['speedup']:.2f}x | {ra['counts']['illegal']} + "
                     f"{ev['counts']['illegal']} of {ra['counts']['proposed']} + {ev['counts']['proposed']} | "
                     f"{ra['counts']['failed'] + ev['counts']['failed']} |")
    for r in report.get("failed_kernels", []):
        why = "; ".join(r[k]["error"] for k in ("random", "evolutionary") if "error" in r[k])
        lines.append(f"| {r['kernel']} | {r['kind']} | failed: {why} | | | | | |")
    lines += ["", f"Geomean over {len(report['kernels'])} kernels: random {report['geomean_random']:.2f}x, "
                  f"evolutionary {report['geomean_evolutionary']:.2f}x over kiln's default schedules "
                  f"({a['trials']} measured candidates per kernel and strategy, at most {a['kernel_seconds']} s)."]
    cm = report.get("cost_model")
    if cm:
        lines += ["", f"Cost model ({cm['backend']}, {cm['samples']} measured schedules, two-fold leave-kernels-out): "
                      f"Spearman rank correlation with the measured speedup on held-out kernels "
                      f"{cm['mean_per_kernel_spearman']:.2f} (mean per kernel), {cm['pooled_spearman']:.2f} (pooled)."]
    rl = report.get("policy")
    if rl:
        begin = ("kiln's default schedule" if rl.get("start") == "default" else "the unscheduled program")
        extra = rl.get("train_kernels", 7) - 7
        corpus = "the even-numbered kernels" + (
            f" and {extra} more (PolyBench {', '.join(POLY_TRAIN_SIZES)}, and the training PolyBench kernels at half "
            "and twice their sizes)" if extra > 0 else "")
        steps = []
        if "demonstration_seconds" in rl:
            steps.append(f"fitted to measured greedy demonstrations ({rl['demonstration_measurements']} measurements, "
                         f"{rl['demonstration_seconds']:.0f} s)")
        if "dagger_seconds" in rl:
            steps.append(f"DAgger ({rl['dagger_measurements']} measurements, {rl['dagger_seconds']:.0f} s)")
        if rl["train_steps"]:
            steps.append(f"PPO ({rl['train_steps']} steps)")
        lines += ["", f"MaskablePPO policy (`SlotPolicy`) on {rl['train_kernels']} kernels, {corpus}: "
                      f"{', then '.join(steps)}; {rl['train_seconds']:.0f} s in all, episodes starting "
                      f"from {begin}; evaluated on the odd-numbered ones with "
                      f"{rl['samples']} episodes each (the first deterministic, the others sampled from the "
                      "policy; every distinct final schedule measured, the fastest timed again against the "
                      "default):", "",
                  "| held-out kernel | policy | measurements | deterministic episode alone | "
                  "policy, default as fallback | " + "".join(f"after {STAGE_NAMES[k]} | " for k in rl["stage_geomeans"])
                  + "evolutionary (measurements) |",
                  "|---|---|---|---|---|" + "---|" * len(rl["stage_geomeans"]) + "---|"]
        for k in rl["kernels"]:
            lines.append(f"| {k['kernel']} | {k['policy']:.2f}x | {k['measurements']} | {k['deterministic']:.2f}x | "
                         f"{k['policy_with_fallback']:.2f}x | " + "".join(f"{v:.2f}x | " for v in k["stages"].values())
                         + f"{k['evolutionary']:.2f}x ({k['evolutionary_measurements']}) |")
        lines += ["", f"Geomean: policy {rl['geomean_policy']:.2f}x, deterministic episode alone "
                      f"{rl['geomean_deterministic']:.2f}x, with fallback {rl['geomean_fallback']:.2f}x, "
                      + "".join(f"after {STAGE_NAMES[k]} {v:.2f}x, " for k, v in rl["stage_geomeans"].items()) +
                      f"evolutionary {rl['geomean_evolutionary']:.2f}x "
                      f"(policy / evolutionary: {rl['geomean_policy'] / rl['geomean_evolutionary'] * 100:.0f}%)."]
    models = report.get("models")
    if models:
        lines += ["", "| model | default (ms) | tuned (ms) | change | kernels tuned | tuning time (s) |",
                  "|---|---|---|---|---|---|"]
        for m in models:
            lines.append(f"| {m['model']} | {m['default_s'] * 1e3:.3f} | {m['tuned_s'] * 1e3:.3f} | "
                         f"{-m['gain'] * 100:+.1f}% | {m['tuned_kernels']} of {m['kernels']} | {m['tune_seconds']:.0f} |")
    return "\n".join(lines)


def update_docs(path: Path, text: str) -> None:
    start, end = "<!-- autotune-benchmark:start -->", "<!-- autotune-benchmark:end -->"
    doc = path.read_text()
    if start in doc and end in doc:
        doc = doc[: doc.index(start) + len(start)] + "\n" + text + "\n" + doc[doc.index(end):]
    else:
        doc += f"\n{start}\n{text}\n{end}\n"
    path.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.autotune", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=48, help="measured candidates per kernel and strategy")
    parser.add_argument("--kernel-seconds", type=float, default=60, help="at most this long per kernel and strategy")
    parser.add_argument("--rl-seconds", type=float, default=300, help="MaskablePPO training time (0: skip)")
    parser.add_argument("--rl-start", choices=("default", "unscheduled"), default="default",
                        help="where the policy's episodes start: kiln's default schedule or the unscheduled program")
    parser.add_argument("--rl-samples", type=int, default=4,
                        help="episodes (and at most as many measurements) per held-out kernel: the first deterministic")
    parser.add_argument("--rl-entropy", type=float, default=0.01, help="MaskablePPO's entropy bonus (ent_coef)")
    parser.add_argument("--rl-extra", action=argparse.BooleanOptionalAction, default=True,
                        help="train the policy on more PolyBench kernels and sizes as well (policy_corpus)")
    parser.add_argument("--rl-clone", action=argparse.BooleanOptionalAction, default=True,
                        help="fit the policy to measured greedy demonstrations before PPO (imitation.clone)")
    parser.add_argument("--rl-dagger", type=int, default=1, help="DAgger rounds after the fit (imitation.dagger)")
    parser.add_argument("--rl-ppo", action=argparse.BooleanOptionalAction, default=True,
                        help="spend what is left of --rl-seconds on PPO after the fit")
    parser.add_argument("--models", default="tiny-mlp-b16,transformer block,mlp-b1")
    parser.add_argument("--model-budget", type=float, default=120, help="tune_model budget per model (0: skip)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--update-docs", default=None, help="rewrite the autotune-benchmark block of this file")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads the schedules plan for and the kernels run with (OMP_NUM_THREADS; default 1: "
                             "on a shared machine, parallel regions time the other tenants)")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before any OpenMP kernel is loaded
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    dataset: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    run_kernels(args, rows, dataset, failed)
    report: dict[str, Any] = {"args": {**vars(args), "argv": " ".join(argv if argv is not None else sys.argv[1:])},
                              "machine": f"{platform.machine()} ({platform.processor() or 'unknown CPU'})",
                              "threads": torch.get_num_threads(), "kernels": rows,
                              "geomean_random": geomean([r["random"]["speedup"] for r in rows]),
                              "geomean_evolutionary": geomean([r["evolutionary"]["speedup"] for r in rows]),
                              "failed_kernels": failed}
    report["cost_model"] = cost_model_figures([d for d in dataset if d["features"]], len(rows))
    print(json.dumps(report["cost_model"]), flush=True)
    if args.rl_seconds > 0:
        rl = run_policy(args, rows)
        rl["geomean_policy"] = geomean([k["policy"] for k in rl["kernels"]])
        rl["geomean_fallback"] = geomean([k["policy_with_fallback"] for k in rl["kernels"]])
        rl["geomean_deterministic"] = geomean([k["deterministic"] for k in rl["kernels"]])
        rl["stage_geomeans"] = {stage: geomean([k["stages"][stage] for k in rl["kernels"]])
                                for stage in (rl["kernels"][0]["stages"] if rl["kernels"] else {})}
        rl["geomean_evolutionary"] = geomean([k["evolutionary"] for k in rl["kernels"]])
        report["policy"] = rl
    if args.model_budget > 0:
        report["models"] = run_models(args)
    report["seconds"] = time.monotonic() - start
    text = markdown(report)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    if args.update_docs:
        update_docs(Path(args.update_docs), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
