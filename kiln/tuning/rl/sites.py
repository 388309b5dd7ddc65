"""``kiln/FusionSites-v0``: per-site fusion decisions of one graph, rewarded by measured runtime.

The default pipeline's ``fuse`` merges *every* legal (producer, consumer) pair that its greedy
walk meets (:func:`kiln.passes.fusion.partition`).  Here an agent answers each of those
merge sites instead: merge, or not.

* :class:`FusionSites` holds one graph: the graph after the first round of the default
  pipeline's passes before ``fuse`` (``pre``), the walk of its merge sites under a decision
  vector, the resulting groups and the compiled-ready graph (``fuse_groups`` of the chosen
  groups, then the default pipeline's later rounds without ``fuse``, so a declined merge
  stays declined).  The all-merge vector gives exactly the default pipeline's graph.
* A *decision vector* is the answers in the order the walk asks them; declining a merge
  changes which later merges are legal, so the walk is replayed from the start with the
  answers given so far (:meth:`FusionSites.site`).  Answers past the end of a vector are
  "merge" (the default); :meth:`FusionSites.key` is the vector of answers actually consulted,
  which determines the graph (measurements are cached by it).
* :class:`SiteTimer` (defined in :mod:`kiln.tuning.rl.site_env`, shared by every kind)
  builds graphs with the cpu backend and times them with
  :func:`kiln.runtime.timing.best_time` in interleaved rounds (median over rounds of each
  round's best time), relative to the default pipeline's graph (:class:`MeasuredReward`).
* :class:`FusionSitesEnv` is the gymnasium environment (the shared
  :class:`~kiln.tuning.rl.site_env.DecisionSitesEnv` with :class:`FusionSites` problems):
  an episode walks the sites of one corpus graph; the observation is :data:`SITE_FEATURES` of the current site; actions are
  ``0`` (do not merge) and ``1`` (merge); :meth:`FusionSitesEnv.action_masks` allows both at a
  site (every site the walk stops at is legal: illegal merges are never offered).  The reward
  is 0 per step and, when the walk ends, ``default_time / time - 1`` (the measured speedup
  over the default pipeline through the cpu backend) or, with ``reward="kernels"``, the
  relative decrease of :func:`kiln.passes.fusion.kernel_count` (cheap, for tests); with
  ``reward="arena"`` the relative decrease of the cpu build's planned peak.

This is the *fuse or not* kind of per-site action.  The other kinds (duplicate a producer,
a layout per conv/matmul, rematerialize a value with a peak-memory term) are
:mod:`kiln.tuning.rl.site_kinds`, on the shared mechanism of :mod:`kiln.tuning.rl.site_env`
(the environment, :class:`SiteTimer` and the measured reward are shared).

::

    import gymnasium, kiln.tuning.rl
    env = gymnasium.make("kiln/FusionSites-v0", reward="kernels")
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(1)

The search ceiling of these decisions on models outside the corpus is measured by
``python -m benchmarks.site_search`` (``docs/tuning.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kiln.ir import Graph, Node
from kiln.passes.fusion import ANCHORS, fuse_groups, kernel_count, node_class, partition
from kiln.passes.manager import PassManager
from kiln.passes.pipeline import DEFAULT_PIPELINE, default_pipeline
from kiln.tuning.rl.corpus import CorpusEntry
from kiln.tuning.rl.site_env import BuildReward, DecisionSitesEnv, SiteTimer, graph_arguments, median

NODE_CLASSES = ("fused", "opaque", "view", "creation", "matmul", "conv", "reduction", "elementwise")
"""The classes of :func:`kiln.passes.fusion.node_class`, in observation order."""

SITE_FEATURES = (
    *(f"producer_{c}" for c in NODE_CLASSES),
    *(f"consumer_{c}" for c in NODE_CLASSES),
    "producer_log_numel", "consumer_log_numel",
    "producer_group_size", "consumer_group_size",
    "producer_group_anchor", "consumer_group_anchor",
    "producer_fan_out", "producer_escapes",
    "producer_pointwise", "consumer_pointwise", "consumer_param_operands",
    "site_position", "node_position", "merged_fraction",
)
"""Observation of a site, each in [0, 1]: the classes of producer and consumer (one-hot),
log2 of their first result's element count / 24, the sizes of their groups so far / max
group size, whether those groups hold an anchor, the producer's users / 8, whether its
result is used outside the consumer or returned, whether producer and consumer have the
``pointwise`` trait (inference batch norm), the fraction of the consumer's operands that are
graph params, the site's index / the default walk's site
count, the consumer's position in the graph, and the fraction of sites merged so far."""

MERGE, KEEP = 1, 0


@dataclass(frozen=True)
class Site:
    """One merge site of a walk: the ``index``-th legal merge the walk meets."""

    index: int
    producer: Node
    consumer: Node
    producer_group: int
    """Nodes in the producer's group so far."""
    consumer_group: int
    producer_anchor: bool
    consumer_anchor: bool
    merged: int
    """Merges accepted before this site."""


class _Stop(Exception):
    def __init__(self, site: Site):
        self.site = site


class FusionSites:
    """The merge sites of one graph (module docstring).

    Args:
        graph: a captured graph (the default pipeline has not run on it).
        max_nodes, strategy: the options of ``fuse`` (the default pipeline's defaults).
    """

    kind: ClassVar[str] = "merge"
    FEATURES: ClassVar[tuple[str, ...]] = SITE_FEATURES

    def __init__(self, graph: Graph, *, max_nodes: int = 32, strategy: str = "greedy", name: str | None = None):
        self.name = name or graph.name
        self.source = graph
        self.max_nodes = max_nodes
        self.strategy = strategy
        before_fuse = DEFAULT_PIPELINE.removesuffix(",fuse")
        self.pre = PassManager(before_fuse, verify=True).run(graph).graph
        """The graph ``fuse`` sees in the default pipeline's first round."""
        self.pos = {n: i for i, n in enumerate(self.pre.nodes)}
        self.users: dict[Node, int] = {n: 0 for n in self.pre.nodes}
        for n in self.pre.nodes:
            for p in {v.producer for v in n.inputs if v.producer is not None}:
                self.users[p] += 1
        self.returned = {v.producer for v in self.pre.outputs}
        self.params = set(self.pre.params)
        self._sites: dict[tuple[bool, ...], Site | None] = {}
        self._graphs: dict[tuple[bool, ...], Graph] = {}
        self._default: Graph | None = None
        self.default_sites = len(self.key(()))
        """Sites of the all-merge (default) walk."""

    # ------------------------------------------------------------------ the walk
    def _walk(self, decisions: Sequence[bool], stop: bool) -> tuple[list[list[Node]], tuple[bool, ...]]:
        """Replay ``partition`` with ``decisions`` (then "merge"); with ``stop``, raise
        :class:`_Stop` at the first site past them."""
        answers = [bool(d) for d in decisions]
        consulted: list[bool] = []
        parent: dict[Node, Node] = {}
        size: dict[Node, int] = {}
        anchor: dict[Node, bool] = {}

        def find(n: Node) -> Node:
            while parent.get(n, n) is not n:
                n = parent[n]
            return n

        def decide(producer: Node, consumer: Node) -> bool:
            i = len(consulted)
            if i >= len(answers) and stop:
                a, b = find(producer), find(consumer)
                raise _Stop(Site(i, producer, consumer, size.get(a, 1), size.get(b, 1),
                                 anchor.get(a, node_class(a) in ANCHORS), anchor.get(b, node_class(b) in ANCHORS),
                                 sum(consulted)))
            answer = answers[i] if i < len(answers) else True
            consulted.append(answer)
            if answer:
                a, b = find(producer), find(consumer)
                parent[b] = a
                size[a] = size.get(a, 1) + size.get(b, 1)
                anchor[a] = anchor.get(a, node_class(a) in ANCHORS) or anchor.get(b, node_class(b) in ANCHORS)
            return answer

        groups = partition(self.pre, self.max_nodes, self.strategy, decide=decide)
        return groups, tuple(consulted)

    def site(self, decisions: Sequence[bool]) -> Site | None:
        """The site the walk meets after answering ``decisions`` (``None``: the walk ended)."""
        key = tuple(bool(d) for d in decisions)
        if key not in self._sites:
            try:
                self._walk(key, stop=True)
                self._sites[key] = None
            except _Stop as s:
                self._sites[key] = s.site
        return self._sites[key]

    def answers(self, policy: Callable[[Site], bool]) -> tuple[bool, ...]:
        """The decision vector of answering every site of the walk with ``policy(site)``."""
        decisions: list[bool] = []
        while (site := self.site(decisions)) is not None:
            decisions.append(bool(policy(site)))
        return tuple(decisions)

    def key(self, decisions: Sequence[bool]) -> tuple[bool, ...]:
        """The answers the walk consults under ``decisions`` (padded with "merge", cut to
        the walk's length): equal keys give equal graphs."""
        return self._walk(decisions, stop=False)[1]

    def groups(self, decisions: Sequence[bool]) -> list[list[Node]]:
        """The groups (nodes of :attr:`pre`) that become ``fused`` nodes under ``decisions``."""
        return self._walk(decisions, stop=False)[0]

    def graph(self, decisions: Sequence[bool]) -> Graph:
        """The optimized graph under ``decisions``: the chosen groups fused, then the default
        pipeline's later rounds without ``fuse`` (cached by :meth:`key`)."""
        groups, key = self._walk(decisions, stop=False)
        if key not in self._graphs:
            fused = fuse_groups(self.pre, groups) if groups else self.pre
            self._graphs[key] = default_pipeline(fuse=False, max_iterations=3).run(fused).graph
        return self._graphs[key]

    def default_graph(self) -> Graph:
        """What the default pipeline makes of the graph (equal to ``graph(())``)."""
        if self._default is None:
            self._default = default_pipeline().run(self.source).graph
        return self._default

    def build(self, decisions: Sequence[bool]) -> tuple[Graph, dict[str, Any]]:
        """:meth:`graph` and the cpu backend's default options (the shared environment's hook)."""
        return self.graph(decisions), {}

    def default_build(self) -> tuple[Graph, dict[str, Any]]:
        return self.default_graph(), {}

    def cheap_reward(self, kind: str, memory_weight: float) -> Callable[[Sequence[bool]], float]:
        if kind != "kernels":
            raise ValueError(f"unknown reward {kind!r}; choose measured, arena, kernels or a callable")
        return kernel_reward(self)

    def site_label(self, site: Site) -> tuple[str, str]:
        return (site.producer.outputs[0].name if site.producer.outputs else "",
                site.consumer.outputs[0].name if site.consumer.outputs else "")

    # ------------------------------------------------------------------ features
    def features(self, site: Site, decisions: Sequence[bool] = ()) -> np.ndarray:
        """:data:`SITE_FEATURES` of ``site`` (``decisions``: unused, the walk's state is in ``site``)."""
        out = np.zeros(len(SITE_FEATURES), dtype=np.float32)
        k = len(NODE_CLASSES)
        out[NODE_CLASSES.index(node_class(site.producer))] = 1.0
        out[k + NODE_CLASSES.index(node_class(site.consumer))] = 1.0
        i = 2 * k
        for node in (site.producer, site.consumer):
            numel = node.outputs[0].type.numel if node.outputs else 1
            numel = numel if isinstance(numel, int) and numel > 0 else 1
            out[i] = min(1.0, math.log2(numel) / 24.0)
            i += 1
        out[i] = min(1.0, site.producer_group / self.max_nodes)
        out[i + 1] = min(1.0, site.consumer_group / self.max_nodes)
        out[i + 2] = float(site.producer_anchor)
        out[i + 3] = float(site.consumer_anchor)
        users = self.users.get(site.producer, 0)
        out[i + 4] = min(1.0, users / 8.0)
        out[i + 5] = float(users > 1 or site.producer in self.returned)
        out[i + 6] = float(site.producer.op.has("pointwise"))
        out[i + 7] = float(site.consumer.op.has("pointwise"))
        ins = site.consumer.inputs
        out[i + 8] = sum(v in self.params for v in ins) / len(ins) if ins else 0.0
        out[i + 9] = min(1.0, site.index / max(1, self.default_sites))
        out[i + 10] = self.pos[site.consumer] / max(1, len(self.pre.nodes))
        out[i + 11] = site.merged / site.index if site.index else 1.0
        return out


class MeasuredReward(BuildReward):
    """Measured speedup over the default pipeline of a :class:`FusionSites`' decision vectors,
    cached by :meth:`FusionSites.key`: ``default / time - 1`` from ``rounds`` interleaved
    samples of the candidate and the default graph's executable (:class:`BuildReward` without
    a memory term)."""

    def __init__(self, sites: FusionSites, timer: SiteTimer | None = None, rounds: int = 3):
        super().__init__(sites, timer, rounds)
        self.sites = sites


def kernel_reward(sites: FusionSites) -> Callable[[Sequence[bool]], float]:
    """Relative decrease of the kernel count against the default pipeline's graph."""
    base = kernel_count(sites.graph(()))

    def reward(decisions: Sequence[bool]) -> float:
        return (base - kernel_count(sites.graph(decisions))) / max(1, base)

    return reward


# ---------------------------------------------------------------------------- environment
def default_site_corpus() -> list[Graph]:
    """The pass-ordering environment's random graphs (:func:`kiln.tuning.rl.env.default_corpus`)."""
    from kiln.tuning.rl.env import default_corpus

    return default_corpus()


class FusionSitesEnv(DecisionSitesEnv):
    """See the module docstring (the shared environment of :mod:`kiln.tuning.rl.site_env`).

    Args:
        corpus: graphs, :class:`CorpusEntry` objects or :class:`FusionSites` (default:
            :func:`default_site_corpus`); graphs without a merge site are left out.
        reward: ``"measured"`` (default: cpu backend, :class:`BuildReward` as
            :class:`MeasuredReward`), ``"arena"`` (the planned peak's relative change, built,
            not timed), ``"kernels"`` (:func:`kernel_reward`), or a callable
            ``(FusionSites) -> (decisions -> float)``.
        timer: the :class:`SiteTimer` of measured rewards.
        rounds: interleaved samples per measured reward.
        memory_weight: weight of the planned peak's relative change in measured rewards (0).
    """

    problem_type = FusionSites

    def __init__(self, corpus: Sequence[Graph | CorpusEntry | FusionSites] | None = None, *,
                 reward: str | Callable[[FusionSites], Callable[[Sequence[bool]], float]] = "measured",
                 timer: SiteTimer | None = None, rounds: int = 3, max_nodes: int = 32,
                 memory_weight: float | None = None, render_mode: str | None = None):
        super().__init__(corpus, reward=reward, timer=timer, rounds=rounds, memory_weight=memory_weight,
                         render_mode=render_mode, max_nodes=max_nodes)

    @classmethod
    def default_corpus(cls) -> list[Graph]:
        return default_site_corpus()


# ---------------------------------------------------------------------------- training
def train_policy(corpus: Sequence[Any], steps: int, *, reward: Any = "measured", timer: SiteTimer | None = None,
                 rounds: int = 3, seed: int = 0, n_steps: int = 256, env_type: type | None = None,
                 **env_options: Any) -> Any:
    """A ``MaskablePPO`` policy (sb3-contrib) trained for ``steps`` environment steps on
    ``corpus`` with the given reward (default: measured through the cpu backend), in
    ``env_type`` (default :class:`FusionSitesEnv`; any kind's environment of
    :mod:`kiln.tuning.rl.site_kinds`, with ``env_options`` such as ``memory_weight``)."""
    from sb3_contrib import MaskablePPO

    env = (env_type or FusionSitesEnv)(corpus, reward=reward, timer=timer, rounds=rounds, **env_options)
    env.reset(seed=seed)
    model = MaskablePPO("MlpPolicy", env, n_steps=n_steps, batch_size=64, seed=seed, verbose=0)
    model.learn(total_timesteps=steps)
    model.site_env = env
    return model


def policy_answers(model: Any, sites: Any) -> tuple[bool, ...]:
    """The decision vector a trained policy gives ``sites`` (a :class:`FusionSites` or a
    problem of another kind; deterministic actions)."""
    decisions: list[bool] = []
    while (site := sites.site(decisions)) is not None:
        action, _ = model.predict(sites.features(site, decisions), action_masks=np.array([True, True]),
                                  deterministic=True)
        decisions.append(int(action) == MERGE)
    return tuple(decisions)


__all__ = [
    "KEEP", "MERGE", "BuildReward", "NODE_CLASSES", "SITE_FEATURES", "FusionSites", "FusionSitesEnv", "MeasuredReward", "Site",
    "SiteTimer", "default_site_corpus", "graph_arguments", "kernel_reward", "median", "policy_answers", "train_policy",
]
