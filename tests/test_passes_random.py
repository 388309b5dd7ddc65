"""Property test: random sequences of the built-in passes on random small graphs keep the
graph valid and its outputs unchanged."""

from __future__ import annotations

import math
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph, OpTypeError, TensorType, Value
from kiln.passes import PassManager

MAX_EXAMPLES = int(os.environ.get("KILN_RANDOM_EXAMPLES", "60"))
"""Examples per run; raise it (e.g. ``KILN_RANDOM_EXAMPLES=2000``) to hunt for bugs."""
PASSES = ["canonicalize", "simplify", "fold", "cse", "dce", "sink-views", "fold{max_elements=4}",
          "composites", "fuse", "fuse{max_nodes=2}"]
F32 = DType.float32
UNARY = ["neg", "abs", "relu", "tanh", "sigmoid", "exp", "sqrt", "log"]
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]
SPLATS = [0.0, -0.0, 1.0, 2.0, 0.25, -3.0]
CASTS = [F32, DType.float64, DType.float16, DType.int32, DType.int64, DType.int8]


def _factor_shapes(numel: int) -> list[tuple[int, ...]]:
    shapes = [(numel,), (1, numel)]
    for d in range(2, numel):
        if numel % d == 0:
            shapes.append((d, numel // d))
    return shapes


class _Builder:
    """Draws nodes onto a graph; every draw yields a well-typed node or nothing."""

    def __init__(self, data: st.DataObject):
        self.data = data
        self.g = Graph("random")
        self.pool: list[Value] = []

    def pick(self, pred=lambda v: True) -> Value | None:
        """A pool value; the newest one half of the time, so chains (neg of neg...) form."""
        choices = [v for v in self.pool if pred(v)]
        if not choices:
            return None
        if self.data.draw(st.booleans()):
            return choices[-1]
        return self.data.draw(st.sampled_from(choices))

    def add(self, kind: str, *operands: Value, **attrs) -> None:
        try:
            self.pool.append(self.g.op(kind, *operands, **attrs))
        except OpTypeError:
            pass  # the draw did not type-check; skipping it keeps the graph valid

    def constant(self, shape: tuple[int, ...], dtype: DType = F32) -> Value:
        draw = self.data.draw
        if draw(st.booleans()):
            return self.g.add_constant(np.full(shape, draw(st.sampled_from(SPLATS)), dtype.numpy))
        seed = draw(st.integers(0, 2**16))
        data = np.random.default_rng(seed).standard_normal(shape) * 3
        return self.g.add_constant(data.astype(dtype.numpy))

    def step(self) -> None:
        draw = self.data.draw
        kind = draw(st.sampled_from(["unary", "binary", "binary", "const", "reduce", "matmul",
                                     "permute", "reshape", "expand", "slice", "cast", "full"]))
        x = self.pick()
        if kind == "unary":
            self.add(draw(st.sampled_from(UNARY)), x)
        elif kind == "binary":
            y = self.pick() if draw(st.booleans()) else self.constant(
                draw(st.sampled_from([(), x.shape, x.shape[-1:]])), x.dtype)
            a, b = (x, y) if draw(st.booleans()) else (y, x)
            self.add(draw(st.sampled_from(BINARY)), a, b)
        elif kind == "const":
            self.pool.append(self.constant(draw(st.sampled_from([(), (3,), (2, 3)]))))
        elif kind == "reduce" and x.type.rank > 0:
            dims = [draw(st.integers(-x.type.rank, x.type.rank - 1))]
            self.add(draw(st.sampled_from(["sum", "amax", "mean"])), x, dims=dims,
                     keepdim=draw(st.booleans()))
        elif kind == "matmul" and x.type.rank == 2:
            w = self.pick(lambda v: v.type.rank == 2 and v.shape[0] == x.shape[1] and v.dtype == x.dtype)
            self.add("matmul", x, w if w is not None else self.constant((x.shape[1], 3)))
        elif kind == "permute" and x.type.rank > 1:
            perm = draw(st.permutations(range(x.type.rank)))
            self.add("permute", x, dims=[p - x.type.rank if draw(st.booleans()) else p for p in perm])
        elif kind == "reshape" and x.type.rank > 0:
            shape = list(draw(st.sampled_from(_factor_shapes(math.prod(x.shape)))))
            if draw(st.booleans()):
                shape[0] = -1
            self.add("reshape", x, shape=shape)
        elif kind == "expand" and 1 in x.shape:
            self.add("expand", x, shape=[draw(st.sampled_from([-1, 1, 2])) if d == 1 else -1
                                         for d in x.shape])
        elif kind == "slice" and x.type.rank > 0:
            dim = draw(st.integers(0, x.type.rank - 1))
            self.add("slice", x, dim=dim, start=draw(st.integers(-2, 1)),
                     end=draw(st.sampled_from([2, 9223372036854775807, -1])))
        elif kind == "cast":
            self.add("cast", x, dtype=draw(st.sampled_from(CASTS)))
        elif kind == "full":
            self.add("full", shape=list(x.shape), value=draw(st.sampled_from([0, 1, 2])), dtype=x.dtype)


@st.composite
def random_graphs(draw) -> Graph:
    b = _Builder(draw(st.data()))
    for i, shape in enumerate(draw(st.lists(st.sampled_from([(2, 3), (3,), (1, 3), (3, 2, 1)]),
                                            min_size=1, max_size=3))):
        b.pool.append(b.g.add_input(f"x{i}", TensorType(shape, F32)))
    for _ in range(draw(st.integers(1, 12))):
        b.step()
    results = [v for v in b.pool if v.origin == "result"] or b.pool
    outputs = [results[-1]] + draw(st.lists(st.sampled_from(results), max_size=2))
    b.g.set_outputs(outputs)
    return b.g


def _outputs(graph: Graph, inputs: list[np.ndarray]) -> list[np.ndarray]:
    with np.errstate(all="ignore"):
        return run_graph(graph, inputs, [])


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=random_graphs(), passes=st.lists(st.sampled_from(PASSES), min_size=1, max_size=6),
       seed=st.integers(0, 1000))
def test_random_pass_sequences_preserve_outputs(graph, passes, seed):
    ir.verify(graph)
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(v.shape).astype(np.float32) for v in graph.inputs]
    text = str(graph)
    result = PassManager(passes, verify=True, check_input_unchanged=True).run(graph)
    assert str(graph) == text
    assert str(ir.parse(str(result.graph))) == str(result.graph)
    want, got = _outputs(graph, inputs), _outputs(result.graph, inputs)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-5, atol=1e-6)
    last = PassManager(passes[-1:]).run(result.graph)
    assert not last.changed, f"{passes[-1]} is not idempotent on\n{result.graph}"
