"""Costs of a graph that pass ordering minimizes: op count, kernel count, estimated runtime.

Every cost maps a :class:`~kiln.ir.Graph` to a non-negative float; lower is better.

* ``op_count`` -- the number of op nodes, counting the nodes inside ``fused`` bodies
  (fusion groups ops into kernels but removes none; creation ops copied into several bodies
  count once per copy).  This is the metric of the published pass-ordering work (XLA
  instruction counts).
* ``kernel_count`` -- :func:`kiln.passes.fusion.kernel_count`: kernels a backend launches.
* ``runtime`` -- estimated seconds from a roofline model: each kernel takes
  ``max(flops / peak_flops, bytes / bandwidth) + launch_overhead`` on a
  :class:`MachineModel`.  A ``fused`` node moves only its operands and results (its
  intermediates stay in registers or cache); views and creation ops are free.

These are estimates; the measured cost (``"measured"``) belongs to :mod:`kiln.tuning.rl.costs`.

FLOPs per op come from the op's declaration: ``cost=`` on its registry entry, a function
``cost(input_types, output_types, **attrs) -> float`` (:mod:`kiln.ir.ops.cost`).  Ops
without one cost one FLOP per result element (reductions and normalizations: per element
of their first operand); see :func:`node_flops`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kiln.ir import Graph, Node, TensorType
from kiln.passes.fusion import FREE, kernel_count, node_class

CostFn = Callable[[Graph], float]

@dataclass(frozen=True)
class MachineModel:
    """Rates of the machine the roofline model targets.

    Attributes:
        name: a label for reports.
        peak_flops: floating-point operations per second.
        bandwidth: bytes per second between memory and the cores.
        launch_overhead: seconds added per kernel (dispatch, synchronization).
    """

    name: str
    peak_flops: float
    bandwidth: float
    launch_overhead: float


MACHINES: dict[str, MachineModel] = {
    "cpu": MachineModel("cpu", peak_flops=200e9, bandwidth=20e9, launch_overhead=2e-6),
    "gpu": MachineModel("gpu", peak_flops=50e12, bandwidth=3e12, launch_overhead=5e-6),
}
"""Machine presets: a multi-core CPU with AVX2 and an H100-class GPU (fp32 rates)."""


def get_machine(machine: str | MachineModel | None) -> MachineModel:
    """A :class:`MachineModel` from a preset name (``"cpu"`` when ``None``) or as given."""
    if isinstance(machine, MachineModel):
        return machine
    name = machine or "cpu"
    if name not in MACHINES:
        raise ValueError(f"unknown machine model {name!r}; presets: {', '.join(MACHINES)}")
    return MACHINES[name]


# ---------------------------------------------------------------------------- op count
def op_count(graph: Graph) -> int:
    """Number of op nodes in ``graph``, the nodes of ``fused`` bodies included."""
    total = 0
    for node in graph.nodes:
        body = node.attrs.get("body") if node.op_name == "fused" else None
        total += op_count(body) if body is not None else 1
    return total


def edge_count(graph: Graph) -> int:
    """Number of operand uses (data edges) between top-level values and nodes."""
    return sum(len(node.inputs) for node in graph.nodes)


# ---------------------------------------------------------------------------- runtime
def _numel(t: TensorType) -> int:
    return t.numel if t.is_static else 0


def _nbytes(t: TensorType) -> int:
    return t.nbytes if t.is_static else 0


def node_flops(node: Node) -> float:
    """Estimated floating-point operations of one node: its op's declared ``cost``, else one
    per result element (per element of the first operand for reductions and
    normalizations; views and creation ops are free).  ``fused``: the sum of its body."""
    if node.op_name == "fused":
        return sum(node_flops(n) for n in node.attrs["body"].nodes)
    if node.op.cost is not None:
        return float(
            node.op.cost([v.type for v in node.inputs], [v.type for v in node.outputs], **node.attrs)
        )
    cls = node_class(node)
    if cls in FREE:
        return 0.0
    out = sum(_numel(v.type) for v in node.outputs)
    if cls == "reduction":
        first_in = _numel(node.inputs[0].type) if node.inputs else 0
        return float(max(first_in, out))
    return float(out)


def node_bytes(node: Node) -> int:
    """Bytes a kernel for ``node`` reads and writes: its operands and its results."""
    return sum(_nbytes(v.type) for v in node.inputs) + sum(_nbytes(v.type) for v in node.outputs)


def estimate_runtime(graph: Graph, machine: str | MachineModel | None = None) -> float:
    """Estimated seconds to run ``graph`` on ``machine`` (see the module docstring)."""
    rates = get_machine(machine)
    total = 0.0
    for node in graph.nodes:
        if node_class(node) in FREE:
            continue
        compute = node_flops(node) / rates.peak_flops
        memory = node_bytes(node) / rates.bandwidth
        total += max(compute, memory) + rates.launch_overhead
    return total


# ---------------------------------------------------------------------------- arguments
def random_arguments(graph: Graph, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Seeded random inputs and params matching ``graph``'s signature.

    Floats are standard normal (params scaled by 0.1; params feeding a ``batch_norm``
    variance, inside ``fused`` bodies too, are uniform in [0.5, 1.5]), integers lie in ``[0, size)`` where ``size`` is the
    smallest dimension of any float param (so they index embeddings safely) and booleans are
    all true.
    """
    rng = np.random.default_rng(seed)
    dims = [d for p in graph.params if p.dtype.is_floating for d in p.shape if isinstance(d, int)]
    high = max(1, min(dims) if dims else 2)
    variances = _variances(graph)

    def make(value, scale: float) -> np.ndarray:
        t = value.type
        if value in variances:
            return rng.uniform(0.5, 1.5, size=t.shape).astype(t.dtype.numpy)
        if t.dtype.is_floating:
            return (rng.standard_normal(t.shape) * scale).astype(t.dtype.numpy)
        if t.dtype.is_integer:
            return rng.integers(0, high, size=t.shape).astype(t.dtype.numpy)
        return np.ones(t.shape, dtype=t.dtype.numpy)

    return [make(v, 1.0) for v in graph.inputs], [make(v, 0.1) for v in graph.params]


def _variances(graph: Graph) -> set:
    """The values of ``graph`` a ``batch_norm`` reads as its variance, inside ``fused``
    bodies too (a folded convolution's norm): random normal values there would be negative."""
    found = set()
    for n in graph.nodes:
        if n.op_name == "batch_norm" and len(n.inputs) > 4:
            found.add(n.inputs[4])
        body = n.attrs.get("body") if n.op_name == "fused" else None
        if body is not None:
            inner = _variances(body)
            found |= {outer for outer, v in zip(n.inputs, body.inputs) if v in inner}
    return found


# ---------------------------------------------------------------------------- registry
COSTS = ("op_count", "kernel_count", "runtime")
"""Names accepted by :func:`get_cost`."""


def get_cost(name: str, machine: str | MachineModel | None = None) -> CostFn:
    """The cost function called ``name`` (one of :data:`COSTS`)."""
    if name == "op_count":
        return lambda g: float(op_count(g))
    if name == "kernel_count":
        return lambda g: float(kernel_count(g))
    if name == "runtime":
        rates = get_machine(machine)
        return lambda g: estimate_runtime(g, rates)
    raise ValueError(f"unknown cost {name!r}; choose one of {', '.join(COSTS)}")


def cost_table(
    graph: Graph,
    names: Sequence[str] = ("op_count", "kernel_count", "runtime"),
    machine: str | MachineModel | None = None,
) -> dict[str, float]:
    """Every named cost of ``graph``, in a dict."""
    return {name: get_cost(name, machine)(graph) for name in names}
