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
* ``measured`` -- median wall time of the numpy reference implementations on seeded random
  arguments; slow, noisy, and optional.

FLOPs per op come from :data:`FLOPS_PER_ELEMENT` and the rules in :func:`node_flops`.  An
op may override them by declaring ``cost=`` on its registry entry: a function
``cost(input_types, output_types, **attrs) -> float`` returning FLOPs.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kiln.ir import Graph, Node, TensorType
from kiln.ir.ops.fused import run_body
from kiln.passes.fusion import FREE, kernel_count, node_class

CostFn = Callable[[Graph], float]

FLOPS_PER_ELEMENT: dict[str, float] = {
    # transcendental elementwise ops cost several multiply-adds each
    "exp": 4,
    "expm1": 4,
    "log": 4,
    "log1p": 4,
    "log2": 4,
    "tanh": 6,
    "sigmoid": 5,
    "erf": 6,
    "gelu": 10,
    "silu": 6,
    "silu_mul": 7,
    "pow": 6,
    "sqrt": 2,
    "rsqrt": 2,
    "sin": 6,
    "cos": 6,
    "tan": 8,
    "atan": 8,
    "atan2": 10,
    "div": 2,
    "reciprocal": 2,
    "remainder": 3,
    # normalizations: per element of the input
    "softmax": 5,
    "log_softmax": 6,
    "layer_norm": 8,
    "rms_norm": 5,
    "batch_norm": 2,
    "var": 3,
}
"""FLOPs per result element (per input element for reductions and normalizations)."""


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
    """Estimated floating-point operations of one node (``fused``: the sum of its body)."""
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
    first_in = _numel(node.inputs[0].type) if node.inputs else 0
    kind = node.op_name
    if cls == "matmul":
        a = node.inputs[0].type
        k = a.shape[-1] if a.rank and isinstance(a.shape[-1], int) else 1
        return 2.0 * out * k
    if cls == "conv":
        w = node.inputs[1].type
        per_output = math.prod(d for d in w.shape[1:] if isinstance(d, int))
        return 2.0 * out * per_output
    if kind == "scaled_dot_product_attention":
        q, k, v = (node.inputs[i].type for i in range(3))
        rows = _numel(q) // max(1, q.shape[-1])  # batch * heads * L
        keys = k.shape[-2] if isinstance(k.shape[-2], int) else 1
        return float(rows * keys * (2 * q.shape[-1] + 2 * v.shape[-1] + FLOPS_PER_ELEMENT["softmax"]))
    if cls == "reduction" or kind in ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "max_pool3d",
                                         "avg_pool3d", "adaptive_avg_pool3d", "cumsum"):
        return FLOPS_PER_ELEMENT.get(kind, 1.0) * max(first_in, out)
    return FLOPS_PER_ELEMENT.get(kind, 1.0) * out


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


# ---------------------------------------------------------------------------- measured
def random_arguments(graph: Graph, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Seeded random inputs and params matching ``graph``'s signature.

    Floats are standard normal (params scaled by 0.1; params feeding a ``batch_norm``
    variance are uniform in [0.5, 1.5]), integers lie in ``[0, size)`` where ``size`` is the
    smallest dimension of any float param (so they index embeddings safely) and booleans are
    all true.
    """
    rng = np.random.default_rng(seed)
    dims = [d for p in graph.params if p.dtype.is_floating for d in p.shape if isinstance(d, int)]
    high = max(1, min(dims) if dims else 2)
    variances = {n.inputs[4] for n in graph.nodes if n.op_name == "batch_norm"}

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


def measure_runtime(graph: Graph, *, repeats: int = 3, seed: int = 0) -> float:
    """Median wall time in seconds of running ``graph`` with the registry's numpy references
    (the semantics of the reference executor) on seeded random arguments."""
    inputs, params = random_arguments(graph, seed)
    flat = graph.clone()  # params become trailing inputs, so the ir-level interpreter runs it
    flat.inputs, flat.params = flat.inputs + flat.params, []
    arrays = inputs + params
    run_body(flat, arrays)  # warm-up
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        run_body(flat, arrays)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------- registry
COSTS = ("op_count", "kernel_count", "runtime", "measured")
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
    if name == "measured":
        return measure_runtime
    raise ValueError(f"unknown cost {name!r}; choose one of {', '.join(COSTS)}")


def cost_table(
    graph: Graph,
    names: Sequence[str] = ("op_count", "kernel_count", "runtime"),
    machine: str | MachineModel | None = None,
) -> dict[str, float]:
    """Every named cost of ``graph``, in a dict."""
    return {name: get_cost(name, machine)(graph) for name in names}
