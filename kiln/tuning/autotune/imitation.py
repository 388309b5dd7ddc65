"""Demonstrations for the ``kiln/ScheduleKernel-v0`` policy, and cloning a policy from them.

A MaskablePPO policy trained from scratch on measured, end-of-episode rewards learns to
stop: from kiln's default schedule most single steps slow a kernel down, so ``stop`` has the
best expected reward until the policy has met the few steps that pay, and measured episodes
are too slow (a C compile each) for it to meet them often.  Expert iteration gives it those
steps first:

* :func:`greedy_demonstration` searches the environment's own action space: from the
  episode's start it measures the schedule of every legal action (all of them built in one
  batch, through the environment's compile pool), takes the fastest while it beats the
  current schedule by ``min_gain``, and stops otherwise.  The (observation, mask, action)
  of each step is a labelled example; every schedule it measures passed the isl check
  (only the mask's actions are tried).
* :func:`clone` fits a MaskablePPO policy's action scores to the measured gain of every
  action tried (not only to the expert's choice): the policy starts from the steps measured
  to pay instead of from stopping.  (PPO run after the fit has so far lowered its results
  on held-out kernels: ``docs/tuning.md``.)
* :func:`dagger` runs the fitted policy, labels the states it reaches the same way and fits
  it again (dataset aggregation): the expert's episodes never show what to do after a
  step the expert would not have taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .env import ScheduleKernelEnv

WORST_GAIN, MAX_GAIN = -2.0, 3.0
"""The measured ``log2`` gains the policy is fitted to are clipped to this range (a step that
makes a kernel 16x slower teaches no more than one that makes it 4x slower)."""


@dataclass
class Demonstration:
    """One labelled episode on kernel ``index`` (the greedy expert's, or the policy's own in
    :func:`dagger`): its steps and the measured speedup of the schedule it ends at over the
    default."""

    index: int
    observations: list[np.ndarray]
    masks: list[np.ndarray]
    actions: list[int]
    gains: list[dict[int, float]]
    """Per step, the measured ``log2`` gain of every legal action over the current schedule
    (``stop``: 0; a wrong or uncompilable schedule: :data:`WORST_GAIN`)."""
    speedup: float
    measurements: int


Chooser = Callable[[np.ndarray, np.ndarray, dict[int, float]], int]
"""``choose(observation, mask, gains) -> action`` for :func:`measured_episode`."""


def measured_episode(env: ScheduleKernelEnv, index: int, choose: Chooser) -> Demonstration:
    """An episode of ``env`` on kernel ``index`` in which every state is labelled: the
    schedules of all legal actions are measured (one batch) and their ``log2`` gains over
    the current schedule kept; ``choose`` then picks the action taken."""
    stop = len(env.actions) - 1
    static = env.kernels[index][0]
    m = env.measurer(index)
    obs, _ = env.reset(options={"index": index})
    current = m.time_of(env.schedule.program(name=static.name)) or math.inf
    out = Demonstration(index, [], [], [], [], 1.0, 0)
    done = False
    while not done:
        successors = env.successors()
        actions = list(successors)
        times = dict(zip(actions, m.measure([successors[a].program(name=static.name) for a in actions])))
        out.measurements += len(actions)
        gains = {a: (min(MAX_GAIN, max(WORST_GAIN, math.log2(current / t))) if t else WORST_GAIN)
                 for a, t in times.items()}
        gains[stop] = 0.0
        mask = env.action_masks()
        action = int(choose(obs, mask, gains))
        out.observations.append(obs)
        out.masks.append(mask)
        out.actions.append(action)
        out.gains.append(gains)
        obs, _, terminated, truncated, _ = env.step(action)
        done = terminated or truncated
        if action != stop and times.get(action):
            current = times[action]
    out.speedup = env.default_time(index) / current
    return out


def greedy_demonstration(env: ScheduleKernelEnv, index: int, *, min_gain: float = 1.03) -> Demonstration:
    """The measured greedy episode of ``env`` on kernel ``index`` (see the module docstring)."""
    stop = len(env.actions) - 1

    def greedy(obs: np.ndarray, mask: np.ndarray, gains: dict[int, float]) -> int:
        best = max(gains, key=gains.__getitem__)
        return best if gains[best] > math.log2(min_gain) else stop

    return measured_episode(env, index, greedy)


def dagger(env: ScheduleKernelEnv, agent: Any, demos: Sequence[Demonstration], *, rounds: int = 1,
           episodes: int = 1, **fit: Any) -> list[Demonstration]:
    """Dataset aggregation: ``rounds`` times, run ``agent``'s policy on every kernel of
    ``env`` (``episodes`` episodes, the first deterministic, the others sampled), label the
    states it visits with measured gains (:func:`measured_episode`), and fit it again
    (:func:`clone`, with ``fit``) to those and all earlier ones -- so it also learns what to
    do in the states its own mistakes lead to, which the expert never visits.  Returns all
    the labelled episodes."""
    data = list(demos)
    for _ in range(rounds):
        for index in range(len(env.kernels)):
            for e in range(episodes):
                def follow(obs: np.ndarray, mask: np.ndarray, gains: dict[int, float], deterministic=e == 0) -> int:
                    return int(agent.predict(obs, action_masks=mask, deterministic=deterministic)[0])

                data.append(measured_episode(env, index, follow))
        clone(agent, data, **fit)
    return data


def demonstrations(env: ScheduleKernelEnv, *, min_gain: float = 1.03) -> list[Demonstration]:
    """:func:`greedy_demonstration` on every kernel of ``env``."""
    return [greedy_demonstration(env, i, min_gain=min_gain) for i in range(len(env.kernels))]


def clone(agent: Any, demos: Sequence[Demonstration], *, epochs: int = 1000, lr: float = 1e-3,
          sharpness: float = 4.0) -> float:
    """Fit ``agent``'s policy (a ``sb3_contrib.MaskablePPO``) to the demonstrations: the logit of
    every legal action measured in a state is regressed on ``sharpness`` times its measured
    ``log2`` gain (``stop`` on 0), so the policy prefers steps in proportion to what they were
    measured to give -- every measurement of the search teaches it, not only the argmax.
    Returns the last epoch's mean squared error."""
    import torch  # noqa: PLC0415

    policy = agent.policy
    obs = torch.as_tensor(np.stack([o for d in demos for o in d.observations]), device=policy.device)
    steps = [g for d in demos for g in d.gains]
    rows = torch.as_tensor([r for r, g in enumerate(steps) for _ in g], device=policy.device)
    cols = torch.as_tensor([a for g in steps for a in g], device=policy.device)
    target = sharpness * torch.as_tensor([v for g in steps for v in g.values()], dtype=torch.float32,
                                         device=policy.device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    policy.set_training_mode(True)
    loss = torch.zeros(())
    for _ in range(epochs):
        logits = policy.action_net(policy.mlp_extractor.forward_actor(policy.extract_features(obs, policy.pi_features_extractor)))
        loss = ((logits[rows, cols] - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.set_training_mode(False)
    return float(loss.detach())


__all__ = ["Chooser", "Demonstration", "clone", "dagger", "demonstrations", "greedy_demonstration",
           "measured_episode"]
