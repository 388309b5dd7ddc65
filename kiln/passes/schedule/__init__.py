"""Loop schedules: checked transformation primitives, traces, and a research API."""

from .research import (
    NodeInfo, Step, applicable, candidate_steps, export_dataset, measure_runtime, nodes, random_legal_sequence,
    random_sequence,
)
from .schedule import PRIMITIVES, Schedule

__all__ = [
    "NodeInfo", "PRIMITIVES", "Schedule", "Step", "applicable", "candidate_steps", "export_dataset",
    "measure_runtime", "nodes", "random_legal_sequence", "random_sequence",
]
