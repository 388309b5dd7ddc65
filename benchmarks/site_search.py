"""The search ceiling of per-site fusion decisions (``kiln/FusionSites-v0``), measured.

For each model (none of them in the pass-ordering corpus, :mod:`kiln.tuning.rl.corpus`) the
graph's merge sites (:class:`kiln.tuning.rl.sites.FusionSites`) are answered by decision
vectors -- all-merge (the default pipeline), none-merge, every single-site flip of the
default (or a sample of them), random subsets -- each built by the cpu backend and timed
against the default pipeline's executable in interleaved rounds (screening); the best
``--finalists`` are then timed again, all together with the default and a second build of the
default (the noise), for ``--final-rounds`` interleaved rounds.  Every candidate's outputs are
compared with the default's.  Optionally (``--ppo-steps``) MaskablePPO is trained on the
environment with the measured reward for that many steps of one model and compared with
random search given the same number of distinct measured vectors.

::

    python -m benchmarks.site_search --budget 48 --screen-rounds 5 --ppo-steps 12288 --out /tmp/site_search.json

``--kind duplicate|layout|remat`` searches another per-site action kind
(:mod:`kiln.tuning.rl.site_kinds`) the same way: all yes, (remat) the minimum cut's choice,
single sites answered yes, random vectors; screening, then the finalists and a second build
of the default in interleaved final rounds.  A vector's score is its time ratio minus
``--memory-weight`` (default 1 for remat, else 0) times the relative change of the cpu
backend's planned peak; ``remat`` searches each model's training graph (forward and backward
of the mean square of its output).  ``--ppo-steps`` applies to ``fuse`` only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.runtime.timing import best_time
from kiln.tuning.rl.sites import FusionSites, SiteTimer, median


# ------------------------------------------------------------------------------ models
def _zoo(name: str) -> Callable[[], tuple]:
    def build() -> tuple:
        import kiln.zoo.models  # noqa: F401  (registers the entries)
        from kiln.zoo.registry import ZOO

        return ZOO[name].build()

    return build


def _llama_wide() -> tuple:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.zoo.hf_text import VOCAB, lm

    config = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=344, vocab_size=VOCAB, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return lm(LlamaForCausalLM, config)


MODELS: dict[str, Callable[[], tuple]] = {
    "llama": _zoo("llama"),            # kiln.zoo: GQA, rotary, RMS norm, SwiGLU (hidden 32)
    "llama-wide": _llama_wide,         # the same architecture at hidden 128, MLP 344
    "mobilenet_v2": _zoo("mobilenet_v2"),  # kiln.zoo: depthwise convs, inverted residuals, ReLU6
    "swin": _zoo("swin"),              # kiln.zoo: shifted-window attention, patch merging
    "regnet": _zoo("regnet"),          # kiln.zoo: grouped convs, squeeze-excitation, batch norm
    "dilated_cnn": _zoo("dilated_cnn"),  # kiln.zoo: dilated convs, ASPP, bilinear upsampling, batch norm
    "conv3d": _zoo("conv3d"),          # kiln.zoo: 3-d convs, batch norm, pooling
}
"""Models outside the pass-ordering corpus (whose families are gpt2, bert, cnn = ResNet-18 and
a small CNN, mlp, decomposed, training, random; held out: opt, distilbert, convnext)."""


def capture_model(name: str, training: bool = False):
    """The captured graph of a model; with ``training``, the joint forward + backward graph of
    its :class:`~kiln.tuning.rl.zoo.ScalarLoss` (``kiln.passes.autodiff.grad_graph``)."""
    from kiln.frontends.torch.capture import capture

    model, args = MODELS[name]()
    if not training:
        return capture(model.eval(), tuple(args)).graph
    from kiln.passes.autodiff import grad_graph
    from kiln.tuning.rl.zoo import ScalarLoss

    return grad_graph(capture(ScalarLoss(model.eval()), tuple(args)).graph).graph


# ------------------------------------------------------------------------------ candidates
def pair_type(site) -> str:
    return f"{site.producer.op_name}->{site.consumer.op_name}"


def candidates(sites: FusionSites, budget: int, rng: np.random.Generator) -> list[tuple[str, tuple[bool, ...]]]:
    """``(label, decisions)``: none-merge; for each (producer op, consumer op) type of the
    default walk's sites, every site of that type declined; single-site flips of the default
    (all of them if they fit in half the remaining budget, else a sample); then random
    subsets (merge probability 0.5 and 0.9 alternately) up to ``budget``."""
    n_sites = sites.default_sites
    out: list[tuple[str, tuple[bool, ...]]] = [("none", sites.answers(lambda s: False))]
    walk, default_types = [], []
    while (site := sites.site(walk)) is not None:
        default_types.append(pair_type(site))
        walk.append(True)
    for kind in dict.fromkeys(default_types):
        out.append((f"no {kind}", sites.answers(lambda s, kind=kind: pair_type(s) != kind)))
    flips = list(range(n_sites))
    room = max(0, budget - len(out))
    if len(flips) > room // 2:
        flips = sorted(rng.choice(n_sites, size=room // 2, replace=False).tolist())
    out += [(f"flip {i}", (True,) * i + (False,)) for i in flips]
    k = 0
    while len(out) < budget:
        p = 0.5 if k % 2 == 0 else 0.9
        out.append((f"random p={p}", sites.answers(lambda s, p=p: rng.random() < p)))
        k += 1
    return out[:budget]


def outputs_match(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=1e-3, atol=1e-4) for x, y in zip(a, b))


# ------------------------------------------------------------------------------ one model
def search_model(name: str, *, budget: int, screen_rounds: int, finalists: int, final_rounds: int,
                 timer: SiteTimer, seed: int, log: Callable[[str], None], policy: Any = None) -> dict[str, Any]:
    graph = capture_model(name)
    sites = FusionSites(graph, name=name)
    default_graph = sites.default_graph()
    same = str(sites.graph(())) == str(default_graph)
    rng = np.random.default_rng(seed)
    default_run = timer.build(default_graph)
    reference = default_run()
    log(f"{name}: {len(sites.pre.nodes)} nodes before fuse, {sites.default_sites} merge sites, "
        f"all-merge graph == default pipeline: {same}")
    seen: dict[tuple[bool, ...], dict[str, Any]] = {}
    runs: dict[tuple[bool, ...], Callable[[], Any]] = {}
    wrong = []
    todo = candidates(sites, budget, rng)
    forced = []
    if policy is not None:
        from kiln.tuning.rl.sites import policy_answers

        forced.append(sites.key(policy_answers(policy, sites)))
        todo.insert(0, ("ppo policy", forced[0]))
    for label, decisions in todo:
        key = sites.key(decisions)
        if key in seen or all(key):
            continue
        run = timer.build(sites.graph(key))
        if not outputs_match(run(), reference):
            wrong.append(label)
        t = timer.times({"default": default_run, "candidate": run}, screen_rounds)
        ratio = median(t["default"]) / median(t["candidate"])
        seen[key] = {"label": label, "merged": sum(key), "of": len(key), "screen_ratio": ratio,
                     "fused_groups": len(sites.groups(key))}
        runs[key] = run
    ranked = sorted(seen, key=lambda k: -seen[k]["screen_ratio"])
    final_keys = ranked[:finalists] + [k for k in forced if k in seen and k not in ranked[:finalists]]
    second_default = timer.build(sites.default_graph().clone())
    pool: dict[Any, Callable[[], Any]] = {"default": default_run, "default again": second_default}
    pool.update({k: runs[k] for k in final_keys})
    t = timer.times(pool, final_rounds)
    default_s = median(t["default"])
    finals = []
    for k in final_keys:
        entry = dict(seen[k], final_ms=median(t[k]) * 1e3, final_ratio=default_s / median(t[k]))
        finals.append(entry)
    finals.sort(key=lambda e: -e["final_ratio"])
    best = finals[0] if finals else None
    result = {
        "model": name, "sites": sites.default_sites, "default_is_all_merge": same,
        "default_ms": default_s * 1e3, "default_spread": [min(t["default"]) * 1e3, max(t["default"]) * 1e3],
        "noise_ratio": default_s / median(t["default again"]),
        "measured": len(seen), "screen_rounds": screen_rounds, "final_rounds": final_rounds,
        "best": best, "finals": finals, "wrong_outputs": wrong,
        "screen_best": max((e["screen_ratio"] for e in seen.values()), default=None),
        "screen_median": median([e["screen_ratio"] for e in seen.values()]) if seen else None,
        "none_merge_ratio": seen.get(sites.key(sites.answers(lambda s: False)), {}).get("screen_ratio"),
        "random_screen": _stats([e["screen_ratio"] for e in seen.values() if e["label"].startswith("random")]),
        "policy": next((e for e in finals if e["label"] == "ppo policy"), None),
        "policy_is_default": bool(forced) and all(forced[0]),
    }
    log(f"{name}: default {default_s * 1e3:.3f} ms; best finalist {best['label'] if best else '-'} "
        f"{best['final_ratio'] if best else float('nan'):.3f}x; noise {result['noise_ratio']:.3f}x; "
        f"{len(seen)} vectors measured, {len(wrong)} with wrong outputs; ppo policy: {_policy(result)}")
    return result


# ------------------------------------------------------------------------------ other kinds
KINDS = ("fuse", "duplicate", "layout", "remat")
"""Per-site action kinds ``--kind`` searches (``fuse``: :class:`FusionSites`; the others:
:mod:`kiln.tuning.rl.site_kinds`)."""


def kind_problem(kind: str, name: str):
    from kiln.tuning.rl.site_kinds import DuplicateSites, LayoutSites, RematSites

    if kind == "remat":
        return RematSites(capture_model(name, training=True), name=name)
    return {"duplicate": DuplicateSites, "layout": LayoutSites}[kind](capture_model(name), name=name)


def kind_candidates(problem, budget: int, rng: np.random.Generator) -> list[tuple[str, tuple[bool, ...]]]:
    """``(label, decisions)`` of a kind with fixed sites: all yes; remat's own (minimum cut)
    choice; every single site answered yes (all of them if they fit in half the remaining
    budget, else a sample); then random vectors (yes probability 0.5 and 0.1 alternately)."""
    n = problem.default_sites
    out = [("all yes", problem.answers(lambda i: True))]
    if hasattr(problem, "min_cut"):
        out.append(("min cut", problem.min_cut))
    room = max(0, budget - len(out))
    flips = list(range(n)) if n <= room // 2 else sorted(rng.choice(n, size=room // 2, replace=False).tolist())
    out += [(f"yes {i}", problem.answers(lambda j, i=i: j == i)) for i in flips]
    k = 0
    while len(out) < budget:
        p = 0.5 if k % 2 == 0 else 0.1
        out.append((f"random p={p}", problem.answers(lambda i, p=p: rng.random() < p)))
        k += 1
    return out[:budget]


def search_kind(kind: str, name: str, *, budget: int, screen_rounds: int, finalists: int, final_rounds: int,
                timer: SiteTimer, seed: int, log: Callable[[str], None], memory_weight: float) -> dict[str, Any]:
    """The search of :func:`search_model` for a kind of :mod:`kiln.tuning.rl.site_kinds`: the
    score of a vector is its time ratio minus ``memory_weight`` times the relative change of
    the cpu backend's planned peak (``arena_bytes``)."""
    problem = kind_problem(kind, name)
    rng = np.random.default_rng(seed)
    default_run = timer.build(*problem.default_build())
    default_arena = default_run.info["arena_bytes"]
    reference = default_run()
    log(f"{name} [{kind}]: {problem.default_sites} sites, all-no build == default: "
        f"{str(problem.graph(())) == str(problem.default_build()[0]) and problem.build(())[1] == problem.default_build()[1]}")
    seen: dict[tuple[bool, ...], dict[str, Any]] = {}
    runs: dict[tuple[bool, ...], Callable[[], Any]] = {}
    wrong = []
    for label, decisions in kind_candidates(problem, budget, rng) if problem.default_sites else []:
        key = problem.key(decisions)
        if key in seen or not any(key):
            continue
        run = timer.build(*problem.build(key))
        if not outputs_match(run(), reference):
            wrong.append(label)
        t = timer.times({"default": default_run, "candidate": run}, screen_rounds)
        memory = run.info["arena_bytes"] / max(1, default_arena) - 1.0
        ratio = median(t["default"]) / median(t["candidate"])
        seen[key] = {"label": label, "merged": sum(key), "of": len(key), "screen_ratio": ratio, "memory": memory,
                     "screen_score": ratio - memory_weight * memory}
        runs[key] = run
    final_keys = sorted(seen, key=lambda k: -seen[k]["screen_score"])[:finalists]
    pool: dict[Any, Callable[[], Any]] = {"default": default_run,
                                          "default again": timer.build(problem.default_build()[0].clone(),
                                                                       problem.default_build()[1])}
    pool.update({k: runs[k] for k in final_keys})
    t = timer.times(pool, final_rounds)
    default_s = median(t["default"])
    finals = sorted((dict(seen[k], final_ms=median(t[k]) * 1e3, final_ratio=default_s / median(t[k]),
                          final_score=default_s / median(t[k]) - memory_weight * seen[k]["memory"])
                     for k in final_keys), key=lambda e: -e["final_score"])
    best = finals[0] if finals else None
    result = {
        "model": name, "kind": kind, "sites": problem.default_sites, "default_ms": default_s * 1e3,
        "default_arena_bytes": default_arena, "noise_ratio": default_s / median(t["default again"]),
        "measured": len(seen), "screen_rounds": screen_rounds, "final_rounds": final_rounds,
        "memory_weight": memory_weight, "best": best, "finals": finals, "wrong_outputs": wrong,
        "random_screen": _stats([e["screen_ratio"] for e in seen.values() if e["label"].startswith("random")]),
    }
    log(f"{name} [{kind}]: default {default_s * 1e3:.3f} ms; best finalist {best['label'] if best else '-'} "
        f"{best['final_ratio'] if best else float('nan'):.3f}x; noise {result['noise_ratio']:.3f}x; "
        f"{len(seen)} vectors measured, {len(wrong)} with wrong outputs")
    return result


def kind_table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | kind | sites | default (ms) | best (ms) | best / default | peak change | score | best vector | "
             "vectors measured | final rounds | noise (default / default) | random vectors (screen: n, median, best) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = r["best"]
        if b is None:
            lines.append(f"| {r['model']} | {r['kind']} | {r['sites']} | {r['default_ms']:.3f} | - | - | - | - | "
                         f"no vector measured | 0 | - | - | - |")
            continue
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['sites']} | {r['default_ms']:.3f} | {b['final_ms']:.3f} | "
            f"{b['final_ratio']:.3f}x | {b['memory']:+.1%} | {b['final_score']:.3f} | {b['label']} "
            f"({b['merged']}/{b['of']} yes) | {r['measured']} | {r['final_rounds']} | {r['noise_ratio']:.3f}x | "
            f"{_random(r)} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ PPO
PPO_CORPUS = ("small-cnn", "resnet18-32", "resnet18-64", "mlp-relu-64")
"""Default training graphs of ``--ppo-steps``: pass-ordering corpus graphs (cnn and mlp families)."""


def train_on_corpus(names: Sequence[str], steps: int, timer: SiteTimer, rounds: int, final_rounds: int, seed: int,
                    log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    from kiln.tuning.rl.corpus import build_corpus
    from kiln.tuning.rl.sites import train_policy

    entries = [e for e in build_corpus(["cnn", "mlp"]) if e.name in names]
    clock = time.perf_counter()
    model = train_policy(entries, steps, timer=timer, rounds=rounds, seed=seed)
    env = model.site_env
    seconds = time.perf_counter() - clock
    measured = {env.problems[i].name: len(r.cache) for i, r in env._rewards.items()}
    best = {env.problems[i].name: 1 + max(r.cache.values()) for i, r in env._rewards.items() if r.cache}
    again = {}
    for i, r in env._rewards.items():  # the best training reward, timed again (screening picks noise winners)
        if r.cache:
            key = max(r.cache, key=r.cache.__getitem__)
            t = timer.times({"default": r.default_run, "best": timer.build(env.problems[i].graph(key))}, final_rounds)
            again[env.problems[i].name] = median(t["default"]) / median(t["best"])
    info = {"corpus": [e.name for e in entries], "steps": steps, "seconds": seconds,
            "vectors_measured": measured, "best_training_speedup": best, "best_training_speedup_again": again}
    log(f"ppo: {info}")
    return model, info


def _stats(xs: Sequence[float]) -> dict[str, float] | None:
    return {"n": len(xs), "median": median(xs), "best": max(xs)} if xs else None


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}x"


def _random(r: dict[str, Any]) -> str:
    st = r.get("random_screen")
    return "-" if not st else f"{st['n']}, {st['median']:.3f}x, {st['best']:.3f}x"


def _policy(r: dict[str, Any]) -> str:
    if r.get("policy"):
        p = r["policy"]
        return f"{p['final_ratio']:.3f}x ({p['merged']}/{p['of']} merged)"
    return "= default" if r.get("policy_is_default") else "-"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | sites | default (ms) | best (ms) | best / default | best vector | vectors measured | "
             "final rounds | noise (default / default) | none-merge (screen) | random vectors (screen: n, median, best) | "
             "PPO policy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = r["best"]
        if b is None:
            lines.append(f"| {r['model']} | {r['sites']} | {r['default_ms']:.3f} | - | - | no vector measured | 0 | - | - | - | - | - |")
            continue
        lines.append(
            f"| {r['model']} | {r['sites']} | {r['default_ms']:.3f} | {b['final_ms']:.3f} | "
            f"{b['final_ratio']:.3f}x | {b['label']} ({b['merged']}/{b['of']} merged) | {r['measured']} | "
            f"{r['final_rounds']} | {r['noise_ratio']:.3f}x | {_x(r['none_merge_ratio'])} | {_random(r)} | {_policy(r)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.site_search", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,llama-wide,mobilenet_v2,swin",
                        help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--budget", type=int, default=40, help="decision vectors per model (besides the default)")
    parser.add_argument("--screen-rounds", type=int, default=3)
    parser.add_argument("--finalists", type=int, default=5)
    parser.add_argument("--final-rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ppo-steps", type=int, default=0,
                        help="train MaskablePPO this many env steps on --ppo-corpus first (0: skip)")
    parser.add_argument("--ppo-corpus", default=",".join(PPO_CORPUS))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--kind", choices=KINDS, default="fuse",
                        help="the per-site action kind to search (default: fuse)")
    parser.add_argument("--memory-weight", type=float, default=None,
                        help="weight of the relative planned-peak change in a vector's score (default: 1 for "
                             "remat, 0 for the other kinds)")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    timer = SiteTimer(threads=args.threads)
    if args.kind != "fuse":
        weight = args.memory_weight if args.memory_weight is not None else float(args.kind == "remat")
        found = [search_kind(args.kind, name, budget=args.budget, screen_rounds=args.screen_rounds,
                             finalists=args.finalists, final_rounds=args.final_rounds, timer=timer, seed=args.seed,
                             log=log, memory_weight=weight) for name in args.models.split(",")]
        print(kind_table(found))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            meta = {"argv": list(argv) if argv is not None else sys.argv[1:], "machine": platform.machine(),
                    "threads": args.threads, "kind": args.kind, "memory_weight": weight}
            args.out.write_text(json.dumps({"meta": meta, "results": found}, indent=1, default=str))
        return 0
    policy, ppo = None, None
    if args.ppo_steps:
        policy, ppo = train_on_corpus(args.ppo_corpus.split(","), args.ppo_steps, timer, args.screen_rounds,
                                      args.final_rounds, args.seed, log)
    results = []
    for name in args.models.split(","):
        results.append(search_model(name, budget=args.budget, screen_rounds=args.screen_rounds,
                                    finalists=args.finalists, final_rounds=args.final_rounds, timer=timer,
                                    seed=args.seed, log=log, policy=policy))
    print(table(results))
    if ppo is not None:
        print(f"\nMaskablePPO: {ppo['steps']} steps on {', '.join(ppo['corpus'])} in {ppo['seconds']:.0f} s; "
              f"vectors measured {ppo['vectors_measured']}; best measured during training (timed again) "
              + ", ".join(f"{k} {v:.3f}x ({ppo['best_training_speedup_again'][k]:.3f}x)"
                          for k, v in ppo["best_training_speedup"].items()))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"argv": list(argv) if argv is not None else sys.argv[1:], "machine": platform.machine(),
                "threads": args.threads, "timer": "kiln.runtime.timing.best_time", "best_time": best_time.__module__}
        args.out.write_text(json.dumps({"meta": meta, "results": results, "ppo": ppo}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
