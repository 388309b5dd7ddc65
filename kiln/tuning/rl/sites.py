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
* :class:`SiteTimer` builds graphs with the cpu backend and times them with
  :func:`kiln.runtime.timing.best_time` in interleaved rounds (median over rounds of each
  round's best time), relative to the default pipeline's graph.
* :class:`FusionSitesEnv` is the gymnasium environment: an episode walks the sites of one
  corpus graph; the observation is :data:`SITE_FEATURES` of the current site; actions are
  ``0`` (do not merge) and ``1`` (merge); :meth:`FusionSitesEnv.action_masks` allows both at a
  site (every site the walk stops at is legal: illegal merges are never offered).  The reward
  is 0 per step and, when the walk ends, ``default_time / time - 1`` (the measured speedup
  over the default pipeline through the cpu backend) or, with ``reward="kernels"``, the
  relative decrease of :func:`kiln.passes.fusion.kernel_count` (cheap, for tests).

Of the four per-site action kinds of the issue (fuse, duplicate a producer, layout per
conv/matmul, rematerialize a value with a peak-memory term) only *fuse or not* exists.

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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from kiln.ir import Graph, Node
from kiln.passes.fusion import ANCHORS, fuse_groups, kernel_count, node_class, partition
from kiln.passes.manager import PassManager
from kiln.passes.pipeline import DEFAULT_PIPELINE, default_pipeline
from kiln.runtime.timing import best_time
from kiln.tuning.rl.corpus import CorpusEntry

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

    # ------------------------------------------------------------------ features
    def features(self, site: Site) -> np.ndarray:
        """:data:`SITE_FEATURES` of ``site``."""
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


# ---------------------------------------------------------------------------- measurement
def graph_arguments(graph: Graph, seed: int = 0) -> list[Any]:
    """Seeded random inputs then params of ``graph`` as torch tensors
    (:func:`~kiln.passes.ordering.cost.random_arguments`)."""
    import torch

    from kiln.passes.ordering.cost import random_arguments

    inputs, params = random_arguments(graph, seed)
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs + params]


class SiteTimer:
    """Cpu-backend builds of graphs and their interleaved timing.

    ``threads`` is the cpu backend's (and torch's intra-op) thread count; a *sample* of an
    executable is :func:`best_time` (minimum over ``repeat`` rounds of ``number`` calls,
    ``number`` chosen so a round lasts about ``round_s``); :meth:`times` takes ``rounds``
    samples of every executable, interleaved (each round visits all of them in a rotated
    order), and returns each one's median.
    """

    def __init__(self, *, threads: int = 1, repeat: int = 3, round_s: float = 2e-3, seed: int = 0):
        import torch

        self.threads = threads
        self.repeat = repeat
        self.round_s = round_s
        self.seed = seed
        self.builds = 0
        torch.set_num_threads(threads)
        self._args: dict[tuple, list[Any]] = {}
        self._number: dict[Callable[[], Any], int] = {}

    def build(self, graph: Graph) -> Callable[[], Any]:
        """``run()`` calling the cpu executable of ``graph`` on seeded random arguments."""
        import torch

        from kiln.backends import get_backend

        exe = get_backend("cpu").build(graph, {"threads": self.threads})
        self.builds += 1
        signature = tuple((v.name, str(v.type)) for v in (*graph.inputs, *graph.params))
        if signature not in self._args:  # one set of arguments per signature: every candidate gets the same
            self._args[signature] = graph_arguments(graph, self.seed)
        args = self._args[signature]

        def run() -> Any:
            with torch.no_grad():
                return exe(args)

        return run

    def sample(self, run: Callable[[], Any]) -> float:
        """One sample of ``run``: seconds per call (``number`` calibrated on its first sample)."""
        if run not in self._number:
            once = best_time(run, repeat=1, warmup=2)
            self._number[run] = max(1, int(self.round_s / max(once, 1e-7)))
        return best_time(run, repeat=self.repeat, warmup=1, number=self._number[run])

    def times(self, runs: dict[Hashable, Callable[[], Any]], rounds: int = 5) -> dict[Hashable, list[float]]:
        """``rounds`` interleaved samples (seconds per call) of each of ``runs``."""
        keys = list(runs)
        out: dict[Hashable, list[float]] = {k: [] for k in keys}
        for r in range(rounds):
            shift = r % len(keys)
            for k in keys[shift:] + keys[:shift]:
                out[k].append(self.sample(runs[k]))
        return out


def median(xs: Sequence[float]) -> float:
    return float(np.median(np.asarray(xs, dtype=float)))


class MeasuredReward:
    """Measured speedup over the default pipeline of a :class:`FusionSites`' decision vectors,
    cached by :meth:`FusionSites.key`: ``default / time - 1`` from ``rounds`` interleaved
    samples of the candidate and the default graph's executable."""

    def __init__(self, sites: FusionSites, timer: SiteTimer | None = None, rounds: int = 3):
        self.sites = sites
        self.timer = timer or SiteTimer()
        self.rounds = rounds
        self.default_run = self.timer.build(sites.default_graph())
        self.cache: dict[tuple[bool, ...], float] = {}

    def __call__(self, decisions: Sequence[bool]) -> float:
        key = self.sites.key(decisions)
        if key not in self.cache:
            run = self.timer.build(self.sites.graph(key))
            t = self.timer.times({"default": self.default_run, key: run}, self.rounds)
            self.cache[key] = median(t["default"]) / median(t[key]) - 1.0
        return self.cache[key]


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


class FusionSitesEnv(gym.Env):
    """See the module docstring.

    Args:
        corpus: graphs, :class:`CorpusEntry` objects or :class:`FusionSites` (default:
            :func:`default_site_corpus`); graphs without a merge site are left out.
        reward: ``"measured"`` (default: cpu backend, :class:`MeasuredReward`) or
            ``"kernels"`` (:func:`kernel_reward`), or a callable ``(FusionSites) -> (decisions
            -> float)``.
        timer: the :class:`SiteTimer` of measured rewards.
        rounds: interleaved samples per measured reward.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, corpus: Sequence[Graph | CorpusEntry | FusionSites] | None = None, *,
                 reward: str | Callable[[FusionSites], Callable[[Sequence[bool]], float]] = "measured",
                 timer: SiteTimer | None = None, rounds: int = 3, max_nodes: int = 32,
                 render_mode: str | None = None):
        super().__init__()
        problems = []
        for e in (corpus if corpus is not None else default_site_corpus()):
            if isinstance(e, FusionSites):
                problems.append(e)
            elif isinstance(e, CorpusEntry):
                problems.append(FusionSites(e.graph, max_nodes=max_nodes, name=e.name))
            else:
                problems.append(FusionSites(e, max_nodes=max_nodes))
        self.problems = [p for p in problems if p.default_sites > 0]
        if not self.problems:
            raise ValueError("no graph of the corpus has a merge site")
        if reward not in ("measured", "kernels") and not callable(reward):
            raise ValueError(f"unknown reward {reward!r}; choose measured, kernels or a callable")
        self.reward_kind = reward
        self.timer = timer
        self.rounds = rounds
        self._rewards: dict[int, Callable[[Sequence[bool]], float]] = {}
        self.action_space = spaces.Discrete(2)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(len(SITE_FEATURES),), dtype=np.float32)
        self.render_mode = render_mode
        self.index = 0
        self.decisions: list[bool] = []
        self.current: Site | None = None
        self.last_reward = 0.0

    def reward_fn(self, index: int) -> Callable[[Sequence[bool]], float]:
        if index not in self._rewards:
            problem = self.problems[index]
            if self.reward_kind == "measured":
                if self.timer is None:
                    self.timer = SiteTimer()
                self._rewards[index] = MeasuredReward(problem, self.timer, self.rounds)
            elif self.reward_kind == "kernels":
                self._rewards[index] = kernel_reward(problem)
            else:
                self._rewards[index] = self.reward_kind(problem)
        return self._rewards[index]

    @property
    def problem(self) -> FusionSites:
        return self.problems[self.index]

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "index" in options:
            self.index = int(options["index"]) % len(self.problems)
        else:
            self.index = int(self.np_random.integers(len(self.problems)))
        self.decisions = []
        self.current = self.problem.site(())
        self.last_reward = 0.0
        return self.problem.features(self.current), self._info()

    def step(self, action):
        if self.current is None:
            raise RuntimeError("the episode is over: call reset()")
        self.decisions.append(int(action) == MERGE)
        self.current = self.problem.site(self.decisions)
        if self.current is not None:
            return self.problem.features(self.current), 0.0, False, False, self._info()
        reward = float(self.reward_fn(self.index)(self.decisions))
        self.last_reward = reward
        obs = np.zeros(len(SITE_FEATURES), dtype=np.float32)
        return obs, reward, True, False, self._info()

    def action_masks(self) -> np.ndarray:
        """Both actions at a site (the walk stops only at legal merges)."""
        return np.array([True, self.current is not None], dtype=bool)

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        merged = sum(self.decisions)
        return (f"{self.problem.name}: {len(self.decisions)} sites answered, {merged} merged"
                + ("" if self.current is not None else f", reward {self.last_reward:+.4f}"))

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"graph": self.problem.name, "decisions": tuple(self.decisions),
                                "action_mask": self.action_masks()}
        if self.current is not None:
            info["site"] = (self.current.producer.outputs[0].name if self.current.producer.outputs else "",
                            self.current.consumer.outputs[0].name if self.current.consumer.outputs else "")
        return info


# ---------------------------------------------------------------------------- training
def train_policy(corpus: Sequence[Graph | CorpusEntry | FusionSites], steps: int, *, reward: Any = "measured",
                 timer: SiteTimer | None = None, rounds: int = 3, seed: int = 0, n_steps: int = 256) -> Any:
    """A ``MaskablePPO`` policy (sb3-contrib) trained for ``steps`` environment steps on
    ``corpus`` with the given reward (default: measured through the cpu backend)."""
    from sb3_contrib import MaskablePPO

    env = FusionSitesEnv(corpus, reward=reward, timer=timer, rounds=rounds)
    env.reset(seed=seed)
    model = MaskablePPO("MlpPolicy", env, n_steps=n_steps, batch_size=64, seed=seed, verbose=0)
    model.learn(total_timesteps=steps)
    model.site_env = env
    return model


def policy_answers(model: Any, sites: FusionSites) -> tuple[bool, ...]:
    """The decision vector a trained policy gives ``sites`` (deterministic actions)."""

    def policy(site: Site) -> bool:
        action, _ = model.predict(sites.features(site), action_masks=np.array([True, True]), deterministic=True)
        return int(action) == MERGE

    return sites.answers(policy)


__all__ = [
    "KEEP", "MERGE", "NODE_CLASSES", "SITE_FEATURES", "FusionSites", "FusionSitesEnv", "MeasuredReward", "Site",
    "SiteTimer", "default_site_corpus", "graph_arguments", "kernel_reward", "median", "policy_answers", "train_policy",
]
