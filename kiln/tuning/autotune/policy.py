"""A MaskablePPO policy for ``kiln/ScheduleKernel-v0`` that scores every loop slot with the same weights.

The environment's actions are (loop slot, primitive) pairs.  sb3's default ``MlpPolicy``
reads the whole observation and has a separate output per pair, so what it learns about
unrolling the innermost reduction loop of one kernel (slot 3 there) says nothing about the
same loop of another kernel (slot 5).  :class:`SlotPolicy` scores the primitives of each slot
with one small network applied to that slot's features and its neighbours' (slots are in
program order: the next one is usually the nested loop an interchange or a tile pairs it
with) and the fraction of steps used; ``stop`` gets its own score from the kernel's features.
The slot scores do not see the kernel's features: with them, a policy fitted to the
demonstrations of 13 kernels reproduced each one's steps and gained nothing on held-out
kernels (``docs/tuning.md``); without them it can only learn what a loop's accesses and
marks call for, which is what carries over.  The value function stays an MLP over the whole observation.  Use::

    from sb3_contrib import MaskablePPO
    from kiln.tuning.autotune.policy import SlotPolicy
    agent = MaskablePPO(SlotPolicy, env)

The observation layout is :class:`~.env.ScheduleKernelEnv`'s: the :data:`~.features.FEATURE_NAMES`,
then ``max_loops`` blocks of :data:`~.env.SLOT_FEATURES`, then the step fraction.
"""

from __future__ import annotations

from typing import Any

import torch
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from torch import nn

from .env import ACTION_KINDS, SLOT_FEATURES
from .features import FEATURE_NAMES

SCALE = 0.1
"""Inputs are logs, counts and flags (up to ~30): scaled to about unit range."""


class SlotScorer(nn.Module):
    """``forward(obs) -> (action scores, value latent)`` for :class:`SlotPolicy`."""

    def __init__(self, obs_size: int, hidden: int = 64):
        super().__init__()
        self.globals = len(FEATURE_NAMES)
        self.slots = (obs_size - self.globals - 1) // SLOT_FEATURES
        if self.globals + self.slots * SLOT_FEATURES + 1 != obs_size:
            raise ValueError(f"SlotPolicy: an observation of {obs_size} values is not ScheduleKernelEnv's layout "
                             f"({self.globals} kernel features, blocks of {SLOT_FEATURES}, the step fraction)")
        per_slot = 3 * SLOT_FEATURES + 1
        self.score = nn.Sequential(nn.Linear(per_slot, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                   nn.Linear(hidden, len(ACTION_KINDS)))
        self.stop = nn.Sequential(nn.Linear(self.globals + 1, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.value = nn.Sequential(nn.Linear(obs_size, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.latent_dim_pi = self.slots * len(ACTION_KINDS) + 1
        self.latent_dim_vf = hidden

    def forward_actor(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs * SCALE
        kernel, step = x[:, : self.globals], x[:, -1:]
        slots = x[:, self.globals: self.globals + self.slots * SLOT_FEATURES].reshape(-1, self.slots, SLOT_FEATURES)
        pad = torch.zeros_like(slots[:, :1])
        before, after = torch.cat([pad, slots[:, :-1]], 1), torch.cat([slots[:, 1:], pad], 1)
        context = step.unsqueeze(1).expand(-1, self.slots, -1)
        scores = self.score(torch.cat([context, slots, before, after], 2)).reshape(obs.shape[0], -1)
        return torch.cat([scores, self.stop(torch.cat([kernel, step], 1))], 1)

    def forward_critic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.value(obs * SCALE)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_actor(obs), self.forward_critic(obs)


class SlotPolicy(MaskableActorCriticPolicy):
    """See the module docstring."""

    def __init__(self, *args: Any, hidden: int = 64, **kwargs: Any):
        self.hidden = hidden
        super().__init__(*args, **kwargs)

    def _build_mlp_extractor(self) -> None:
        self.mlp_extractor = SlotScorer(self.features_dim, self.hidden)

    def _build(self, lr_schedule: Any) -> None:
        super()._build(lr_schedule)
        if self.mlp_extractor.latent_dim_pi != self.action_space.n:
            raise ValueError(f"SlotPolicy: {self.mlp_extractor.latent_dim_pi} scores for {self.action_space.n} "
                             "actions: the environment's actions are not ScheduleKernelEnv's")
        self.action_net = nn.Identity()  # the scorer's outputs are the logits
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)


__all__ = ["SlotPolicy", "SlotScorer"]
