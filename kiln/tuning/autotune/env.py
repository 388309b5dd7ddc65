"""``kiln/ScheduleKernel-v0``: scheduling one loop kernel, with legality as the action mask.

An episode schedules one kernel drawn from the environment's set, starting from its
unscheduled program (``start="unscheduled"``) or from kiln's default schedule for it
(``start="default"``: the steps then refine what the cpu backend would build, and ``stop``
at once is the default's time, reward 0).  Actions are schedule primitives with arguments, on loop *slots* (the
schedule's loops in program order, outer to inner, at most ``max_loops``):
:data:`ACTION_KINDS` per slot, plus ``stop``.  :meth:`ScheduleKernelEnv.action_masks` is
true exactly for the actions whose step passes the isl legality check (and applies
structurally) from the current schedule, as sb3-contrib's ``MaskablePPO`` expects; the mask
is also ``info["action_mask"]``.  A masked action may still be sent (gymnasium's checker
does): it leaves the schedule unchanged and costs a small penalty.

Rewards come at the end of an episode (``stop``, or ``max_steps`` steps): ``log2`` of the
kernel's default-schedule time over the final schedule's time, measured with the cpu
backend's code (:class:`~.measure.Measurer`: compiled, checked against the unscheduled
program, timed with ``best_time``; equal code is measured once, so a seed and an action
sequence give the same rewards).  With ``reward="model"`` a fitted
:class:`~.costmodel.CostModel` predicts the speedup instead, and every ``measure_every``-th
episode is measured (``info["measured"]``).

Observations: the :mod:`.features` of the current scheduled program, then per slot
(exists, depth, log2 extent, innermost, has a directly nested loop, parallel, vectorized,
unrolled, then :func:`~.features.loop_features`: how the accesses inside the loop move along
it and whether it carries a reduction), then the fraction of steps used.  A loop already
marked (parallel, vectorized, unrolled) offers no second mark.
:meth:`ScheduleKernelEnv.successors` gives the schedule each legal action leads to (what
:mod:`.imitation` measures), :meth:`ScheduleKernelEnv.rollouts` schedules one kernel with a
policy's episodes and measures their outcomes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from kiln.backends.cpu.schedules import strategy_schedule
from kiln.ir.errors import IllegalTransformError, KilnError, ScheduleError
from kiln.ir.loops.program import Program
from kiln.passes.schedule import Schedule

from . import space
from .features import FEATURE_NAMES, LOOP_FEATURE_NAMES, features, loop_features
from .measure import Measurer, specialize

ACTION_KINDS = ("parallel", "vectorize", "unroll4", "unroll8", "interchange", "tile16", "tile32", "tile64",
                "fission1")
SLOT_FEATURES = 8 + len(LOOP_FEATURE_NAMES)
INVALID_PENALTY = -0.01
OBS_BOUND = 1e4
"""Features are logs, counts and flags: far inside this bound."""


def default_kernels() -> list[tuple[Program, dict[str, int], str]]:
    """Three small kernels (a matmul, a row reduction, a 2-D stencil) at sizes that time in
    well under a millisecond: what ``gymnasium.make("kiln/ScheduleKernel-v0")`` schedules."""
    from kiln.ir.loops.cfront import from_c  # noqa: PLC0415

    mm = from_c("for (i = 0; i < N; i++) for (j = 0; j < N; j++) { C[i][j] = 0;"
                " for (k = 0; k < N; k++) C[i][j] += A[i][k] * B[k][j]; }", name="mm")
    rows = from_c("for (i = 0; i < N; i++) { s[i] = 0; for (j = 0; j < M; j++) s[i] += x[i][j] * x[i][j]; }",
                  name="rowsq")
    blur = from_c("for (i = 1; i < N - 1; i++) for (j = 1; j < N - 1; j++)"
                  " B[i][j] = (A[i-1][j] + A[i+1][j] + A[i][j-1] + A[i][j+1]) * 0.25;", name="blur")
    return [(mm, {"N": 48}, "matmul"), (rows, {"N": 64, "M": 256}, "reduction"), (blur, {"N": 96}, "elementwise")]


class ScheduleKernelEnv(gym.Env):
    """See the module docstring.

    Args:
        kernels: ``(program, params, kind)`` triples (default: :func:`default_kernels`).
        max_steps: steps per episode.
        max_loops: loop slots in the action space.
        reward: ``"measured"`` or ``"model"`` (needs ``cost_model``).
        measure_every: with ``reward="model"``, measure every this many episodes.
        threads: threads the default schedules plan for (default 2).
        start: ``"unscheduled"`` or ``"default"`` (see the module docstring).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, kernels: Sequence[tuple[Program, Mapping[str, int | float], str]] | None = None, *,
                 max_steps: int = 6, max_loops: int = 8, reward: str = "measured", cost_model: Any = None,
                 measure_every: int = 4, threads: int = 2, repeat: int = 3, cache_dir: str | None = None,
                 start: str = "unscheduled", pool: Executor | None = None):
        if start not in ("unscheduled", "default"):
            raise ValueError(f"ScheduleKernelEnv: start must be 'unscheduled' or 'default', got {start!r}")
        self.start = start
        if reward not in ("measured", "model"):
            raise ValueError(f"ScheduleKernelEnv: reward must be 'measured' or 'model', got {reward!r}")
        if reward == "model" and cost_model is None:
            raise ValueError("ScheduleKernelEnv: reward='model' needs a fitted cost_model "
                             "(kiln.tuning.autotune.costmodel.CostModel().fit(X, y))")
        self.kernels = []
        for program, params, kind in (kernels if kernels is not None else default_kernels()):
            static = specialize(program, {k: int(v) for k, v in params.items() if k in program.size_params})
            scalars = {p.name: float(params[p.name]) for p in static.params}
            self.kernels.append((static, scalars, kind))
        if not self.kernels:
            raise ValueError("ScheduleKernelEnv: give at least one kernel")
        self.max_steps, self.max_loops = int(max_steps), int(max_loops)
        self.reward_mode, self.cost_model, self.measure_every = reward, cost_model, max(1, int(measure_every))
        self.threads, self.repeat, self.cache_dir, self.pool = threads, repeat, cache_dir, pool
        self.actions = [(slot, kind) for slot in range(self.max_loops) for kind in ACTION_KINDS] + [(None, "stop")]
        self.action_space = spaces.Discrete(len(self.actions))
        size = len(FEATURE_NAMES) + self.max_loops * SLOT_FEATURES + 1
        self.observation_space = spaces.Box(-OBS_BOUND, OBS_BOUND, shape=(size,), dtype=np.float32)
        self._measurers: dict[int, Measurer] = {}
        self._defaults: dict[int, float] = {}
        self._starts: dict[int, Schedule] = {}
        self._successors: dict[int, Schedule] = {}
        self._episodes = 0
        self.index = 0
        self.schedule: Schedule | None = None
        self.steps = 0

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if options and "index" in options:
            self.index = int(options["index"]) % len(self.kernels)
        else:
            self.index = int(self.np_random.integers(len(self.kernels)))
        self.schedule = self._initial_schedule(self.index)
        self.steps = 0
        self._mask = self._compute_mask()
        return self._observation(), {"action_mask": self._mask.copy(), "kernel": self.index}

    def step(self, action: int):
        assert self.schedule is not None, "call reset() first"
        slot, kind = self.actions[int(action)]
        self.steps += 1
        reward = 0.0
        info: dict[str, Any] = {"kernel": self.index}
        if kind == "stop":
            terminated = True
        else:
            terminated = False
            step = self._step_of(slot, kind)
            if not self._mask[int(action)] or step is None or not self._apply(self.schedule, step):
                reward = INVALID_PENALTY
        truncated = not terminated and self.steps >= self.max_steps
        if terminated or truncated:
            reward += self._final_reward(info)
        self._mask = self._compute_mask()
        info["action_mask"] = self._mask.copy()
        return self._observation(), float(reward), terminated, truncated, info

    def action_masks(self) -> np.ndarray:
        """Legal actions from the current schedule (``stop`` always)."""
        return self._mask.copy()

    # ------------------------------------------------------------------ internals
    def _initial_schedule(self, index: int) -> Schedule:
        static, _, kind = self.kernels[index]
        if self.start == "unscheduled":
            return Schedule(static)
        if index not in self._starts:  # the default's steps, replayed (and checked) once per kernel
            self._starts[index] = Schedule.replay(static, strategy_schedule(static, kind, threads=self.threads).trace)
        return self._starts[index].copy()

    def _loops(self) -> list[space.Band]:
        return space.bands_of(self.schedule)[: self.max_loops]

    def _step_of(self, slot: int | None, kind: str) -> list[dict[str, Any]] | None:
        bands = self._loops()
        if slot is None or slot >= len(bands):
            return None
        b = bands[slot]
        if b.mode != "serial" and (kind in ("parallel", "vectorize") or kind.startswith("unroll")):
            return None  # a loop is marked once: marking it again changes nothing or fails
        if kind == "parallel":
            return [{"primitive": "parallel", "args": {"loop": b.name}}]
        if kind == "vectorize":
            return [{"primitive": "vectorize", "args": {"loop": b.name}}] if b.innermost else None
        if kind.startswith("unroll"):
            return [{"primitive": "unroll", "args": {"loop": b.name, "factor": int(kind[6:])}}]
        if kind == "interchange":
            return [{"primitive": "interchange", "args": {"a": b.name, "b": b.child}}] if b.child else None
        if kind.startswith("tile"):
            size = int(kind[4:])
            if b.child is None:
                return None
            return [{"primitive": "tile", "args": {"loops": [b.name, b.child], "sizes": [size, size]}}]
        if kind == "fission1":
            return [{"primitive": "fission", "args": {"loop": b.name, "split_before_child": 1}}] \
                if b.sequence_child > 1 else None
        return None

    @staticmethod
    def _apply(schedule: Schedule, steps: list[dict[str, Any]]) -> bool:
        trial = schedule.copy()
        try:
            for s in steps:
                trial.apply(s["primitive"], **s["args"])
        except (IllegalTransformError, ScheduleError, KilnError, ValueError, KeyError):
            return False
        schedule.__dict__.update(trial.__dict__)
        return True

    def _compute_mask(self) -> np.ndarray:
        mask = np.zeros(len(self.actions), dtype=bool)
        mask[-1] = True
        self._successors = {}
        for i, (slot, kind) in enumerate(self.actions[:-1]):
            steps = self._step_of(slot, kind)
            if steps is not None:
                trial = self.schedule.copy()
                if self._apply(trial, steps):  # checked: legality is the mask
                    mask[i] = True
                    self._successors[i] = trial
        return mask

    def successors(self) -> dict[int, Schedule]:
        """The schedule each legal action (``stop`` aside) leads to from the current one."""
        return {a: s.copy() for a, s in self._successors.items()}

    def _observation(self) -> np.ndarray:
        static = self.kernels[self.index][0]
        program = self.schedule.program(name=static.name)
        obs = list(features(static, self.schedule, program))
        ext = space.extents(program)
        accesses = loop_features(program)
        bands = self._loops()
        for slot in range(self.max_loops):
            if slot < len(bands):
                b = bands[slot]
                e = ext.get(b.name, 16)
                obs += [1.0, b.depth, math.log2(max(1, e)), float(b.innermost), float(b.child is not None),
                        float(b.mode == "parallel"), float(b.mode == "vectorized"), float(b.mode == "unrolled")]
                obs += accesses.get(b.name, [0.0] * len(LOOP_FEATURE_NAMES))
            else:
                obs += [0.0] * SLOT_FEATURES
        obs.append(self.steps / self.max_steps)
        return np.asarray(obs, dtype=np.float32)

    def measurer(self, index: int) -> Measurer:
        if index not in self._measurers:
            static, scalars, kind = self.kernels[index]
            m = Measurer(static, scalars, repeat=self.repeat, cache_dir=self.cache_dir, pool=self.pool)
            default = strategy_schedule(static, kind, threads=self.threads)
            self._defaults[index] = m.time_of(default.program) or float("nan")
            self._measurers[index] = m
        return self._measurers[index]

    def default_time(self, index: int) -> float:
        self.measurer(index)
        return self._defaults[index]

    def measured_speedup(self) -> float:
        """``log2`` of the default time over the current schedule's (measured)."""
        static = self.kernels[self.index][0]
        m = self.measurer(self.index)
        t = m.time_of(self.schedule.program(name=static.name))
        return math.log2(self._defaults[self.index] / t) if t else -1.0

    def rollouts(self, policy: Callable[[np.ndarray, np.ndarray, bool], int], index: int, samples: int = 4,
                 remeasure: int = 7) -> dict[str, Any]:
        """Schedule kernel ``index`` with ``samples`` episodes of ``policy(observation, mask,
        deterministic) -> action``: the first deterministic, the others sampled from the
        policy.  Every final schedule is measured (equal code once); the fastest is then timed
        again against the default, alternating, ``remeasure`` rounds each, so the figure carries
        no selection bias.  Returns ``speedup`` (default time over the chosen schedule's),
        ``deterministic`` (the first episode's measured speedup), ``measurements`` (distinct
        schedules measured) and ``trace``."""
        static, _, kind = self.kernels[index]
        m = self.measurer(index)
        finals: dict[str, tuple[float, Program, list[dict[str, Any]]]] = {}
        first = None
        for episode in range(max(1, int(samples))):
            obs, _ = self.reset(options={"index": index})
            done = False
            while not done:
                action = policy(obs, self.action_masks(), episode == 0)
                obs, _, terminated, truncated, _ = self.step(int(action))
                done = terminated or truncated
            program = self.schedule.program(name=static.name)
            t = m.time_of(program)
            finals.setdefault(str(program), (t if t else math.inf, program, list(self.schedule.trace)))
            if first is None:
                first = self._defaults[index] / t if t else 0.0
        best_t, best, trace = min(finals.values(), key=lambda f: f[0])
        if best_t == math.inf:  # every schedule it chose was wrong or did not compile
            return {"speedup": 0.0, "deterministic": first, "measurements": len(finals), "trace": trace}
        default = strategy_schedule(static, kind, threads=self.threads).program
        best_s, default_s = m.remeasure([best, default], repeat=remeasure)
        return {"speedup": default_s / best_s, "deterministic": first, "measurements": len(finals),
                "trace": trace}

    def _final_reward(self, info: dict[str, Any]) -> float:
        self._episodes += 1
        measured = self.reward_mode == "measured" or self._episodes % self.measure_every == 0
        info["measured"] = measured
        if measured:
            return self.measured_speedup()
        static = self.kernels[self.index][0]
        feats = features(static, self.schedule, self.schedule.program(name=static.name))
        return float(self.cost_model.predict_speedup([feats])[0])


__all__ = ["ACTION_KINDS", "ScheduleKernelEnv", "default_kernels"]
