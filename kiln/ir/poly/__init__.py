"""The polyhedral view of loop programs, through isl (``islpy``).

* :mod:`.model` -- statements as iteration domains and access relations;
* :mod:`.tree` -- schedule trees (bands of per-statement quasi-affine functions, sequences);
* :mod:`.deps` -- exact memory-based dependences (flow, anti, output);
* :mod:`.legality` -- legality and exact parallelism checks with explanations in words;
* :mod:`.astgen` -- isl AST generation back to loop programs;
* :mod:`.extents` -- array extents inferred from accesses (used by ``from_c``);
* :mod:`.coverage` -- exactly-once proofs of task mappings;
* :mod:`.races` -- the data-race check of GPU kernels (barrier phases, blocks).
"""

from .coverage import CoverageError, CoverageProof, prove_coverage
from .deps import Dependence, Dependences, compute_dependences
from .legality import Instance, Verdict, Violation, check_schedule
from .model import Access, PolyModel, PolyStatement, build_model
from .races import RaceError, check_races
from .tree import Band, Leaf, Sequence, TreeNode, format_tree, initial_tree, time_maps

__all__ = [
    "Access", "Band", "CoverageError", "CoverageProof", "RaceError", "check_races", "prove_coverage", "Dependence", "Dependences", "Instance", "Leaf", "PolyModel", "PolyStatement",
    "Sequence", "TreeNode", "Verdict", "Violation", "build_model", "check_schedule", "compute_dependences",
    "format_tree", "initial_tree", "time_maps",
]
