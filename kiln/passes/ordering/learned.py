"""The learned pipeline: a small trained policy orders kiln's passes for each graph.

:class:`PolicyNet` is the policy network of a trained ``MaskablePPO`` agent exported to
numpy (``policy.npz`` in this package is the shipped one), so using it needs neither torch
nor gymnasium nor stable-baselines3.  It stores everything it was trained with: its action
pipeline texts, the observation vocabulary, history length, step budget and cost.

:class:`LearnedPipeline` (``kiln.passes.learned_pipeline()``, ``kiln.compile(...,
passes="learned")``) runs one deterministic episode on the graph: at each step it masks the
actions that would not change the graph and applies the policy's highest-scoring remaining
action, until the policy stops or the budget is spent.  With ``fallback=True`` (default) it
also runs the default pipeline and keeps the policy's graph only if it is not worse by the
policy's cost and, on equal cost, by op count; :attr:`LearnedPipeline.last` records what was
chosen and why.

Guarantees: the input graph is never modified; the result is verified; for the same graph
and policy the result is always the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.ir import Graph, verify
from kiln.passes.base import PassResult
from kiln.passes.ordering.actions import Action, action_set
from kiln.passes.ordering.cost import op_count
from kiln.passes.ordering.episode import CostModel, Episode
from kiln.passes.ordering.observation import ObservationSpec
from kiln.passes.ordering.transitions import TransitionCache
from kiln.passes.pipeline import default_pipeline

SHIPPED_POLICY = Path(__file__).with_name("policy.npz")
"""The policy shipped with kiln (trained with ``cost="runtime"`` on the training corpus)."""


@dataclass
class PolicyNet:
    """A tanh MLP policy head in numpy: ``logits = head(tanh(... tanh(W1 x + b1)))``."""

    hidden: list[tuple[np.ndarray, np.ndarray]]
    """``(weight [out, in], bias [out])`` per hidden layer."""
    head: tuple[np.ndarray, np.ndarray]
    actions: tuple[str, ...]
    """Pipeline text per action; the last is ``"stop"``."""
    op_names: tuple[str, ...]
    history: int
    budget: int
    cost: str
    machine: str = "cpu"
    include_mask: bool = True
    """Whether observations carry the action mask (see :mod:`~kiln.passes.ordering.observation`)."""
    info: dict[str, Any] = field(default_factory=dict)

    def logits(self, observation: np.ndarray) -> np.ndarray:
        x = np.asarray(observation, dtype=np.float64)
        for weight, bias in self.hidden:
            x = np.tanh(weight @ x + bias)
        weight, bias = self.head
        return weight @ x + bias

    def act(self, observation: np.ndarray, mask: np.ndarray) -> int:
        """The highest-scoring allowed action (ties: the lowest index)."""
        scores = np.where(np.asarray(mask, dtype=bool), self.logits(observation), -np.inf)
        return int(np.argmax(scores))

    def preference(self, observation: np.ndarray) -> list[int]:
        """Every action, highest score first (ties: the lowest index first)."""
        return [int(a) for a in np.argsort(-self.logits(observation), kind="stable")]

    def action_set(self) -> tuple[Action, ...]:
        return action_set([a for a in self.actions if a != "stop"])

    def observation_spec(self) -> ObservationSpec:
        return ObservationSpec(self.op_names, len(self.actions), self.history, self.include_mask)

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        meta = {
            "actions": list(self.actions),
            "op_names": list(self.op_names),
            "history": self.history,
            "budget": self.budget,
            "cost": self.cost,
            "machine": self.machine,
            "info": self.info,
            "include_mask": self.include_mask,
            "layers": len(self.hidden),
        }
        arrays = {"meta": np.array(json.dumps(meta))}
        for i, (w, b) in enumerate(self.hidden):
            arrays[f"hidden{i}_weight"], arrays[f"hidden{i}_bias"] = (
                w.astype(np.float32),
                b.astype(np.float32),
            )
        arrays["head_weight"], arrays["head_bias"] = (
            self.head[0].astype(np.float32),
            self.head[1].astype(np.float32),
        )
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)

    @staticmethod
    def load(path: str | Path) -> PolicyNet:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            hidden = [
                (data[f"hidden{i}_weight"].astype(np.float64), data[f"hidden{i}_bias"].astype(np.float64))
                for i in range(meta["layers"])
            ]
            head = (data["head_weight"].astype(np.float64), data["head_bias"].astype(np.float64))
        policy = PolicyNet(
            hidden,
            head,
            tuple(meta["actions"]),
            tuple(meta["op_names"]),
            meta["history"],
            meta["budget"],
            meta["cost"],
            meta.get("machine", "cpu"),
            meta.get("include_mask", True),
            meta.get("info", {}),
        )
        expected = policy.observation_spec().size
        if hidden and hidden[0][0].shape[1] != expected:
            raise ValueError(
                f"policy {path}: first layer takes {hidden[0][0].shape[1]} features but "
                f"its observation spec has {expected}"
            )
        return policy


def rollout(
    policy: PolicyNet, graph: Graph, cache: TransitionCache | None = None, cost: CostModel | None = None
) -> Episode:
    """One deterministic episode of ``policy`` on ``graph``; returns the finished episode.

    Each step takes the highest-scoring action that changes the graph (or ``stop``).  When
    the policy does not observe the mask, actions are tried in score order and only until
    one changes the graph, so few passes run per step; the choice is the same as with the
    full mask.
    """
    cache = cache if cache is not None else TransitionCache(policy.action_set())
    cost = cost if cost is not None else CostModel(policy.cost, policy.machine)
    episode = Episode(graph, cache, cost, policy.observation_spec(), policy.budget)
    while not episode.finished:
        observation = episode.observation()
        if policy.include_mask:
            episode.tried += len(cache.actions) - 1
            episode.step(policy.act(observation, episode.mask()))
            continue
        for action in policy.preference(observation):
            if cache.actions[action].is_stop:
                episode.step(action)
                break
            episode.tried += 1
            if cache.apply(episode.key, action) != episode.key:
                episode.step(action)
                break
    return episode


_SHIPPED: PolicyNet | None = None


def shipped_policy() -> PolicyNet:
    """The policy in ``policy.npz`` (loaded once)."""
    global _SHIPPED
    if _SHIPPED is None:
        if not SHIPPED_POLICY.exists():
            raise FileNotFoundError(
                f"no shipped policy at {SHIPPED_POLICY}; train one with "
                "`kiln tune-passes` or python -m kiln.tuning.rl.train"
            )
        _SHIPPED = PolicyNet.load(SHIPPED_POLICY)
    return _SHIPPED


@dataclass
class Choice:
    """What :meth:`LearnedPipeline.run` did on its last graph."""

    chosen: str
    """``"policy"`` or ``"default"``."""
    policy_cost: float
    default_cost: float | None
    trace: list[str]


class LearnedPipeline:
    """Orders passes per graph with a trained policy (see the module docstring).

    Args:
        policy: a :class:`PolicyNet`, a path to a ``.npz`` policy, or ``None`` for the
            shipped policy.
        fallback: compare with the default pipeline and keep the better graph by the policy's
            cost, then by op count (a runtime-trained policy is indifferent to redundant work
            inside kernels that the estimate does not see); the policy's graph on a full tie.
        verify: verify the result.
        cost: the cost the episode and the fallback use (default: the policy's, which must
            be an estimate of :mod:`~kiln.passes.ordering.cost`; a policy trained on measured
            time takes ``kiln.tuning.rl.costs.cost_model("measured")``).
    """

    def __init__(
        self, policy: PolicyNet | str | Path | None = None, *, fallback: bool = True, verify: bool = True,
        cost: CostModel | None = None,
    ):
        if policy is None:
            policy = shipped_policy()
        elif not isinstance(policy, PolicyNet):
            policy = PolicyNet.load(policy)
        self.policy = policy
        self.fallback = fallback
        self.verify = verify
        self.cost = cost
        self.last: Choice | None = None

    def run(self, graph: Graph) -> PassResult:
        cache = TransitionCache(self.policy.action_set(), verify=self.verify)
        cost = self.cost if self.cost is not None else CostModel(self.policy.cost, self.policy.machine)
        episode = rollout(self.policy, graph, cache, cost)
        result, chosen, default_cost = episode.graph, "policy", None
        if self.fallback:
            default = default_pipeline(verify=False).run(graph).graph  # the result is verified below
            default_cost = cost(cache, cache.intern(default))
            policy_key = (episode.cost, op_count(episode.graph))
            if (default_cost, op_count(default)) < policy_key:
                result, chosen = default, "default"
        if self.verify:
            verify(result)
        self.last = Choice(chosen, episode.cost, default_cost, episode.trace())
        return PassResult(result, result is not graph and str(result) != str(graph))

    def spec(self) -> str:
        return "learned"

    def __repr__(self) -> str:
        return (
            f"LearnedPipeline(actions={len(self.policy.actions)}, cost={self.policy.cost!r}, "
            f"budget={self.policy.budget}, fallback={self.fallback})"
        )


def learned_pipeline(policy: PolicyNet | str | Path | None = None, **options: Any) -> LearnedPipeline:
    """The learned pipeline object (``.run(graph) -> PassResult``); see :class:`LearnedPipeline`."""
    return LearnedPipeline(policy, **options)
