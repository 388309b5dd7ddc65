"""Evaluation of a pass-ordering policy against every baseline, and the report it writes.

Every method runs on the same graphs with the same cost, action set, step budget and
transition cache (see :mod:`kiln.tuning.rl.baselines`):

==================  ===========================================================================
method              what it is
==================  ===========================================================================
``default``         ``DEFAULT_PIPELINE`` iterated to a fixpoint
``default-once``    ``DEFAULT_PIPELINE`` run once
``random``          one episode of random valid actions (the random policy)
``random-search``   best random rollout for the pass applications a policy spends
``greedy``          one-step lookahead on the cost
``fixed-order``     the best single action sequence found on the training corpus
``learned``         the policy's deterministic episode
``learned+fallback``  the better of ``learned`` and ``default`` (what ``passes="learned"`` does)
==================  ===========================================================================

The headline number per method is the mean over graphs of ``(default cost - method cost) /
default cost``: positive means fewer ops (or kernels, or estimated time) than the default
pipeline, the way the published XLA results are stated.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.passes.ordering.episode import CostModel
from kiln.passes.ordering.learned import PolicyNet, rollout
from kiln.passes.ordering.transitions import TransitionCache
from kiln.tuning.measure import best_time
from kiln.tuning.rl import baselines
from kiln.tuning.rl.corpus import CorpusEntry
from kiln.tuning.rl.costs import cost_model

METHODS = (
    "default",
    "default-once",
    "random",
    "random-search",
    "greedy",
    "fixed-order",
    "learned",
    "learned+fallback",
)


@dataclass
class Evaluation:
    """Per-graph outcomes of every method; :meth:`summary` and :meth:`markdown` aggregate."""

    cost: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def methods(self) -> list[str]:
        return [m for m in METHODS if any(r["method"] == m for r in self.rows)]

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{split: {method: stats}}``; stats: ``vs_default`` (mean relative reduction
        against the default pipeline), ``improvement`` (mean reduction from the captured
        graph), ``better``/``worse`` (graphs beating/losing to default), ``applications``
        and ``seconds`` (means per graph)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        defaults = {r["graph"]: r["cost"] for r in self.rows if r["method"] == "default"}
        for split in sorted({r["split"] for r in self.rows}):
            out[split] = {}
            for method in self.methods():
                rows = [r for r in self.rows if r["split"] == split and r["method"] == method]
                if not rows:
                    continue
                vs = [
                    (defaults[r["graph"]] - r["cost"]) / defaults[r["graph"]] if defaults[r["graph"]] else 0.0
                    for r in rows
                ]
                out[split][method] = {
                    "vs_default": float(np.mean(vs)),
                    "improvement": float(
                        np.mean([1 - r["cost"] / r["initial_cost"] if r["initial_cost"] else 0 for r in rows])
                    ),
                    "better": int(sum(v > 1e-9 for v in vs)),
                    "worse": int(sum(v < -1e-9 for v in vs)),
                    "graphs": len(rows),
                    "applications": float(np.mean([r["applications"] for r in rows])),
                    "seconds": float(np.mean([r["seconds"] for r in rows])),
                }
        return out

    def markdown(self, per_graph: bool = True) -> str:
        lines = [f"### Cost: `{self.cost}`", ""]
        for split, methods in self.summary().items():
            lines += [
                f"**{split}** ({next(iter(methods.values()))['graphs']} graphs)",
                "",
                "| method | vs default | from captured | better / worse than default | pass applications | ms per graph |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for method, s in methods.items():
                lines.append(
                    f"| {method} | {100 * s['vs_default']:+.2f}% | {100 * s['improvement']:.1f}% | "
                    f"{s['better']} / {s['worse']} | {s['applications']:.0f} | {1000 * s['seconds']:.1f} |"
                )
            lines.append("")
        if per_graph:
            methods = self.methods()
            lines += [
                "| graph | split | captured | " + " | ".join(methods) + " |",
                "|---|---|---:|" + "---:|" * len(methods),
            ]
            for graph in dict.fromkeys(r["graph"] for r in self.rows):
                rows = {r["method"]: r for r in self.rows if r["graph"] == graph}
                first = next(iter(rows.values()))
                cells = [_fmt(rows[m]["cost"]) if m in rows else "" for m in methods]
                lines.append(
                    f"| {graph} | {first['split']} | {_fmt(first['initial_cost'])} | "
                    + " | ".join(cells)
                    + " |"
                )
            lines.append("")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {"cost": self.cost, "meta": self.meta, "summary": self.summary(), "rows": self.rows}, indent=1
        )

    def plot(self, path: str | Path) -> None:
        """Bar chart of ``vs default`` per method and split (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        summary = self.summary()
        methods = [m for m in self.methods() if m != "default"]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        width = 0.8 / max(1, len(summary))
        for i, (split, stats) in enumerate(summary.items()):
            values = [100 * stats[m]["vs_default"] if m in stats else 0 for m in methods]
            ax.bar(np.arange(len(methods)) + i * width, values, width, label=split)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(methods)) + width * (len(summary) - 1) / 2, methods, rotation=20)
        ax.set_ylabel(f"{self.cost}: % better than default")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _fmt(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.3g}"


def evaluate(
    entries: Sequence[CorpusEntry],
    policy: PolicyNet | None,
    *,
    cost: str | None = None,
    machine: str | None = None,
    budget: int | None = None,
    fixed: Sequence[int] | None = None,
    actions: Any = None,
    methods: Sequence[str] = METHODS,
    seed: int = 0,
    cache: TransitionCache | None = None,
) -> Evaluation:
    """Run ``methods`` on ``entries``.  Cost, budget and actions default to the policy's."""
    if policy is None and any(m.startswith("learned") for m in methods):
        raise ValueError("the learned methods need a policy")
    from kiln.passes.ordering.actions import action_set

    cost_name = cost or (policy.cost if policy else "op_count")
    machine = machine or (policy.machine if policy else "cpu")
    budget = budget or (policy.budget if policy else 12)
    acts = policy.action_set() if policy is not None else action_set(actions or "base")
    cache = cache if cache is not None else TransitionCache(acts)
    model = cost_model(cost_name, machine)
    evaluation = Evaluation(
        cost_name,
        meta={
            "budget": budget,
            "machine": machine,
            "actions": [a.name for a in acts],
            "fixed_order": [acts[a].name for a in fixed] if fixed is not None else None,
        },
    )
    for entry in entries:
        g = entry.graph
        outcomes: dict[str, baselines.Outcome] = {}
        outcomes["default"] = baselines.default_fixpoint(g, model, cache)
        if "default-once" in methods:
            outcomes["default-once"] = baselines.default_once(g, model, cache)
        if "random" in methods:
            outcomes["random"] = baselines.random_rollout(g, model, cache, budget, seed)
        if "random-search" in methods:
            outcomes["random-search"] = baselines.random_search(g, model, cache, budget, seed=seed)
        if "greedy" in methods:
            outcomes["greedy"] = baselines.greedy(g, model, cache, budget)
        if "fixed-order" in methods and fixed is not None:
            outcomes["fixed-order"] = baselines.fixed_order(g, fixed, model, cache)
        if policy is not None and "learned" in methods:
            outcomes["learned"] = _learned(policy, g, model, cache, budget)
        if policy is not None and "learned+fallback" in methods:
            learned = outcomes.get("learned") or _learned(policy, g, model, cache, budget)
            pick = learned if learned.cost <= outcomes["default"].cost else outcomes["default"]
            outcomes["learned+fallback"] = baselines.Outcome(
                "learned+fallback",
                pick.cost,
                learned.initial_cost,
                learned.applications + outcomes["default"].applications,
                pick.trace,
                learned.seconds + outcomes["default"].seconds,
            )
        for method, o in outcomes.items():
            evaluation.rows.append(
                {
                    "graph": entry.name,
                    "family": entry.family,
                    "split": entry.split,
                    "method": method,
                    "cost": o.cost,
                    "initial_cost": o.initial_cost,
                    "applications": o.applications,
                    "seconds": o.seconds,
                    "trace": o.trace,
                }
            )
    return evaluation


def _learned(
    policy: PolicyNet, graph, model: CostModel, cache: TransitionCache, budget: int
) -> baselines.Outcome:
    import time

    start = time.perf_counter()
    if budget != policy.budget:
        policy = dataclasses.replace(policy, budget=budget)
    episode = rollout(policy, graph, cache, model)
    return baselines.Outcome(
        "learned",
        episode.cost,
        episode.initial_cost,
        episode.tried,
        episode.trace(),
        time.perf_counter() - start,
        episode.graph,
    )


def env_throughput(
    graphs: Sequence,
    *,
    actions: str = "base",
    cost: str = "op_count",
    budget: int = 12,
    episodes: int = 20,
    seed: int = 0,
) -> dict[str, float]:
    """Environment steps per second with random valid actions (``stop`` excluded), with a
    cold transition cache (first ``episodes`` episodes) and then a warm one (the same
    number again).  Needs gymnasium."""
    from kiln.tuning.rl.env import PassOrderingEnv

    env = PassOrderingEnv(list(graphs), actions=actions, cost=cost, budget=budget)
    rng = np.random.default_rng(seed)
    steps = 0

    def run_episodes() -> None:
        nonlocal steps
        for episode in range(episodes):
            env.reset(seed=seed + episode)
            done = False
            while not done:
                mask = env.action_masks()
                mask[-1] = not mask[:-1].any()
                _, _, terminated, truncated, _ = env.step(int(rng.choice(np.flatnonzero(mask))))
                steps += 1
                done = terminated or truncated

    rates = {}
    for phase in ("cold", "warm"):
        steps = 0
        seconds = best_time(run_episodes, repeat=1, warmup=0)
        rates[phase] = steps / seconds
    return rates
