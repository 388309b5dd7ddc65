"""The shared mechanism of the per-site action kinds of :mod:`kiln.tuning.rl.site_kinds`.

One graph's problem (:class:`DecisionSites`) is a fixed list of *sites* (nodes or values of
the graph, in graph order), each answered yes or no; a *decision vector* is the answers in
site order, ``False`` (no) being the default pipeline's answer at every site, so the
all-``False`` vector (and ``()``) gives exactly what the default pipeline builds.  A problem
turns a vector into a graph and cpu backend options (:meth:`DecisionSites.build`) and a
site into an observation (:meth:`DecisionSites.features`, the kind's ``FEATURES``, each in
[0, 1]).

:class:`BuildReward` measures a vector through the cpu backend: ``default_time / time - 1``
(:class:`SiteTimer`, interleaved rounds against the default build)
minus ``memory_weight`` times the relative change of the planned peak (the executable's
``info["arena_bytes"]``, the liveness memory plan of :mod:`kiln.backends.common.memory_plan`);
with ``timed=False`` only the memory term (no timing).  :func:`liveness_peak` is a
graph-level estimate of that peak without building (for cheap rewards).

:class:`DecisionSitesEnv` is the gymnasium environment of one kind: an episode answers the
sites of one corpus graph in order; actions are ``0`` (no: the default) and ``1`` (yes: the
kind's action); :meth:`~DecisionSitesEnv.action_masks` allows both at a site; the reward is 0
per step and the vector's reward when the last site is answered.  The fusion environment
(:class:`kiln.tuning.rl.sites.FusionSitesEnv`) is this environment with
:class:`~kiln.tuning.rl.sites.FusionSites` problems, whose sites depend on the answers so far
(``site(decisions)`` replays the walk) and whose default answer is *merge*; it has the same
interface (``kind``, ``FEATURES``, ``site``, ``key``, ``features``, ``build``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from kiln.ir import Graph
from kiln.ir.sizes import estimated_nbytes
from kiln.passes.fusion import node_class
from kiln.runtime.timing import best_time
from kiln.tuning.rl.corpus import CorpusEntry

YES, NO = 1, 0
COMMON_FEATURES = ("site_position", "node_position", "yes_fraction")
"""The last features of every kind: the site's index / site count, its node's position in
the graph, and the fraction of the sites answered so far that were answered yes."""


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

    def build(self, graph: Graph, options: dict[str, Any] | None = None) -> Callable[[], Any]:
        """``run()`` calling the cpu executable of ``graph`` (built with ``options`` besides
        ``threads``) on seeded random arguments; ``run.info`` is the executable's ``info``."""
        import torch

        from kiln.backends import get_backend

        exe = get_backend("cpu").build(graph, {"threads": self.threads, **(options or {})})
        self.builds += 1
        signature = tuple((v.name, str(v.type)) for v in (*graph.inputs, *graph.params))
        if signature not in self._args:  # one set of arguments per signature: every candidate gets the same
            self._args[signature] = graph_arguments(graph, self.seed)
        args = self._args[signature]

        def run() -> Any:
            with torch.no_grad():
                return exe(args)

        run.info = exe.info  # type: ignore[attr-defined]
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


def log_feature(count: Any, scale: float = 24.0) -> float:
    """``log2(count) / scale`` in [0, 1] (1 for unknown or non-positive counts)."""
    count = count if isinstance(count, int) and count > 0 else 1
    return min(1.0, math.log2(count) / scale)


class DecisionSites:
    """The sites of one graph for one action kind (see the module docstring).

    Subclasses set :attr:`sites` (hashable site labels, in graph order), :attr:`positions`
    (each site's node position / node count) and implement :meth:`site_features` and
    :meth:`build`."""

    kind: ClassVar[str] = ""
    FEATURES: ClassVar[tuple[str, ...]] = COMMON_FEATURES

    def __init__(self, graph: Graph, name: str | None = None):
        self.name = name or graph.name
        self.source = graph
        self.sites: list[Any] = []
        self.positions: list[float] = []
        self._default: tuple[Graph, dict[str, Any]] | None = None

    @property
    def default_sites(self) -> int:
        return len(self.sites)

    def site(self, decisions: Sequence[bool]) -> int | None:
        """The index of the site after answering ``decisions`` (``None``: all answered)."""
        return len(decisions) if len(decisions) < len(self.sites) else None

    def key(self, decisions: Sequence[bool]) -> tuple[bool, ...]:
        """``decisions`` cut to the site count and padded with ``False`` (the default)."""
        d = tuple(bool(x) for x in decisions[:len(self.sites)])
        return d + (False,) * (len(self.sites) - len(d))

    def answers(self, policy: Callable[[int], bool]) -> tuple[bool, ...]:
        """The vector answering site ``i`` with ``policy(i)``."""
        return tuple(bool(policy(i)) for i in range(len(self.sites)))

    def chosen(self, decisions: Sequence[bool]) -> list[Any]:
        """The sites answered yes."""
        return [s for s, d in zip(self.sites, self.key(decisions)) if d]

    def features(self, index: int, decisions: Sequence[bool] = ()) -> np.ndarray:
        """The kind's ``FEATURES`` of site ``index`` after ``decisions``."""
        head = list(self.site_features(index))
        yes = sum(bool(d) for d in decisions[:index])
        head += [index / max(1, len(self.sites)), self.positions[index], yes / index if index else 0.0]
        return np.clip(np.asarray(head, dtype=np.float32), 0.0, 1.0)

    def site_features(self, index: int) -> Sequence[float]:
        raise NotImplementedError

    def site_label(self, index: int) -> str:
        return str(self.sites[index])

    def build(self, decisions: Sequence[bool]) -> tuple[Graph, dict[str, Any]]:
        """The graph and cpu backend options under ``decisions``."""
        raise NotImplementedError

    def graph(self, decisions: Sequence[bool]) -> Graph:
        return self.build(decisions)[0]

    def default_build(self) -> tuple[Graph, dict[str, Any]]:
        """What the default pipeline and the cpu backend's default options build."""
        raise NotImplementedError

    def cheap_reward(self, kind: str, memory_weight: float) -> Callable[[Sequence[bool]], float]:
        """A reward without builds (``kind`` is the environment's ``reward``)."""
        raise ValueError(f"{type(self).__name__} has no reward {kind!r}")


def liveness_peak(graph: Graph) -> int:
    """Peak bytes of the results alive at once when ``graph``'s nodes run in order: each
    result is alive from its node to its last reader (to the end for graph outputs); view
    results share their operand's storage; inputs, params and constants are not counted."""
    root: dict[Any, Any] = {}
    last: dict[Any, int] = {}
    end = len(graph.nodes)
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            last[root.get(v, v)] = i
        view = node_class(n) == "view" and n.inputs
        for v in n.outputs:
            root[v] = root.get(n.inputs[0], n.inputs[0]) if view else v
    for v in graph.outputs:
        last[root.get(v, v)] = end
    live = peak = 0
    frees: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in n.outputs:
            if root[v] is v:
                nbytes = estimated_nbytes(v.type)
                live += nbytes
                frees[last.get(v, i)] = frees.get(last.get(v, i), 0) + nbytes
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    return peak


class BuildReward:
    """The measured reward of a problem's vectors (module docstring), cached by
    :meth:`DecisionSites.key`; ``memory`` holds each key's relative peak change."""

    def __init__(self, problem: DecisionSites, timer: SiteTimer | None = None, rounds: int = 3,
                 memory_weight: float = 0.0, timed: bool = True):
        self.problem = problem
        self.timer = timer or SiteTimer()
        self.rounds = rounds
        self.memory_weight = memory_weight
        self.timed = timed
        self.default_run = self.timer.build(*problem.default_build())
        self.default_arena = self.default_run.info["arena_bytes"]
        self.cache: dict[tuple[bool, ...], float] = {}
        self.memory: dict[tuple[bool, ...], float] = {}

    def __call__(self, decisions: Sequence[bool]) -> float:
        key = self.problem.key(decisions)
        if key not in self.cache:
            run = self.timer.build(*self.problem.build(key))
            self.memory[key] = run.info["arena_bytes"] / max(1, self.default_arena) - 1.0
            speedup = 0.0
            if self.timed:
                t = self.timer.times({"default": self.default_run, key: run}, self.rounds)
                speedup = median(t["default"]) / median(t[key]) - 1.0
            self.cache[key] = speedup - self.memory_weight * self.memory[key]
        return self.cache[key]


class DecisionSitesEnv(gym.Env):
    """The environment of one action kind (module docstring).

    Args:
        corpus: graphs, :class:`CorpusEntry` objects or problems of the kind (default: the
            kind's :meth:`default_corpus`); graphs without a site are left out.
        reward: ``"measured"`` (:class:`BuildReward`), ``"arena"`` (its memory term only,
            built but not timed), a kind's cheap reward, or a callable ``(problem) ->
            (decisions -> float)``.
        timer, rounds: the measurement of measured rewards.
        memory_weight: the weight of the relative peak-memory change (default: the kind's
            :attr:`MEMORY_WEIGHT`).
        options: passed to the kind's problem constructor.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}
    problem_type: ClassVar[type] = DecisionSites
    """The problem class (a :class:`DecisionSites`, or one with its interface: ``kind``,
    ``FEATURES``, ``default_sites``, ``site``, ``key``, ``features``, ``site_label``,
    ``build``, ``default_build``, ``cheap_reward``)."""
    MEMORY_WEIGHT: ClassVar[float] = 0.0

    def __init__(self, corpus: Sequence[Any] | None = None, *, reward: Any = "measured",
                 timer: SiteTimer | None = None, rounds: int = 3, memory_weight: float | None = None,
                 render_mode: str | None = None, **options: Any):
        super().__init__()
        problems = []
        for e in (corpus if corpus is not None else self.default_corpus()):
            if isinstance(e, self.problem_type):
                problems.append(e)
            elif isinstance(e, CorpusEntry):
                problems.append(self.problem_type(e.graph, name=e.name, **options))
            else:
                problems.append(self.problem_type(e, **options))
        self.problems = [p for p in problems if p.default_sites > 0]
        if not self.problems:
            raise ValueError(f"no graph of the corpus has a {self.problem_type.kind} site")
        self.reward_kind = reward
        self.timer = timer
        self.rounds = rounds
        self.memory_weight = self.MEMORY_WEIGHT if memory_weight is None else float(memory_weight)
        self._rewards: dict[int, Callable[[Sequence[bool]], float]] = {}
        self.action_space = spaces.Discrete(2)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(len(self.problem_type.FEATURES),), dtype=np.float32)
        self.render_mode = render_mode
        self.index = 0
        self.decisions: list[bool] = []
        self.current: int | None = None
        self.last_reward = 0.0
        if not callable(reward) and reward not in ("measured", "arena"):
            self.problems[0].cheap_reward(reward, self.memory_weight)  # raises for unknown rewards

    @classmethod
    def default_corpus(cls) -> list[Graph]:
        raise NotImplementedError

    def reward_fn(self, index: int) -> Callable[[Sequence[bool]], float]:
        if index not in self._rewards:
            problem = self.problems[index]
            if callable(self.reward_kind):
                self._rewards[index] = self.reward_kind(problem)
            elif self.reward_kind in ("measured", "arena"):
                if self.timer is None:
                    self.timer = SiteTimer()
                self._rewards[index] = BuildReward(problem, self.timer, self.rounds, self.memory_weight,
                                                   timed=self.reward_kind == "measured")
            else:
                self._rewards[index] = problem.cheap_reward(self.reward_kind, self.memory_weight)
        return self._rewards[index]

    @property
    def problem(self) -> Any:
        return self.problems[self.index]

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
        return self.problem.features(self.current, ()), self._info()

    def step(self, action):
        if self.current is None:
            raise RuntimeError("the episode is over: call reset()")
        self.decisions.append(int(action) == YES)
        self.current = self.problem.site(self.decisions)
        if self.current is not None:
            return self.problem.features(self.current, self.decisions), 0.0, False, False, self._info()
        reward = float(self.reward_fn(self.index)(self.decisions))
        self.last_reward = reward
        return np.zeros(self.observation_space.shape, dtype=np.float32), reward, True, False, self._info()

    def action_masks(self) -> np.ndarray:
        """Both answers at a site; only "no" once every site is answered."""
        return np.array([True, self.current is not None], dtype=bool)

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return (f"{self.problem.name}: {len(self.decisions)} of {self.problem.default_sites} "
                f"{self.problem.kind} sites answered, {sum(self.decisions)} yes"
                + ("" if self.current is not None else f", reward {self.last_reward:+.4f}"))

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"graph": self.problem.name, "decisions": tuple(self.decisions),
                                "action_mask": self.action_masks()}
        if self.current is not None:
            info["site"] = self.problem.site_label(self.current)
        return info


__all__ = ["COMMON_FEATURES", "NO", "YES", "BuildReward", "DecisionSites", "DecisionSitesEnv", "SiteTimer",
           "graph_arguments", "liveness_peak", "log_feature", "median"]
