"""Loop schedules: checked transformation primitives, traces, and a research API (timing
schedules and writing datasets: :mod:`kiln.tuning.schedules`)."""

from .research import (
    NodeInfo, Step, applicable, candidate_steps, nodes, random_legal_sequence, random_sequence,
)
from .schedule import PRIMITIVES, Schedule

__all__ = [
    "NodeInfo", "PRIMITIVES", "Schedule", "Step", "applicable", "candidate_steps", "nodes",
    "random_legal_sequence", "random_sequence",
]
