"""The action space of pass ordering: registered passes and parameterized variants, plus stop.

An :class:`Action` is a small record: a label and the pipeline text of the one pass it
applies (``None`` for :data:`STOP`).  Action sets are fixed, ordered tuples, because a
trained policy refers to actions by position; a policy file stores the pipeline texts of
its actions, so it keeps working when new sets are added.

* ``base`` -- every pass of the default pipeline with default options: ``canonicalize``,
  ``simplify``, ``fold``, ``cse``, ``dce``, ``sink-views``, ``composites``, ``fuse``.
* ``extended`` -- ``base`` plus order-sensitive decisions: composite pattern subsets,
  fusion size limits and strategies, decomposition of composite ops
  (:mod:`kiln.passes.decompose`: recognize a composite or expose its pieces), and
  duplication of cheap shared producers before fusion (:mod:`kiln.passes.recompute`:
  fewer bytes for more arithmetic; rematerialization on training graphs).

Every set ends with ``stop``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from kiln.passes.base import Pass
from kiln.passes.manager import parse_pipeline


@dataclass(frozen=True)
class Action:
    """One choice of the agent: apply the pass written ``spec``, or stop (``spec=None``)."""

    spec: str | None

    @property
    def name(self) -> str:
        return self.spec if self.spec is not None else "stop"

    @property
    def is_stop(self) -> bool:
        return self.spec is None

    @cached_property
    def pass_(self) -> Pass:
        """The configured pass object (``ValueError`` for :data:`STOP`)."""
        if self.spec is None:
            raise ValueError("the stop action applies no pass")
        passes = parse_pipeline(self.spec)
        if len(passes) != 1:
            raise ValueError(f"action {self.spec!r} must name exactly one pass")
        return passes[0]


STOP = Action(None)

BASE_SPECS = ("canonicalize", "simplify", "fold", "cse", "dce", "sink-views", "composites", "fuse")

EXTENDED_SPECS = BASE_SPECS + (
    "composites{patterns=attention}",
    "composites{patterns=softmax}",
    "composites{patterns=layer_norm}",
    "composites{patterns=gelu}",
    'composites{patterns="silu,gated_mlp"}',
    "fuse{max_nodes=4}",
    "fuse{max_nodes=8}",
    "fuse{max_nodes=16}",
    "fuse{max_nodes=64}",
    "fuse{strategy=elementwise-only}",
    "fuse{strategy=none-across-reductions}",
    "decompose",
    "decompose{ops=softmax}",
    "decompose{ops=layer_norm}",
    "decompose{ops=gelu}",
    "recompute",
    "recompute{max_users=2}",
)

ACTION_SETS: dict[str, tuple[str, ...]] = {"base": BASE_SPECS, "extended": EXTENDED_SPECS}
"""Pipeline texts of each named action set, in action order (``stop`` comes last)."""


def make_actions(specs: Sequence[str]) -> tuple[Action, ...]:
    """Actions for the given pipeline texts, followed by :data:`STOP`; each text is checked."""
    actions = tuple(Action(spec) for spec in specs)
    for action in actions:
        action.pass_  # noqa: B018  (parse now: a typo fails here, not mid-episode)
    return actions + (STOP,)


def action_set(name_or_specs: str | Sequence[str]) -> tuple[Action, ...]:
    """The action set called ``name`` (see :data:`ACTION_SETS`), or one made of pipeline texts."""
    if isinstance(name_or_specs, str):
        if name_or_specs not in ACTION_SETS:
            raise ValueError(f"unknown action set {name_or_specs!r}; known: {', '.join(ACTION_SETS)}")
        return make_actions(ACTION_SETS[name_or_specs])
    return make_actions([s for s in name_or_specs if s != "stop"])
