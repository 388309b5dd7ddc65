"""One place per op: decompositions and costs live on the op declarations.

Covers ``OpDef.decompose`` and the generic ``decompose`` pass, ``OpDef.cost`` with the
helpers of ``kiln/ir/ops/cost.py`` and ``node_flops``, the builders every rewrite uses, and
that ``kiln.ir.ops`` imports every module of its folder.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import numpy as np
import pytest
import torch

import kiln.ir.ops
from kiln.backends import get_backend
from kiln.ir import DType, Graph, KilnError, SymDim, TensorType, all_ops, defop, get_op, registry
from kiln.ir.builder import GraphBuilder
from kiln.ir.ops.cost import numel, per_element, per_input_element
from kiln.passes import PassManager
from kiln.passes.decompose import Decompose, decomposable_ops, select_ops
from kiln.passes.ordering.cost import node_flops
from kiln.passes.pattern import Builder

F32 = DType.float32
BUILTIN_DECOMPOSITIONS = ("gelu", "layer_norm", "log_softmax", "rms_norm", "silu", "silu_mul", "softmax")


def _node(op: str, types, **attrs):
    g = Graph("one")
    ins = [g.add_input(f"x{i}", t) for i, t in enumerate(types)]
    return g, g.add_node(op, ins, attrs)


# ----------------------------------------------------------------------------- cost
@pytest.mark.parametrize("op, types, attrs, flops", [
    ("exp", [TensorType((4, 8), F32)], {}, 4 * 32),
    ("tanh", [TensorType((4, 8), F32)], {}, 6 * 32),
    ("gelu", [TensorType((4, 8), F32)], {}, 10 * 32),
    ("silu_mul", [TensorType((4, 8), F32)] * 2, {}, 7 * 32),
    ("div", [TensorType((4, 8), F32), TensorType((8,), F32)], {}, 2 * 32),
    ("atan2", [TensorType((4, 8), F32)] * 2, {}, 10 * 32),
    ("add", [TensorType((4, 8), F32), TensorType((), F32)], {}, 32),
    ("softmax", [TensorType((4, 8), F32)], {"dim": -1}, 5 * 32),
    ("layer_norm", [TensorType((4, 8), F32)], {"normalized_rank": 1}, 8 * 32),
    ("var", [TensorType((4, 8), F32)], {"dims": (1,)}, 3 * 32),
    ("sum", [TensorType((4, 8), F32)], {"dims": (1,)}, 32),
    ("cumsum", [TensorType((4, 8), F32)], {"dim": 1}, 32),
    ("batch_norm", [TensorType((2, 3, 4), F32)] + [TensorType((3,), F32)] * 4, {}, 2 * 24),
    ("max_pool2d", [TensorType((1, 2, 8, 8), F32)], {"kernel": (2, 2), "stride": (2, 2)}, 128),
    ("adaptive_avg_pool3d", [TensorType((1, 2, 4, 4, 4), F32)], {"output_size": (1, 1, 1)}, 128),
    ("matmul", [TensorType((3, 5), F32), TensorType((5, 7), F32)], {}, 2 * 3 * 7 * 5),
    ("conv", [TensorType((1, 4, 8, 8), F32), TensorType((6, 2, 3, 3), F32)],
     {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 2}, 2 * 6 * 64 * 18),
    ("scaled_dot_product_attention", [TensorType((2, 4, 6, 8), F32), TensorType((2, 4, 5, 8), F32),
                                      TensorType((2, 4, 5, 3), F32)], {}, 48 * 5 * (16 + 6 + 5)),
    ("reshape", [TensorType((4, 8), F32)], {"shape": (32,)}, 0),
])
def test_cost_estimates_are_pinned(op, types, attrs, flops):
    """The estimates the cost model gave before the costs moved onto the declarations."""
    _, node = _node(op, types, **attrs)
    assert node_flops(node) == flops


def test_node_flops_reads_the_declared_cost():
    assert get_op("exp").cost is not None and get_op("add").cost is None
    _, node = _node("exp", [TensorType((4, 8), F32)])
    assert node_flops(node) == get_op("exp").cost([TensorType((4, 8), F32)], [node.output.type])


def test_cost_helpers_count_static_elements():
    t, big = TensorType((4, 8), F32), TensorType((4, 80), F32)
    sym = TensorType((SymDim("n"), 8), F32)
    assert numel(t) == 32 and numel(sym) == 0
    assert per_element(3)([t], [t, t]) == 3 * 64
    assert per_element(3)([t], [sym]) == 0
    assert per_input_element(2)([big], [t]) == 2 * 320   # reductions: the operand's size
    assert per_input_element(2)([t], [big]) == 2 * 320   # results larger: theirs
    assert per_input_element(2)([], [t]) == 2 * 32


# ----------------------------------------------------------------------- decompose
def test_the_builtin_decompositions_are_declared_on_their_ops():
    declared = {n for n, d in all_ops().items() if d.decompose is not None}
    assert set(BUILTIN_DECOMPOSITIONS) <= declared
    assert set(BUILTIN_DECOMPOSITIONS) <= set(decomposable_ops())
    assert select_ops("all") == decomposable_ops()
    assert select_ops(" softmax , gelu") == ("softmax", "gelu")


def test_unknown_ops_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"decompose: unknown op\(s\) relu, mish; known: all, gelu, "):
        Decompose(ops="relu,mish")
    with pytest.raises(ValueError, match=r"unknown op\(s\) exp"):
        PassManager("decompose{ops=exp}")


def _decomposable_graph(op: str) -> Graph:
    g = Graph(op)
    x = g.add_input("x", TensorType((3, 8), F32))
    if op == "silu_mul":
        y = g.op(op, x, g.add_input("y", TensorType((3, 8), F32)))
    elif op in ("softmax", "log_softmax"):
        y = g.op(op, x, dim=1)
    elif op in ("layer_norm", "rms_norm"):
        w, b = g.add_param("w", TensorType((8,), F32)), g.add_param("b", TensorType((8,), F32))
        y = g.add_node(op, [x, w, b] if op == "layer_norm" else [x, w], {"normalized_rank": 1}).output
    else:
        y = g.op(op, x)
    g.set_outputs([y])
    return g


@pytest.mark.parametrize("op", BUILTIN_DECOMPOSITIONS)
def test_each_decomposition_computes_its_op(op):
    g = _decomposable_graph(op)
    out = Decompose(ops=op).run(g)
    assert out.changed and op not in out.graph.op_histogram()
    assert [v.type for v in out.graph.outputs] == [v.type for v in g.outputs]
    rng = np.random.default_rng(0)
    args = [torch.from_numpy(rng.standard_normal(v.shape).astype(np.float32)) for v in g.inputs + g.params]
    want = get_backend("reference").build(g)(args)[0]
    got = get_backend("reference").build(out.graph)(args)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_half_precision_nodes_are_left_alone():
    g = Graph("h")
    x = g.add_input("x", TensorType((3, 8), DType.float16))
    g.set_outputs([g.op("gelu", x)])
    assert not Decompose().run(g).changed


@pytest.fixture
def scratch_ops():
    names = []

    def declare(name, **rules):
        defop(name, infer=lambda types: types[0], traits=("elementwise",), **rules)(lambda x: x * 2)
        names.append(name)

    yield declare
    for name in names:
        registry._REGISTRY.pop(name, None)


def test_an_op_declared_anywhere_is_expanded_by_its_own_rule(scratch_ops):
    scratch_ops("test_op_declaration.double",
                decompose=lambda b, node: [b.add(node.inputs[0], node.inputs[0])])
    assert "test_op_declaration.double" in decomposable_ops()
    g = Graph("d")
    x = g.add_input("x", TensorType((4,), F32))
    g.set_outputs([g.op("test_op_declaration.double", x, loc="model.py:3")])
    out = Decompose().run(g).graph
    assert [(n.op_name, n.loc) for n in out.nodes] == [("add", "model.py:3")]
    assert out.outputs[0].producer.inputs == (out.inputs[0], out.inputs[0])


def test_a_decomposition_of_the_wrong_type_is_reported(scratch_ops):
    scratch_ops("test_op_declaration.bad", decompose=lambda b, node: [b.cast(node.inputs[0], DType.float64)])
    g = Graph("d")
    x = g.add_input("x", TensorType((4,), F32))
    g.set_outputs([g.op("test_op_declaration.bad", x)])
    with pytest.raises(KilnError, match=r"decomposition of test_op_declaration\.bad returned f64\[4\] "
                                         r"for results f32\[4\]"):
        Decompose(ops="test_op_declaration.bad").run(g)


# ------------------------------------------------------------------------- builders
def test_rewrite_builders_are_graph_builders():
    from kiln.passes.optim import _UpdateBuilder

    assert issubclass(Builder, GraphBuilder) and issubclass(_UpdateBuilder, GraphBuilder)
    g = Graph("p")
    x = g.add_input("x", TensorType((4,), F32))
    root = g.add_node("neg", [x], loc="m.py:1")
    g.set_outputs([root.output])
    b = Builder(g, root)
    y = b.mul(x, b.const(np.float32(2.0)))
    assert b.scalar(2.0, F32) is b.const(np.float32(2.0)) is b.const(2.0, F32)
    assert g.nodes[0] is y.producer and y.producer.loc == "m.py:1" and b.created == [y.producer]


def test_the_ops_package_imports_every_module_of_its_folder():
    modules = [m.name for m in pkgutil.iter_modules(kiln.ir.ops.__path__)]
    assert {"elementwise", "arithmetic", "views", "scatter", "upsample", "matmul"} <= set(modules)
    for name in modules:
        assert f"kiln.ir.ops.{name}" in sys.modules, name
        importlib.import_module(f"kiln.ir.ops.{name}")  # importing again declares nothing twice
